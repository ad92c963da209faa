"""Ring attention over the ring axis of the sequence split, exact (the reference path; any backend choice runs it
where the ring degree is above 1).

The sequence is split into ring blocks, each held by one Ulysses group (a block is `degree` ranks' tokens). Inside
a ring step Ulysses runs as usual: one all-to-all gives this rank its heads of its group's block, with the text.
Each rank keeps those queries; the block's image keys and values travel around the ring by point-to-point sends,
the next block in flight while the current one attends, and the partial outputs merge by their log-sum-exp. The
text keys every rank holds are attended once, at the first step, with their padding mask. Only a block's true
tokens travel (the padding sits at the tail of the whole sequence, in the last blocks), and a block of padding
alone is neither sent nor attended. A last all-to-all gives each rank its own tokens of every head back.

Keys and values that every rank holds whole, of every head (`WholeKeys`: FLUX.2's cached reference-image keys),
need no exchange: each rank attends its heads of them once, merged like a ring block. This path runs such calls at
any ring degree, 1 included."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ...runtime.distributed import waiting_for
from .exchange import all_to_all, finish_gather, finish_scatter, start_gather, start_scatter
from .layout import UlyssesLayout
from .masks import with_image_keys


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                       scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of (B, S, H, D) queries over keys and values with H or fewer heads (grouped-query attention), and
    each query's log-sum-exp of its scores, (B, H, S) float32. `mask`: an SDPA mask (bool, or additive)."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if q.is_cuda:
        if mask is not None:  # the kernel takes a bias of the full (B, H, queries, keys) shape
            mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, scale=scale)[:2]
        lse = lse[..., :q.shape[2]]  # the kernel pads the queries of its log-sum-exp to a multiple of 32
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2), lse.float()


class WholeKeys(NamedTuple):
    """Keys and values every rank holds whole, (B, R, H, D): attended by every query, exchanged with nobody."""

    key: torch.Tensor
    value: torch.Tensor

    def heads(self, rank: int, degree: int) -> "WholeKeys":
        """This rank's heads of them, where a Ulysses group of `degree` ranks splits the heads."""
        share = self.key.shape[2] // degree
        return WholeKeys(*(t[:, :, rank * share:(rank + 1) * share] for t in self))


class _Merged:
    """Partial attention outputs over disjoint key sets, merged by their log-sum-exp in float32."""

    def __init__(self, query: torch.Tensor) -> None:
        batch, rows, heads, _ = query.shape
        self.out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        self.lse = torch.full((batch, heads, rows), float("-inf"), dtype=torch.float32, device=query.device)

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        merged = torch.logaddexp(self.lse, lse)
        keep, take = (torch.exp(x - merged).transpose(1, 2).unsqueeze(-1) for x in (self.lse, lse))
        self.out = self.out * keep + out.float() * take
        self.lse = merged


class _RingPass:
    """One block's keys and values, packed, sent to the next ring rank while the previous rank's comes in. A gloo
    group (ranks sharing a GPU, in tests) sends and receives through host copies: its point-to-point sends take
    CPU tensors only."""

    def __init__(self, block: torch.Tensor, incoming_rows: int, group: dist.ProcessGroup, rank: int,
                 degree: int, what: Callable[[], str]) -> None:
        self._what, self._device = what, block.device
        staged = block.is_cuda and "gloo" in str(dist.get_backend(group))
        if staged:
            block = block.cpu()
        self._recv = block.new_empty((*block.shape[:2], incoming_rows, *block.shape[3:]))
        ops = []
        if block.shape[2]:
            ops.append(dist.P2POp(dist.isend, block, dist.get_global_rank(group, (rank + 1) % degree), group))
        if incoming_rows:
            ops.append(dist.P2POp(dist.irecv, self._recv, dist.get_global_rank(group, (rank - 1) % degree), group))
        with torch.no_grad(), waiting_for(what):
            self._works = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> torch.Tensor:
        with waiting_for(self._what):
            for work in self._works:
                work.wait()
        return self._recv.to(self._device, non_blocking=True)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                   group: dist.ProcessGroup | None, scale: float | None, text_mask: torch.Tensor | None,
                   whole: WholeKeys | None = None) -> torch.Tensor:
    """Attention of this rank's gathered queries, (B, Tq + P, h, D) with P = layout.padded_len rows of its ring
    block, over the text keys, every ring block's keys (k and v (B, T + P, h_kv, D), text first) and this rank's
    heads of the `whole` keys."""
    text_len, degree, rank = layout.text_len, layout.ring_degree, layout.ring_rank

    def what() -> str:  # described only when a wait fails
        return f"the ring attention's key blocks from ring rank {(rank - 1) % degree} (ring group ranks " \
               f"{dist.get_process_group_ranks(group)})"

    def send_on(block: torch.Tensor, step: int) -> _RingPass | None:
        """`block` to the next ring rank while the block of ring rank `rank - step - 1` comes in."""
        if step + 1 >= degree:
            return None
        return _RingPass(block, layout.block_keys((rank - step - 1) % degree), group, rank, degree, what)

    own = layout.block_keys(rank)
    in_flight = send_on(torch.stack([key[:, text_len:text_len + own], value[:, text_len:text_len + own]]), 0)
    merged = _Merged(query)
    if text_len or own:  # while the first block travels
        keys = slice(0, text_len + own)
        merged.add(*attention_with_lse(query, key[:, keys], value[:, keys], with_image_keys(text_mask, own), scale))
    if whole is not None:
        merged.add(*attention_with_lse(query, *whole, None, scale))
    for step in range(1, degree):
        block = in_flight.wait()
        in_flight = send_on(block, step)  # passed on while it attends
        if block.shape[2]:
            merged.add(*attention_with_lse(query, block[0], block[1], None, scale))
    return merged.out.to(query.dtype)


def ring_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                  ulysses_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup | None,
                  scale: float | None, text_mask: torch.Tensor | None, whole: WholeKeys | None = None) -> torch.Tensor:
    """Ulysses inside each ring step: this rank's (B, T + L, H, D) q, k, v (text first or last) exchanged over
    its Ulysses group (where the degree is above 1), ring attention over the ring group (None at ring degree 1)
    and the `whole` keys, exchanged back."""
    qkv = (query, key, value)
    if layout.degree > 1:
        transport = all_to_all(ulysses_group)
        every_head = slice(0, query.shape[2] // layout.degree)
        q, k, v = finish_scatter(start_scatter(qkv, layout, transport, every_head), qkv, layout, every_head)
    else:
        q, k, v = (torch.cat(layout.split(t), dim=1) for t in qkv)  # text first
    if whole is not None:
        whole = whole.heads(layout.rank, layout.degree)
    out = ring_attention(q, k, v, layout, ring_group, scale, text_mask, whole)
    if layout.degree > 1:
        return finish_gather(start_gather(out, layout, transport), layout)
    return layout.join(out[:, :layout.query_text_len], out[:, layout.query_text_len:])
