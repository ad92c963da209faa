"""The fused Ulysses backend (X-Stage piggyback): no collective calls, only stores into symmetric memory issued
from the kernels themselves.

1. pre-all-to-all: one store kernel per q, k, v writes this rank's image tokens of every head chunk straight into
   the owning rank's head-sharded buffer (text heads are copied locally: text is replicated);
2. barrier (system-scope release/acquire signals): every rank's rows have landed;
3. attention with the scatter epilogue: each output tile's owner stores it into the buffer of the rank that owns
   those tokens, in that rank's (B, T + L, H, D) layout, and moves on to its next tile; the tile order is the
   Burst-Gap planner's (rotated so that ranks do not all store into one destination at once);
4. barrier: every rank's output rows have landed; the pooled output buffer is returned (the custom op in
   sp/ops.py copies it out).

Buffers come from the group's SymmetricPool (allocated on the first call of a shape, then reused). The output
is valid until this rank's next fused attention call, which cannot start overwriting it before this rank has
passed the next call's first barrier, i.e. after the caller consumed it (stream order)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.all_to_all import scatter_heads
from ..kernels.attention import SUPPORTED_HEAD_DIMS, Scatter, flash_attention
from ..logging_utils import warn_once
from ..runtime.symmetric import SymmetricPool
from .auto import rotated_tile_order
from .backends import UlyssesLayout, register_backend
from .local_attention import sdpa_bshd
from .reference import reference_ulysses


def kernels_accept(query: torch.Tensor) -> bool:
    """Our kernels' head dims and dtypes."""
    return query.shape[-1] in SUPPORTED_HEAD_DIMS and query.dtype in (torch.bfloat16, torch.float16)


def _supported(query: torch.Tensor) -> bool:
    if kernels_accept(query):
        return True
    warn_once(f"xstage_dit fused backend: head_dim {query.shape[-1]} / {query.dtype} is not supported by its "
              "kernels (head_dim 64 or 128, bf16 or fp16); falling back to the reference backend")
    return False


def flash_attention_bshd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """Degree 1: our attention kernel; key-padding masks (B, 1, 1, keys) become its key mask."""
    if not _supported(query):
        return sdpa_bshd(query, key, value, attn_mask=attn_mask, scale=scale)
    return flash_attention(query, key, value, scale=scale, key_mask=_key_mask(attn_mask))


def _key_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, T) bool keep-mask from a (B, 1, 1, T) boolean or additive mask."""
    if mask is None:
        return None
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise ValueError(f"xstage_dit fused backend: only key-padding masks (B, 1, 1, keys) are supported, "
                         f"got {tuple(mask.shape)}")
    flat = mask[:, 0, 0]
    return flat if flat.dtype == torch.bool else flat > torch.finfo(flat.dtype).min / 2


def first_row(layout: UlyssesLayout, rotated: bool) -> int:
    """Where this rank's attention programs start (Scatter.first_row). The gathered buffers hold [text, image of
    rank 0, 1, ...]: the rotated order starts at rank + 1's rows, rank-major at row 0."""
    return layout.text_len + (layout.rank + 1) % layout.degree * layout.local_len if rotated else 0


@register_backend("fused", local=flash_attention_bshd, needs_cuda=True, symmetric=True, accepts=kernels_accept)
def fused_ulysses(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: UlyssesLayout,
    group: dist.ProcessGroup,
    scale: float | None,
    text_mask: torch.Tensor | None,
) -> torch.Tensor:
    if not _supported(query):
        return reference_ulysses(query, key, value, layout, group, scale, text_mask)
    pool = SymmetricPool.of(group)
    batch, _, heads, head_dim = query.shape
    n_ranks, rank, text_len, local_len = layout.degree, layout.rank, layout.text_len, layout.local_len
    share = heads // n_ranks
    gathered = (batch, text_len + layout.padded_len, share, head_dim)
    buffers = [pool.buffer(name, gathered, query.dtype) for name in ("q", "k", "v")]
    out = pool.buffer("out", (batch, text_len + local_len, heads, head_dim), query.dtype)

    for buffer, tensor in zip(buffers, (query, key, value)):
        text, image = layout.split(tensor)
        scatter_heads(image, buffer.offsets, buffer.tensor, row0=text_len + rank * local_len)
        if text_len:
            buffer.tensor[:, :text_len] = text[:, :, rank * share : (rank + 1) * share]
    pool.barrier("fused attention (pre-all-to-all)")
    q, k, v = (b.tensor for b in buffers)
    scatter = Scatter(out.offsets, text_len, local_len, layout.text_first, rank * share,
                      first_row(layout, rotated_tile_order(query, layout)))
    flash_attention(q, k, v, scale=scale, kv_len=text_len + layout.seq_len, key_mask=_key_mask(text_mask),
                    out=out.tensor, scatter=scatter)
    pool.barrier("fused attention (post-all-to-all)")
    return out.tensor
