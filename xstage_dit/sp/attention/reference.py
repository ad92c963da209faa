"""The reference Ulysses backend: all_to_all_single (NCCL or gloo) around the best SDPA kernel.

It is the correctness oracle, the CPU path, and the serial baseline that faster backends are measured against.
Two collectives per attention call: one for q, k, v together, one for the output (text heads ride along)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...burst_gap.planner import Planner
from .backends import Backend, LocalAttention
from .exchange import Transport, all_to_all, finish_gather, finish_scatter, start_gather, start_scatter
from .layout import UlyssesLayout
from .local import sdpa_bshd
from .masks import pair_bias, with_image_keys


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: UlyssesLayout,
                    scale: float | None, text_mask: torch.Tensor | None, attend: LocalAttention,
                    text_factor: bool = False) -> torch.Tensor:
    """Attention over [text, whole image sequence] for this rank's heads. The padded tokens sit at the tail of
    the gathered sequence: dropping them from the keys masks them exactly. `text_factor`: `text_mask` is the
    text tokens' factor of a pair bias (masks.QueryKeyMasks.PAIR_BIAS), not a key-padding mask."""
    valid = layout.key_len
    if text_factor and text_mask is not None:
        mask = pair_bias(text_mask, layout, q.shape[1], valid)
    else:
        mask = with_image_keys(text_mask, layout.seq_len)
    return attend(q, k[:, :valid], v[:, :valid], mask, scale)


def reference_ulysses(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: UlyssesLayout,
    group: dist.ProcessGroup,
    scale: float | None,
    text_mask: torch.Tensor | None,
    attend: LocalAttention,
) -> torch.Tensor:
    return serial_exchange(query, key, value, layout, all_to_all(group), scale, text_mask, attend)


CHOICE = Backend("reference", ulysses=reference_ulysses, local=sdpa_bshd, cost=Planner.serial_call)


def serial_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                    transport: Transport, scale: float | None, text_mask: torch.Tensor | None,
                    attend: LocalAttention = sdpa_bshd, text_factor: bool = False) -> torch.Tensor:
    """Exchange, attend, exchange back, one after the other, over `transport` (`text_factor`: see
    attend_gathered)."""
    qkv = (query, key, value)
    every_head = slice(0, query.shape[2] // layout.degree)
    q, k, v = finish_scatter(start_scatter(qkv, layout, transport, every_head), qkv, layout, every_head)
    out = attend_gathered(q, k, v, layout, scale, text_mask, attend, text_factor)
    return finish_gather(start_gather(out, layout, transport), layout)
