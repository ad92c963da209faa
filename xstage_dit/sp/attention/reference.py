"""The reference Ulysses backend: all_to_all_single (NCCL or gloo) around the best SDPA kernel.

It is the correctness oracle, the CPU path, and the serial baseline that faster backends are measured against.
Two collectives per attention call: one for q, k, v together, one for the output (text heads ride along)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...burst_gap.ulysses_plan import UlyssesPlanner
from .backends import LocalAttention, RingBlocks, Strategy, Supports
from .exchange import (GatheredAttention, Transport, all_to_all, finish_gather, finish_scatter, start_gather,
                       start_scatter)
from .layout import UlyssesLayout, WholeKeys
from .local import sdpa_bshd
from .masks import pair_bias, with_image_keys


def attend_gathered(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: UlyssesLayout,
                    scale: float | None, text_mask: torch.Tensor | None, attend: LocalAttention,
                    text_factor: bool = False, whole: WholeKeys | None = None) -> torch.Tensor:
    """Attention over [text, whole image sequence] for this rank's heads, and over `whole` (these heads of keys
    every rank holds whole) where given. The padded tokens sit at the tail of the gathered sequence: dropping them
    from the keys masks them exactly. `text_factor`: `text_mask` is the text tokens' factor of a pair bias
    (masks.QueryKeyMasks.PAIR_BIAS), not a key-padding mask."""
    valid = layout.key_len
    if text_factor and text_mask is not None:
        mask = pair_bias(text_mask, layout, q.shape[1], valid)
    else:
        mask = with_image_keys(text_mask, layout.seq_len)
    k, v = k[:, :valid], v[:, :valid]
    if whole is not None:
        k, v = torch.cat([k, whole.key], dim=1), torch.cat([v, whole.value], dim=1)
        mask = with_image_keys(mask, whole.key.shape[1])  # every whole key attended
    return attend(q, k, v, mask, scale)


def over_gathered(layout: UlyssesLayout, scale: float | None, text_mask: torch.Tensor | None,
                  attend: LocalAttention, text_factor: bool = False, whole: WholeKeys | None = None
                  ) -> GatheredAttention:
    """`attend_gathered` as the attention an exchange runs on the heads it gathered (`whole`: keys every rank
    holds whole, of every head: each chunk attends its heads of them)."""
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice) -> torch.Tensor:
        mine = None if whole is None else whole.heads(layout.rank, layout.degree, heads)
        return attend_gathered(q, k, v, layout, scale, text_mask, attend, text_factor, mine)

    return attention


def reference_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                       group: dist.ProcessGroup, gathered: GatheredAttention) -> torch.Tensor:
    return serial_around(query, key, value, layout, all_to_all(group), gathered)


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


# the oracle: it takes every call (pair biases too), and rings by point-to-point sends
CHOICE = Strategy("reference", ulysses=reference_ulysses, local=sdpa_bshd, cost=UlyssesPlanner.serial_call,
                  exchange=reference_exchange, ring=RingBlocks.POINT_TO_POINT,
                  supports=Supports(pair_bias=True)).with_fp8()


def serial_around(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                  transport: Transport, gathered: GatheredAttention) -> torch.Tensor:
    """Exchange, `gathered` attention of this rank's heads, exchange back, one after the other, over
    `transport`."""
    qkv = (query, key, value)
    every_head = slice(0, query.shape[2] // layout.degree)
    q, k, v = finish_scatter(start_scatter(qkv, layout, transport, every_head), qkv, layout, every_head)
    return finish_gather(start_gather(gathered(q, k, v, every_head), layout, transport), layout)


def serial_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                    transport: Transport, scale: float | None, text_mask: torch.Tensor | None,
                    attend: LocalAttention = sdpa_bshd) -> torch.Tensor:
    """Exchange, attend, exchange back, one after the other, over `transport`."""
    return serial_around(query, key, value, layout, transport, over_gathered(layout, scale, text_mask, attend))
