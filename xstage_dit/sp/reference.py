"""The reference Ulysses backend: all_to_all_single (NCCL or gloo) around the best SDPA kernel.

It is the correctness oracle, the CPU path, and the serial baseline that faster backends are measured against.
Two collectives per attention call: one for q, k, v together, one for the output (text heads ride along)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .backends import UlyssesLayout, key_mask, register_backend
from .local_attention import sdpa_bshd


def _scatter_heads(
    tensors: tuple[torch.Tensor, ...], layout: UlyssesLayout, group: dist.ProcessGroup
) -> torch.Tensor:
    """(B, T + L, H, D) tensors, sequence-sharded -> one (n, B, N*L, H/N, D) tensor, head-sharded."""
    n_ranks = layout.degree
    batch, _, heads, head_dim = tensors[0].shape
    send = tensors[0].new_empty(n_ranks, len(tensors), batch, layout.local_len, heads // n_ranks, head_dim)
    for i, t in enumerate(tensors):
        # chunk j of the heads goes to rank j
        send[:, i].copy_(layout.split(t)[1].unflatten(2, (n_ranks, -1)).permute(2, 0, 1, 3, 4))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j] holds rank j's tokens of this rank's heads: concatenating over j restores the sequence order
    return recv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)


def _gather_heads(out: torch.Tensor, layout: UlyssesLayout, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T + N*L, H/N, D) with text first, head-sharded -> (B, T + L, H, D) in the layout's order: this
    rank's tokens, all heads."""
    n_ranks, text_len, local_len = layout.degree, layout.text_len, layout.local_len
    image = out[:, text_len:].unflatten(1, (n_ranks, local_len)).transpose(0, 1)  # (N, B, L, H/N, D)
    if text_len:
        # every rank needs the text rows of every head: send this rank's text rows to all ranks
        text = out[:, :text_len].unsqueeze(0).expand(n_ranks, -1, -1, -1, -1)
        send = torch.cat([text, image], dim=2)
    else:
        send = image.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[j]: this rank's rows of rank j's heads, text rows first
    full = recv.permute(1, 2, 0, 3, 4).flatten(2, 3)
    return layout.join(full[:, :text_len], full[:, text_len:])


@register_backend("reference")
def reference_ulysses(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: UlyssesLayout,
    group: dist.ProcessGroup,
    scale: float | None,
    text_mask: torch.Tensor | None,
) -> torch.Tensor:
    text_len = layout.text_len
    q, k, v = _scatter_heads((query, key, value), layout, group).unbind(0)
    if text_len:
        # text rows are replicated: each rank takes its own heads of them locally, and attends with text first
        heads = slice(layout.rank * q.shape[2], (layout.rank + 1) * q.shape[2])
        q, k, v = (torch.cat([layout.split(t)[0][:, :, heads], x], dim=1)
                   for t, x in ((query, q), (key, k), (value, v)))
    # padded tokens sit at the tail of the gathered sequence: dropping them from the keys masks them exactly
    valid = text_len + layout.seq_len
    out = sdpa_bshd(q, k[:, :valid], v[:, :valid], attn_mask=key_mask(text_mask, layout.seq_len), scale=scale)
    return _gather_heads(out, layout, group)
