"""The overlap Ulysses backend: the best vendor attention (cuDNN SDPA on GPUs), with the all-to-alls hidden
behind it by chunking each rank's heads. While chunk i computes, chunk i+1's q, k, v and chunk i-1's output
are in flight (NCCL runs them on its own stream; gloo on its threads). No own kernel: the strongest non-fused
design, and the one the fused backend has to beat."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .backends import LocalAttention, RingBlocks, Strategy
from .exchange import (GatheredAttention, Transport, all_to_all, finish_gather, finish_scatter, start_gather,
                       start_scatter)
from .layout import UlyssesLayout
from .local import sdpa_bshd
from .reference import over_gathered

# chunks per rank's head share: more hides more transfer behind compute, but shrinks each attention launch
MAX_CHUNKS = 4


def head_chunks(share: int, max_chunks: int = MAX_CHUNKS) -> list[slice]:
    """Split a rank's `share` heads into at most `max_chunks` near-equal contiguous chunks."""
    count = min(share, max_chunks)
    bounds = [share * i // count for i in range(count + 1)]
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def overlap_ulysses(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: UlyssesLayout,
    group: dist.ProcessGroup,
    scale: float | None,
    text_mask: torch.Tensor | None,
    attend: LocalAttention,
) -> torch.Tensor:
    return chunked_exchange(query, key, value, layout, all_to_all(group, async_op=True), scale, text_mask, attend)


def overlap_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                     group: dist.ProcessGroup, gathered: GatheredAttention) -> torch.Tensor:
    return chunked_around(query, key, value, layout, all_to_all(group, async_op=True), gathered)


# inside a ring, each head chunk runs the whole ring while the next chunk's exchange is in flight
CHOICE = Strategy("overlap", ulysses=overlap_ulysses, local=sdpa_bshd,
                  cost=lambda planner, shape: planner.overlap_call(shape, MAX_CHUNKS), exchange=overlap_exchange,
                  ring=RingBlocks.POINT_TO_POINT).with_fp8()


def chunked_around(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                   transport: Transport, gathered: GatheredAttention) -> torch.Tensor:
    """Head chunks over an asynchronous `transport`: chunk i+1's exchange and chunk i-1's way back are in flight
    while chunk i's `gathered` attention runs."""
    qkv = (query, key, value)
    n_ranks = layout.degree
    chunks = head_chunks(query.shape[2] // n_ranks)
    incoming = start_scatter(qkv, layout, transport, chunks[0])
    outgoing = []
    for i, heads in enumerate(chunks):
        current = incoming
        if i + 1 < len(chunks):
            incoming = start_scatter(qkv, layout, transport, chunks[i + 1])
        q, k, v = finish_scatter(current, qkv, layout, heads)
        outgoing.append(start_gather(gathered(q, k, v, heads), layout, transport))
    out = torch.empty_like(query)
    by_rank = out.unflatten(2, (n_ranks, -1))  # (B, T + L, N, H/N, D)
    for heads, flight in zip(chunks, outgoing):
        by_rank[:, :, :, heads] = finish_gather(flight, layout).unflatten(2, (n_ranks, -1))
    return out


def chunked_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                     transport: Transport, scale: float | None, text_mask: torch.Tensor | None,
                     attend: LocalAttention = sdpa_bshd) -> torch.Tensor:
    """Head chunks over an asynchronous `transport`, each attended by `attend` over the gathered heads."""
    return chunked_around(query, key, value, layout, transport, over_gathered(layout, scale, text_mask, attend))
