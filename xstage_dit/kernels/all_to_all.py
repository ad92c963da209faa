"""The Ulysses pre-attention all-to-all as a store kernel: a rank writes its image tokens of a (B, L, H, D)
tensor straight into every destination rank's head-sharded buffer, (B, T + N*L, H/N, D), at the rows of its
own tokens: head chunk j goes to rank j, the transpose folded into the stores. Destinations are a table of element
offsets from this rank's own buffer `base` (kernels/tables.py: symmetric-memory peers, or local buffers in
loopback), all with the strides of `base`."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tables import ALIGN_ELEMENTS


@triton.jit
def _scatter_heads_kernel(
    Src, Offsets, Base, rows, heads, heads_per_rank, row0,
    stride_sb, stride_ss, stride_sh,
    stride_db, stride_ds, stride_dh,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
):
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // heads).to(tl.int64)
    head = pid_bh % heads
    offs_s = pid_s * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_s[:, None] < rows
    x = tl.load(Src + batch * stride_sb + head * stride_sh + offs_s[:, None] * stride_ss + offs_d[None, :], mask=ok)
    to_rank = tl.multiple_of(tl.load(Offsets + head // heads_per_rank), ALIGN)
    tl.store(Base + to_rank + batch * stride_db + (head % heads_per_rank) * stride_dh + (row0 + offs_s[:, None]) * stride_ds
             + offs_d[None, :], x, mask=ok)


def scatter_heads(src: torch.Tensor, offsets: torch.Tensor, base: torch.Tensor, row0: int) -> None:
    """Store `src` (B, L, H, D) into destination j's (B, rows, H/N, D) buffer at rows [row0, row0 + L), heads
    [j*H/N, (j+1)*H/N) of `src` going to rank j. Destination j sits `offsets[j]` elements from `base` (this
    rank's own buffer, which gives the strides)."""
    batch, rows, heads, head_dim = src.shape
    n_dest = offsets.numel()
    if heads % n_dest or src.stride(-1) != 1:
        raise ValueError(f"scatter_heads: {heads} heads over {n_dest} ranks, head_dim axis must be contiguous")
    block = 16 if src.device.type == "cpu" else 64
    grid = (triton.cdiv(rows, block), batch * heads)
    _scatter_heads_kernel[grid](
        src, offsets, base, rows, heads, heads // n_dest, row0,
        src.stride(0), src.stride(1), src.stride(2),
        base.stride(0), base.stride(1), base.stride(2),
        HEAD_DIM=head_dim, BLOCK=block, ALIGN=ALIGN_ELEMENTS,
    )
