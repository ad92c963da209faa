"""The Ulysses attention domain of the planner: the predicted time of one Ulysses attention call per backend, and
the fused kernel's schedule, priced by the cost core (burst_gap/cost.py).

Per rank, for a layer of H heads over T text + S image tokens split over N ranks (L = S/N tokens each), with V
the bytes of one of this rank's q, k, v or output tensors (B * L * H * D elements):

- reference: vendor attention of H/N heads over T + S tokens, plus four exchanges (q, k, v, out), each a pack
  copy, the all-to-all of the send buffer and an unpack copy (a third copy joins the text rows back in);
- overlap: the same work in head chunks on two streams (compute: copies and attention; communication: the
  all-to-alls), simulated in the order sp/attention/overlap.py issues it;
- fused: the pre-all-to-all store kernel (remote bytes V (N-1)/N per tensor, delivered at the model's rate),
  a barrier, our attention kernel whose epilogue stores each finished tile remotely, a barrier, one copy out.
  With FP8 payloads (shape.payload_bytes) the stores send e4m3 rows and their scales instead, and the gathered
  q, k, v and the output are dequantized (one pass each, in place of the copy out).
  The epilogue costs what the Burst-Gap model says a train of bursts costs beyond its backpressure-free issue:
  one burst per wave of K = #SMs tiles (V_w = K * tile bytes * (N-1)/N), gap G = one tile's Q loop, so each
  wave stalls max(0, V_w/R - G - T0_iss(K, V_w)), and the last wave's bytes must land before the barrier
  (delivery minus issue time).

The schedule knob is the fused kernel's tile order. In rank-major order every rank stores into the same
destination at the same moment, so that destination's ingress, R, is shared by the N - 1 senders (R / (N - 1)
each); rotated, rank r starts at rank r + 1's rows and each destination hears one sender at a time (R each). The
planner predicts both and picks the faster (rotated on ties)."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Callable

from ..sizes import ceil_div
from .cost import CostCore, store_train


class TileOrder(enum.Enum):
    """The order in which a rank's attention programs walk its query tiles (and so store their output)."""

    RANK_MAJOR = "rank-major"  # from row 0: every rank stores into rank 0 first, then rank 1, ...
    ROTATED = "rotated"  # rank r starts at rank r + 1's rows: each destination hears one sender at a time


@dataclass(frozen=True)
class AttentionShape:
    """One Ulysses attention call: `heads` of the whole layer, `image_tokens` of the whole sequence."""

    batch: int
    image_tokens: int
    text_tokens: int
    heads: int
    head_dim: int
    degree: int
    element_bytes: int = 2
    payload_bytes: float | None = None  # per element of the fused path's stores (FP8: sizes.fp8_payload_bytes)

    @property
    def payload_ratio(self) -> float:
        """Bytes the fused path's stores send per byte of the model's dtype (below 1 with FP8 payloads)."""
        return 1.0 if self.payload_bytes is None else self.payload_bytes / self.element_bytes

    @property
    def local_tokens(self) -> int:
        return ceil_div(self.image_tokens, self.degree)

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.degree

    @property
    def keys(self) -> int:
        return self.text_tokens + self.image_tokens

    @property
    def query_rows(self) -> int:
        return self.text_tokens + self.local_tokens * self.degree

    def flops(self, heads: int | None = None) -> float:
        heads = self.heads_per_rank if heads is None else heads
        return 4.0 * self.batch * heads * self.query_rows * self.keys * self.head_dim

    def tensor_bytes(self) -> float:
        """One of this rank's image q, k, v or output tensors, every head."""
        return float(self.batch * self.local_tokens * self.heads * self.head_dim * self.element_bytes)

    def text_bytes(self, heads: int) -> float:
        return float(self.batch * self.text_tokens * heads * self.head_dim * self.element_bytes)


class UlyssesPlanner:
    """Ulysses attention calls (ring degree 1) priced by one cost core."""

    def __init__(self, core: CostCore) -> None:
        self.core = core

    def attention(self, shape: AttentionShape, own: bool, heads: float | None = None) -> float:
        return self.core.costs.attention_time(shape.flops(heads), shape.keys, shape.head_dim, own)

    def fused_kernel(self, shape: AttentionShape, order: TileOrder, tile_rows: int) -> float:
        """Our attention kernel with the scatter epilogue (the post-all-to-all), alone, for output tiles of
        `tile_rows` query rows."""
        compute = self.attention(shape, own=True)
        n = shape.degree
        if n == 1:
            return compute
        tiles = shape.batch * shape.heads_per_rank * math.ceil(shape.query_rows / tile_rows)
        producers = min(self.core.costs.sms, tiles)
        waves = tiles / producers
        remote = (n - 1) / n
        wave_bytes = producers * tile_rows * shape.head_dim * shape.element_bytes * shape.payload_ratio * remote
        model = self.core.model
        drain = model.drain_rate if order is TileOrder.ROTATED else model.drain_rate / (n - 1)
        path = replace(model, drain_rate=drain)
        return compute + store_train(path, compute / waves, wave_bytes, producers, math.ceil(waves))

    def pre_all_to_all(self, shape: AttentionShape) -> float:
        """The fused path's store kernels for q, k, v plus the local copy of this rank's text heads (each reads the
        model's dtype and writes the payload: a copy of their mean)."""
        costs = self.core.costs
        volume = 3 * shape.tensor_bytes()
        mean = (1 + shape.payload_ratio) / 2
        remote = volume * shape.payload_ratio * (shape.degree - 1) / shape.degree
        delivery = self.core.model.delivery_time(remote, costs.sms) if remote else 0.0
        stores = 3 * costs.launch + max(volume * mean / costs.copy_rate, delivery)
        text = self.core.copy(3 * shape.text_bytes(shape.heads_per_rank) * mean) if shape.text_tokens else 0.0
        return stores + text

    def tile_order(self, shape: AttentionShape, tile_rows: int) -> TileOrder:
        """The faster order for the fused kernel (rotated on ties)."""
        rotated = self.fused_kernel(shape, TileOrder.ROTATED, tile_rows)
        return TileOrder.ROTATED if rotated <= self.fused_kernel(shape, TileOrder.RANK_MAJOR, tile_rows) \
            else TileOrder.RANK_MAJOR

    # -- whole calls, one per backend ----------------------------------------------------------------------------
    def serial_call(self, shape: AttentionShape) -> float:
        """Vendor attention between two all-to-alls (q, k, v out; the output back), one after the other."""
        if shape.degree == 1:
            return self.attention(shape, own=False)
        return self.attention(shape, own=False) + 4 * self.core.exchange(shape.tensor_bytes(), shape.text_tokens > 0)

    def fused_call(self, shape: AttentionShape, tile_rows: int) -> float:
        """Store kernels, a barrier, our kernel with the scatter epilogue in its better order, a barrier, the copy
        out of the pooled buffer (FP8 payloads: the gathered q, k, v dequantized before the kernel, the output
        after it, each pass reading the payload and writing the model's dtype)."""
        if shape.degree == 1:
            return self.attention(shape, own=True)
        mean = (1 + shape.payload_ratio) / 2
        out_bytes = shape.tensor_bytes() + shape.text_bytes(shape.heads)
        gathered_bytes = shape.tensor_bytes() + shape.text_bytes(shape.heads_per_rank)
        dequantize = 0.0 if shape.payload_bytes is None else 3 * self.core.copy(gathered_bytes * mean)
        kernel = self.fused_kernel(shape, self.tile_order(shape, tile_rows), tile_rows)
        return (self.pre_all_to_all(shape) + 2 * self.core.costs.launch + dequantize + kernel
                + self.core.copy(out_bytes * mean))

    def overlap_call(self, shape: AttentionShape, max_chunks: int = 4) -> float:
        """Two streams, in sp/attention/overlap.py's issue order: the compute stream packs, unpacks and attends, the
        communication stream runs the all-to-alls, each waiting for what it consumes."""
        if shape.degree == 1:
            return self.attention(shape, own=False)
        costs = self.core.costs
        count = min(shape.heads_per_rank, max_chunks)
        tensor, text = shape.tensor_bytes() / count, shape.text_tokens > 0
        pack, unpack = self.core.copy(tensor), (2 if text else 1) * self.core.copy(tensor)
        transfer = costs.launch + tensor / costs.alltoall_rate
        attend = self.attention(shape, own=False, heads=shape.heads_per_rank / count)
        compute = comm = 0.0
        pre_done, post_done = [], []

        def send(ready: float, tensors: int) -> float:
            nonlocal comm
            comm = max(comm, ready) + tensors * transfer
            return comm

        compute += 3 * pack
        pre_done.append(send(compute, 3))
        for i in range(count):
            if i + 1 < count:
                compute += 3 * pack
                pre_done.append(send(compute, 3))
            compute = max(compute, pre_done[i]) + 3 * unpack + attend + pack
            post_done.append(send(compute, 1))
        for done in post_done:
            compute = max(compute, done) + unpack
        return compute


# predicted seconds of one Ulysses attention call of a shape (a strategy's `cost`), from the planner's pieces
Cost = Callable[[UlyssesPlanner, AttentionShape], float]
