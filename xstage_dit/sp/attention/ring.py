"""Ring attention over the ring axis of the sequence split, exact.

The sequence is split into ring blocks, each held by one Ulysses group (a block is `degree` ranks' tokens). Inside
a ring step Ulysses runs as usual: one all-to-all gives this rank its heads of its group's block, with the text.
Each rank keeps those queries; the block's image keys and values travel around the ring, the next block in
flight while the current one attends, and the partial outputs merge by their log-sum-exp. The text keys every
rank holds are attended once, before the blocks, with their padding mask (or a pair bias's factor: `ring_masks`).
Only a block's true tokens travel (the padding sits at the tail of the whole sequence, in the last blocks), and a
block of padding alone is neither sent nor attended. A last all-to-all gives each rank its own tokens of every
head back.

The blocks travel as the strategy's entry says (`Strategy.ring`, sp/attention/backends.py): point-to-point sends
over the ring group (`ring_attention`, and across nodes), or, where `enable` opened the ring group's
symmetric-memory fabric (its ranks share a node and a strategy the choice may pick stores its blocks), remote
stores issued by the attention kernel itself: while it attends a block it forwards each key and value tile it
loads into the next rank's buffer (`stored_ring_steps`, the X-Stage ring: the paper's piggyback applied to the
ring). The Ulysses exchange around the ring is the strategy's own where it can hold another attention (the overlap
strategy's head chunks each run the whole ring), else the serial one (`Strategy.exchange_around`).

Keys and values that every rank holds whole, of every head (layout.WholeKeys: FLUX.2's cached reference-image
keys), need no exchange: each rank attends its heads of them once, merged like a ring block (at ring degree 1
they are attended with the gathered keys, reference.attend_gathered, not here).

With `fp8` (an FP8 strategy's ring) every partial attention runs our FP8 attention kernel, its log-sum-exp in
float32 as ever, so the blocks merge as they do without it."""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from ...kernels.attention_args import KeyForward, Merge, Running, Store
from ...runtime.distributed import waiting_for
from ...sizes import ceil_div
from ..fabric import Fabric, Steps, View, run_in_lockstep
from .backends import UlyssesExchange
from .layout import UlyssesLayout, WholeKeys
from .masks import keep_keys, pair_bias


class Partial(NamedTuple):
    """Attention over part of the keys: the (B, S, H, D) output and each query's log-sum-exp of its scores over
    that part, (B, H, S) float32."""

    out: torch.Tensor
    lse: torch.Tensor


def attention_with_lse(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                       scale: float | None, fp8: bool = False) -> Partial:
    """Attention of (B, S, H, D) queries over keys and values with H or fewer heads (grouped-query attention),
    with its log-sum-exp. `mask`: an SDPA mask (bool, or additive; with `fp8`, a key-padding mask); `fp8`: by our
    FP8 attention kernel."""
    if fp8:
        from ...kernels.attention import flash_attention  # Triton: imported where our kernel runs

        attended = flash_attention(query, key, value, scale=scale, key_mask=keep_keys(mask), epilogue=Store(lse=True),
                                   fp8=True)
        return Partial(attended.out, attended.lse)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
    if q.is_cuda and mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 128:
        # cuDNN's kernel, the fastest on Hopper, with its (B, H, S, 1) log-sum-exp
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, scale=scale)[:2]
        lse = lse.squeeze(-1)
    elif q.is_cuda:
        if mask is not None:  # the kernel takes a (B, H, queries, keys) bias whose strides are multiples of 8
            keys = k.shape[2]
            aligned = mask.new_empty(*mask.shape[:-1], ceil_div(keys, 8) * 8)[..., :keys]
            mask = aligned.copy_(mask).expand(q.shape[0], q.shape[1], q.shape[2], keys)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, mask, True, scale=scale)[:2]
        lse = lse[..., :q.shape[2]]  # the kernel pads the queries of its log-sum-exp to a multiple of 32
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)
    return Partial(out.transpose(1, 2), lse.float())


class Merged:
    """Partial attention outputs over disjoint key sets, merged by their log-sum-exp in float32."""

    def __init__(self, query: torch.Tensor) -> None:
        self.out, self.lse = Running.empty(query)

    def add(self, partial: Partial) -> None:
        merged = torch.logaddexp(self.lse, partial.lse)
        keep, take = (torch.exp(x - merged).transpose(1, 2).unsqueeze(-1) for x in (self.lse, partial.lse))
        self.out = self.out * keep + partial.out.float() * take
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


class RingMasks(NamedTuple):
    """How a ring's attention is masked: `text`, the SDPA mask over the text keys, and `shift`, (B, 1, queries),
    what a pair bias adds to each query's score of every image key (None: nothing). A constant over a block's
    keys leaves its softmax as it is and adds to its log-sum-exp, so blocks attend unmasked."""

    text: torch.Tensor | None
    shift: torch.Tensor | None

    def on_block(self, partial: Partial) -> Partial:
        """A block's unmasked attention as it is under the mask."""
        return partial if self.shift is None else partial._replace(lse=partial.lse + self.shift)


def ring_masks(text_mask: torch.Tensor | None, layout: UlyssesLayout, query_rows: int,
               text_factor: bool) -> RingMasks:
    """A key-padding mask masks text keys only; a pair bias's text factor (`text_factor`, Chroma) adds m_q m_k:
    over the text keys as over the gathered tokens, and over image keys (m_k = 1) each query's own factor."""
    if text_mask is None:
        return RingMasks(None, None)
    if not text_factor:
        return RingMasks(text_mask, None)
    bias = pair_bias(text_mask, layout, query_rows, layout.text_len + 1)  # the text keys and one image key
    return RingMasks(bias[..., :layout.text_len], bias[..., -1].float())


def _attend_text(merged: Merged, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 layout: UlyssesLayout, scale: float | None, masks: RingMasks, whole: WholeKeys | None,
                 fp8: bool) -> None:
    """The keys no block holds: the text (the first rows of k and v) and this rank's heads of the `whole` keys."""
    if layout.text_len:
        text = slice(0, layout.text_len)
        merged.add(attention_with_lse(query, key[:, text], value[:, text], masks.text, scale, fp8))
    if whole is not None:
        merged.add(attention_with_lse(query, *whole, None, scale, fp8))


def _attend_block(merged: Merged, query: torch.Tensor, block: torch.Tensor, scale: float | None,
                  masks: RingMasks, fp8: bool) -> None:
    """A block, (2, B, rows, h_kv, D) keys and values; nothing where it holds no true token."""
    if block.shape[2]:
        merged.add(masks.on_block(attention_with_lse(query, block[0], block[1], None, scale, fp8)))


def _own_block(key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout) -> torch.Tensor:
    """This rank's block's true image keys and values, stacked: (2, B, rows, h_kv, D), contiguous."""
    rows = slice(layout.text_len, layout.text_len + layout.block_keys(layout.ring_rank))
    return torch.stack([key[:, rows], value[:, rows]])


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                   group: dist.ProcessGroup, scale: float | None, text_mask: torch.Tensor | None,
                   text_factor: bool = False, whole: WholeKeys | None = None, fp8: bool = False) -> torch.Tensor:
    """Attention of this rank's gathered queries, (B, Tq + P, h, D) with P = layout.padded_len rows of its ring
    block, over the text keys, every ring block's keys (k and v (B, T + P, h_kv, D), text first) and this rank's
    heads of the `whole` keys. The blocks travel by point-to-point sends over `group`.
    `text_factor`: `text_mask` is the text tokens' factor of a pair bias (masks.QueryKeyMasks.PAIR_BIAS)."""
    degree, rank = layout.ring_degree, layout.ring_rank

    def what() -> str:  # described only when a wait fails
        return f"the ring attention's key blocks from ring rank {(rank - 1) % degree} (ring group ranks " \
               f"{dist.get_process_group_ranks(group)})"

    def send_on(block: torch.Tensor, step: int) -> _RingPass | None:
        """`block` to the next ring rank while the block of ring rank `rank - step - 1` comes in."""
        if step + 1 >= degree:
            return None
        return _RingPass(block, layout.block_keys((rank - step - 1) % degree), group, rank, degree, what)

    block = _own_block(key, value, layout)
    in_flight = send_on(block, 0)
    merged = Merged(query)
    masks = ring_masks(text_mask, layout, query.shape[1], text_factor)
    _attend_text(merged, query, key, value, layout, scale, masks, whole, fp8)  # while the first block travels
    _attend_block(merged, query, block, scale, masks, fp8)
    for step in range(1, degree):
        block = in_flight.wait()
        in_flight = send_on(block, step)  # passed on while it attends
        _attend_block(merged, query, block, scale, masks, fp8)
    return merged.out.to(query.dtype)


def stored_ring_steps(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                      fabric: Fabric, scale: float | None, text_mask: torch.Tensor | None, text_factor: bool = False,
                      whole: WholeKeys | None = None, fp8: bool = False) -> Steps[torch.Tensor]:
    """ring_attention with the blocks delivered by remote stores (the X-Stage ring), one rank over `fabric` (the
    ring group's), paused before each barrier. Every rank holds two slots for incoming blocks: while a step
    attends its block, our attention kernel forwards each key and value tile it loads into the next ring rank's
    other slot, and merges its output into the running result itself; the barrier that ends the step says every
    rank's block has landed and every rank is done with the slot the next step overwrites."""
    from ...kernels.attention import flash_attention  # Triton: imported where a fabric is in use

    degree, rank = layout.ring_degree, layout.ring_rank
    batch, _, heads, head_dim = key.shape
    slots_view = View("ring_kv", (2, 2 * batch * layout.padded_len * heads * head_dim), key.dtype)
    slots = fabric.carve([slots_view])["ring_kv"]
    block = _own_block(key, value, layout)
    merged = Merged(query)
    masks = ring_masks(text_mask, layout, query.shape[1], text_factor)
    _attend_text(merged, query, key, value, layout, scale, masks, whole, fp8)
    # a pair bias adds `masks.shift` to each query's score of every image key: the running log-sum-exp shifted the
    # other way, once, does that for every block (only the output is kept)
    running = Running(merged.out, merged.lse if masks.shift is None else merged.lse - masks.shift)
    for step in range(degree):
        if block.shape[2]:
            forward = None
            if step + 1 < degree:  # into the next rank's other slot, with the block's own layout
                to = slots.addresses[(rank + 1) % degree] + (step + 1) % 2 * slots.tensor[0].nbytes
                forward = KeyForward(to, to + block[0].nbytes)
            flash_attention(query, block[0], block[1], scale=scale, epilogue=Merge(running), forward=forward, fp8=fp8)
        source = (rank - step - 1) % degree
        yield f"ring block {step + 2} of {degree} (ring rank {source}'s keys)" if step + 1 < degree else \
            "every ring rank to be done with its blocks"
        rows = layout.block_keys(source)
        block = slots.tensor[(step + 1) % 2, :2 * batch * rows * heads * head_dim].view(2, batch, rows, heads,
                                                                                         head_dim)
    return running.out.to(query.dtype)


def stored_ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                          fabric: Fabric, scale: float | None, text_mask: torch.Tensor | None,
                          text_factor: bool = False, whole: WholeKeys | None = None,
                          fp8: bool = False) -> torch.Tensor:
    """One rank's stored_ring_steps over `fabric`."""
    (out,) = run_in_lockstep([stored_ring_steps(query, key, value, layout, fabric, scale, text_mask, text_factor,
                                                whole, fp8)], fabric.barrier)
    return out


def ring_exchange(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                  ulysses_group: dist.ProcessGroup | None, ring_group: dist.ProcessGroup,
                  scale: float | None, text_mask: torch.Tensor | None, exchange: UlyssesExchange,
                  text_factor: bool = False, whole: WholeKeys | None = None,
                  stores: Fabric | None = None, fp8: bool = False) -> torch.Tensor:
    """Ulysses around the ring: this rank's (B, T + L, H, D) q, k, v (text first or last) exchanged over its
    Ulysses group by `exchange` (where the degree is above 1), ring attention over the ring group of each head
    chunk it gathers, exchanged back. `text_factor`: `text_mask` is a pair bias's text factor (ring_masks);
    `whole`: keys every rank holds whole, attended besides the sequence's; `stores`: the ring group's fabric where
    the blocks travel by stores, None for point-to-point sends; `fp8`: every partial attention by our FP8 kernel."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: slice) -> torch.Tensor:
        mine = None if whole is None else whole.heads(layout.rank, layout.degree, heads)
        if stores is not None:
            return stored_ring_attention(q, k, v, layout, stores, scale, text_mask, text_factor, mine, fp8)
        return ring_attention(q, k, v, layout, ring_group, scale, text_mask, text_factor, mine, fp8)

    if layout.degree > 1:
        return exchange(query, key, value, layout, ulysses_group, attend)
    q, k, v = (torch.cat(layout.split(t), dim=1) for t in (query, key, value))  # text first
    out = attend(q, k, v, slice(0, query.shape[2]))
    return layout.join(out[:, :layout.query_text_len], out[:, layout.query_text_len:])
