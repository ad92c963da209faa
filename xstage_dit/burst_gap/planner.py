"""The planner: predicted time of one Ulysses or ring attention call per backend, from a machine's calibration
(the fitted Burst-Gap model and measured kernel costs), and the fused kernel's schedule.

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
planner predicts both and picks the faster (rotated on ties).

Rings (`ring_call`): shape.degree = U x R ranks, Ulysses groups of U consecutive ranks inside each step of a ring
of R. A rank attends its H/U heads of the text and its Ulysses group's block (T + U*L query rows) over the text
keys once, then one block of U*L image keys per step, and merges each call's output by log-sum-exp (three float32
copies of its output; the fused ring's kernel merges in its epilogue); with A_i the i-th step's attention plus
merge (the first's with the text's) and V = 2 * B * U*L * H/U * D * e the block's keys and values:

- around the ring: the Ulysses exchanges (q, k, v in, the output back, as the reference path's), or at U = 1 the
  copies that join text and image rows;
- serial: sum_i A_i + (R - 1) * P, P = launch + V / rate the block's NCCL point-to-point send, at the
  calibration's all-to-all rate within a node, at `Nodes.internode_rate` (an assumption) where the ring crosses
  nodes;
- overlap (sp/attention/ring.py): the send of block i+1 in flight while block i attends:
  sum_{i<R-1} max(A_i, P) + A_{R-1};
- fused (X-Stage ring, one node only, sp/attention/ring.py `stored_ring_steps`): our attention kernel attends each
  block (A_i with our kernel's rate, its merge in the epilogue: the running float32 output read and written once;
  the text with the vendor's) and forwards every key and value tile it loads into the next rank's slot (one
  destination: its drain rate R), one tile per work tile of the matching row index (`ring_forward`). That is a
  Burst-Gap train: per wave of K = #SMs work tiles, a burst of the block's bytes over the waves (V_w = V / waves)
  after a gap of one work tile's attention (G = A / waves), each wave stalling max(0, V_w/R - G - T0_iss), the last
  wave's bytes landing before the barrier: F = store_train(...), sum_{i<R-1} (A_i + F) + A_{R-1}. The block is
  delivered in the kernel's key tiles (sizes.ATTENTION_TILES): the train's bursts are as small as the waves make
  them, so the drain hides under the gap wherever V/R < A.

The serial and overlap transports attend with the vendor's kernel.

`layer_splits` predicts every U x R of a layer's ranks (U dividing the heads, within a node) with each strategy
that can run it, fastest first; `xstage-dit plan` prints them and the pick.

The planner names no strategy: each registry entry (sp/attention/backends.py) hands it a `PlannedStrategy`, the
prediction of its Ulysses call (a `Cost`) and the transport its ring's blocks take (a `RingTransport`, or None
where it runs no ring). `predict`, `predict_ring` and `layer_splits` take that mapping of names to records.

Mixture-of-experts layers (expert choice: each of E experts takes C tokens per sample, B * C rows), per rank:

- replicated: every expert on every rank, each computing the rows of its tokens (B * C / N per expert on
  average) with the vendor's grouped matmuls, after gathering the router scores; gathers and scatters of the
  E * B * C slot rows around it;
- collectives: E/N experts per rank on B * C rows each, between an all-gather of the group's tokens and a
  reduce-scatter of every token's partial sum;
- stores (X-Stage): the dispatch store kernel (this rank's share of the slot rows, (N-1)/N of it remote), a
  barrier, the expert kernel whose down-projection tiles store each row to its token's rank, a barrier and the
  ordered sum. The combine stores are the Burst-Gap trains: per launch, the programs in flight that store (all
  of them in a down-projection launch, the down share of an interleaved one) each issue one tile's rows per
  burst, the gap is the launch's compute per burst, and the last burst must land before the barrier. The
  schedule (waves of experts, interleaved or not) is the one predicted fastest."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping

from ..sizes import ATTENTION_TILES, EXPERT_TILES, AttentionTiles, ExpertTiles, ceil_div
from .calibration import Calibration, KernelCosts
from .model import BurstGapModel


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


@dataclass(frozen=True)
class ExpertShape:
    """One expert-choice MoE layer call: `experts` routed SwiGLU experts of hidden `width` over `dim`, each taking
    `capacity` tokens of each of `batch` samples of `tokens` tokens, split over `degree` ranks."""

    batch: int
    tokens: int
    dim: int
    width: int
    experts: int
    capacity: int
    degree: int
    element_bytes: int = 2

    @property
    def rows_per_expert(self) -> int:
        return self.batch * self.capacity

    @property
    def slots(self) -> int:
        return self.experts * self.rows_per_expert

    @property
    def local_tokens(self) -> int:
        return ceil_div(self.tokens, self.degree)

    @property
    def row_bytes(self) -> int:
        return self.dim * self.element_bytes

    def flops(self, rows: float) -> float:
        """Both projections of the SwiGLU experts (gate and up: 2F outputs, down: D) over `rows` rows."""
        return 6.0 * rows * self.dim * self.width


class ExpertMode(enum.Enum):
    """How an MoE layer runs across the Ulysses group."""

    REPLICATED = "replicated"  # every expert on every rank, on the tokens the rank holds
    COLLECTIVES = "expert-parallel-collectives"  # E/N experts per rank; tokens all-gathered, sums reduce-scattered
    STORES = "expert-parallel-stores"  # E/N experts per rank; dispatch and combine stored from kernels (X-Stage)


@dataclass(frozen=True)
class ExpertSchedule:
    """The expert kernel's launches on a rank: its experts in `waves` (contiguous, as equal as they split);
    `interleaved`: each launch runs a wave's down-projection (combine) tiles alternating with the next wave's
    SwiGLU tiles, else every wave runs its SwiGLU tiles, then its down-projection tiles."""

    waves: int = 1
    interleaved: bool = False

    def __str__(self) -> str:
        return f"{self.waves} wave{'s' if self.waves > 1 else ''}{', interleaved' if self.interleaved else ''}"

    def launches(self, experts: int) -> list[tuple[range, range]]:
        """(SwiGLU experts, down-projection experts) per launch, in order."""
        count = max(1, min(self.waves, experts))
        bounds = [experts * i // count for i in range(count + 1)]
        waves = [range(bounds[i], bounds[i + 1]) for i in range(count)]
        none = range(0)
        if not self.interleaved:
            return [launch for wave in waves for launch in ((wave, none), (none, wave))]
        return [(waves[0], none)] + [(waves[i + 1] if i + 1 < count else none, waves[i]) for i in range(count)]


SCHEDULES = tuple(ExpertSchedule(waves, interleaved) for waves in (1, 2, 4, 8) for interleaved in (False, True)
                  if waves > 1 or not interleaved)


class RingTransport(enum.Enum):
    """How a ring's key/value blocks travel between its steps."""

    SERIAL = "serial"  # attend a block, then send it on to the next rank (the baseline)
    OVERLAP = "overlap"  # NCCL point-to-point: a block in flight while the previous one attends (sp/attention/ring.py)
    FUSED = "fused"  # X-Stage: the attention kernel stores each key/value tile it loads into the next rank's slot


# bytes per second one GPU sends to another node: one 400 Gb/s NIC per GPU. An assumption, not a measurement: no
# calibration measures the network between nodes.
INTERNODE_RATE = 50e9


@dataclass(frozen=True)
class Nodes:
    """Where a job's ranks sit: `ranks_per_node` consecutive ranks share a node (NVLink: the calibration's store
    path and all-to-all rate); a rank sends to another node at `internode_rate` bytes per second."""

    ranks_per_node: int
    internode_rate: float = INTERNODE_RATE

    def ring_crosses(self, ulysses: int, ring: int) -> bool:
        """Whether a ring of `ring` Ulysses groups of `ulysses` consecutive ranks has a hop between nodes (one
        sequence's ranks are consecutive: the mesh (cfg, ring, ulysses))."""
        return ulysses * ring > self.ranks_per_node


@dataclass(frozen=True)
class RingBlocks:
    """What one rank of a split of `shape` into Ulysses `ulysses` x ring `ring` attends at each ring step: its
    H/U heads of the text and its Ulysses group's block as queries, over one block of U*L image keys (L = S/(U R)
    tokens per rank), the text keys once."""

    shape: AttentionShape
    ulysses: int
    ring: int

    @classmethod
    def of(cls, shape: AttentionShape, ring: int, ulysses: int) -> "RingBlocks":
        if ring < 1 or ulysses < 1 or ring * ulysses != shape.degree:
            raise ValueError(f"ring_degree={ring} x ulysses_degree={ulysses} is not the shape's {shape.degree} ranks")
        if shape.heads % ulysses:
            raise ValueError(f"{shape.heads} heads do not split over ulysses_degree={ulysses}")
        return cls(shape, ulysses, ring)

    @property
    def heads(self) -> int:
        return self.shape.heads // self.ulysses

    @property
    def block_keys(self) -> int:
        return self.shape.local_tokens * self.ulysses

    @property
    def query_rows(self) -> int:
        return self.shape.text_tokens + self.block_keys

    def flops(self, keys: int) -> float:
        s = self.shape
        return 4.0 * s.batch * self.heads * self.query_rows * keys * s.head_dim

    def block_bytes(self) -> float:
        """One block's keys and values: what each ring step sends on."""
        s = self.shape
        return 2.0 * s.batch * self.block_keys * self.heads * s.head_dim * s.element_bytes

    def merged_bytes(self) -> float:
        """The float32 output the steps' log-sum-exp merge reads and writes."""
        s = self.shape
        return 4.0 * s.batch * self.query_rows * self.heads * s.head_dim


@dataclass(frozen=True)
class SplitPrediction:
    """One way to run an attention layer over a sequence's ranks: Ulysses `ulysses` x ring `ring`, by strategy
    `backend`; with a ring, its blocks moved by `transport` (None without a ring)."""

    ulysses: int
    ring: int
    backend: str
    seconds: float
    transport: RingTransport | None = None

    def __str__(self) -> str:
        return f"Ulysses {self.ulysses} x ring {self.ring}, {self.backend}: {self.seconds * 1e3:.3f} ms predicted"


def widest_ulysses(ranks: int, heads: Iterable[int], ranks_per_node: int) -> int:
    """The split `enable` runs with no degrees given: Ulysses as wide as divides the ranks and every head count
    within a node; a ring of the Ulysses groups takes the rest."""
    heads = list(heads)
    return max(d for d in range(1, min(ranks, ranks_per_node) + 1)
               if ranks % d == 0 and all(h % d == 0 for h in heads))


def store_train(path: BurstGapModel, gap: float, burst_bytes: float, producers: int, bursts: int) -> float:
    """What a train of `bursts` bursts of remote stores, each `burst_bytes` from `producers` programs after `gap`
    seconds of their compute, adds to that compute: every burst after the first stalls its issuers by
    max(0, T_iss - T0_iss) = max(0, V/R - G - T0_iss), and the last burst's bytes must land before the
    destination may read them (delivery minus issue)."""
    free = path.free_issue_time(burst_bytes, producers)
    stall = max(0.0, path.steady_issue_time(gap, burst_bytes, producers) - free)
    return max(0, bursts - 1) * stall + path.delivery_time(burst_bytes, producers) - free


@dataclass(frozen=True)
class ForwardTrain:
    """A fused ring step's forward of its block (`nbytes`) as a Burst-Gap train: `bursts` bursts of up to
    `burst_bytes` from `storing` programs, each after `gap` seconds of attention; `added`, the seconds it adds to
    the step."""

    nbytes: float
    bursts: int
    burst_bytes: float
    storing: int
    gap: float
    added: float

    def __str__(self) -> str:
        return (f"{self.nbytes / 1e6:.1f} MB a step in {self.bursts} burst(s) of up to "
                f"{self.burst_bytes / 1e6:.2f} MB from {self.storing} programs, {self.gap * 1e3:.3f} ms of attention "
                f"apart: +{self.added * 1e3:.3f} ms a step")


# predicted seconds of one attention call of a shape, from the planner's pieces
Cost = Callable[["Planner", AttentionShape], float]


@dataclass(frozen=True)
class PlannedStrategy:
    """What the planner reads of one attention strategy: `call`, its predicted Ulysses call (ring degree 1), and
    `ring`, how its ring's key/value blocks travel (None: it runs no ring). Strategies whose rings travel alike
    are one ring prediction: the Ulysses exchange around a ring is modelled as the serial one."""

    call: Cost
    ring: RingTransport | None


class Planner:
    def __init__(self, model: BurstGapModel, costs: KernelCosts) -> None:
        self.model = model
        self.costs = costs

    @classmethod
    def from_calibration(cls, calibration: Calibration) -> "Planner":
        return cls(calibration.model, calibration.costs)

    # -- pieces -----------------------------------------------------------------------------------------------
    def copy(self, nbytes: float) -> float:
        return self.costs.launch + nbytes / self.costs.copy_rate

    def exchange(self, nbytes: float, text: bool) -> float:
        """One tensor's trip through an all-to-all of the reference path: pack, all-to-all, unpack (+ join)."""
        transfer = self.costs.launch + nbytes / self.costs.alltoall_rate
        return transfer + (3 if text else 2) * self.copy(nbytes)

    def attention(self, shape: AttentionShape, own: bool, heads: float | None = None) -> float:
        return self.costs.attention_time(shape.flops(heads), shape.keys, shape.head_dim, own)

    def fused_kernel(self, shape: AttentionShape, order: TileOrder, tile_rows: int) -> float:
        """Our attention kernel with the scatter epilogue (the post-all-to-all), alone, for output tiles of
        `tile_rows` query rows."""
        compute = self.attention(shape, own=True)
        n = shape.degree
        if n == 1:
            return compute
        tiles = shape.batch * shape.heads_per_rank * math.ceil(shape.query_rows / tile_rows)
        producers = min(self.costs.sms, tiles)
        waves = tiles / producers
        remote = (n - 1) / n
        wave_bytes = producers * tile_rows * shape.head_dim * shape.element_bytes * shape.payload_ratio * remote
        drain = self.model.drain_rate if order is TileOrder.ROTATED else self.model.drain_rate / (n - 1)
        path = replace(self.model, drain_rate=drain)
        return compute + store_train(path, compute / waves, wave_bytes, producers, math.ceil(waves))

    def pre_all_to_all(self, shape: AttentionShape) -> float:
        """The fused path's store kernels for q, k, v plus the local copy of this rank's text heads (each reads the
        model's dtype and writes the payload: a copy of their mean)."""
        volume = 3 * shape.tensor_bytes()
        mean = (1 + shape.payload_ratio) / 2
        remote = volume * shape.payload_ratio * (shape.degree - 1) / shape.degree
        delivery = self.model.delivery_time(remote, self.costs.sms) if remote else 0.0
        stores = 3 * self.costs.launch + max(volume * mean / self.costs.copy_rate, delivery)
        text = self.copy(3 * shape.text_bytes(shape.heads_per_rank) * mean) if shape.text_tokens else 0.0
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
        return self.attention(shape, own=False) + 4 * self.exchange(shape.tensor_bytes(), shape.text_tokens > 0)

    def fused_call(self, shape: AttentionShape, tile_rows: int) -> float:
        """Store kernels, a barrier, our kernel with the scatter epilogue in its better order, a barrier, the copy
        out of the pooled buffer (FP8 payloads: the gathered q, k, v dequantized before the kernel, the output
        after it, each pass reading the payload and writing the model's dtype)."""
        if shape.degree == 1:
            return self.attention(shape, own=True)
        mean = (1 + shape.payload_ratio) / 2
        out_bytes = shape.tensor_bytes() + shape.text_bytes(shape.heads)
        gathered_bytes = shape.tensor_bytes() + shape.text_bytes(shape.heads_per_rank)
        dequantize = 0.0 if shape.payload_bytes is None else 3 * self.copy(gathered_bytes * mean)
        kernel = self.fused_kernel(shape, self.tile_order(shape, tile_rows), tile_rows)
        return self.pre_all_to_all(shape) + 2 * self.costs.launch + dequantize + kernel + self.copy(out_bytes * mean)

    def overlap_call(self, shape: AttentionShape, max_chunks: int = 4) -> float:
        """Two streams, in sp/attention/overlap.py's issue order: the compute stream packs, unpacks and attends, the
        communication stream runs the all-to-alls, each waiting for what it consumes."""
        if shape.degree == 1:
            return self.attention(shape, own=False)
        count = min(shape.heads_per_rank, max_chunks)
        tensor, text = shape.tensor_bytes() / count, shape.text_tokens > 0
        pack, unpack = self.copy(tensor), (2 if text else 1) * self.copy(tensor)
        transfer = self.costs.launch + tensor / self.costs.alltoall_rate
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

    # -- mixture-of-experts layers ---------------------------------------------------------------------------
    def predicts_experts(self) -> bool:
        """Whether the calibration measured the expert kernels (older ones did not)."""
        return bool(self.costs.expert_tflops)

    def gathered_scores(self, shape: ExpertShape) -> float:
        """Every mode's start: the router scores of the whole sequence on every rank."""
        return self.copy(shape.batch * shape.tokens * shape.experts * shape.element_bytes)

    def experts_replicated(self, shape: ExpertShape) -> float:
        slot_bytes = shape.slots * shape.row_bytes
        compute = self.costs.expert_time(shape.flops(shape.slots / shape.degree),
                                         shape.rows_per_expert / shape.degree, own=False)
        # gather the slot rows, weigh them, sum each token's rows in expert order
        return self.gathered_scores(shape) + compute + 3 * self.copy(slot_bytes)

    def experts_collectives(self, shape: ExpertShape) -> float:
        n = shape.degree
        group_bytes = n * shape.batch * shape.local_tokens * shape.row_bytes
        collective = self.costs.launch + group_bytes * (n - 1) / n / self.costs.alltoall_rate
        mine = shape.slots / n
        compute = self.costs.expert_time(shape.flops(mine), shape.rows_per_expert, own=False)
        copies = 2 * self.copy(mine * shape.row_bytes) + self.copy(group_bytes)  # gather, weigh, zero + add
        return self.gathered_scores(shape) + 2 * collective + compute + copies

    def experts_stores(self, shape: ExpertShape, schedule: ExpertSchedule, tiles: ExpertTiles = EXPERT_TILES
                       ) -> float:
        n = shape.degree
        mine = shape.slots / n
        remote = (n - 1) / n
        sent = mine * shape.row_bytes
        dispatch = self.costs.launch + max(sent / self.costs.copy_rate,
                                           self.model.delivery_time(sent * remote, self.costs.sms))
        summed = self.copy((mine + shape.batch * shape.local_tokens) * shape.row_bytes)
        kernels = self.expert_kernels(shape, schedule, tiles)
        return self.gathered_scores(shape) + dispatch + kernels + 2 * self.costs.launch + summed

    def expert_kernels(self, shape: ExpertShape, schedule: ExpertSchedule, tiles: ExpertTiles = EXPERT_TILES
                       ) -> float:
        """The expert kernel's launches under `schedule`, with the combine stores' Burst-Gap stalls."""
        n = shape.degree
        experts = shape.experts // n
        rows = shape.rows_per_expert
        rate = self.costs.expert_time(shape.flops(experts * rows), rows, own=True) - self.costs.launch
        up_share = 4.0 / 6.0  # of an expert's flops: gate and up (2F columns) against down (D columns)
        up_tiles = tiles.up_tiles(rows, shape.width)
        down_tiles = tiles.down_tiles(rows, shape.dim)
        tile_bytes = tiles.rows * tiles.down_columns * shape.element_bytes * (n - 1) / n
        total = 0.0
        for up, down in schedule.launches(experts):
            compute = rate * (len(up) * up_share + len(down) * (1 - up_share)) / experts
            total += self.costs.launch + compute
            storing = len(down) * down_tiles
            if not storing:
                continue
            in_flight = min(self.costs.sms, storing + len(up) * up_tiles)
            producers = max(1, round(in_flight * storing / (storing + len(up) * up_tiles)))
            bursts = math.ceil(storing / producers)
            total += store_train(self.model, compute / bursts, producers * tile_bytes, producers, bursts)
        return total

    def expert_schedule(self, shape: ExpertShape) -> ExpertSchedule:
        """The schedule predicted fastest for the stores mode (fewer launches on ties)."""
        return min(SCHEDULES, key=lambda schedule: self.expert_kernels(shape, schedule))

    def predict_experts(self, shape: ExpertShape, modes: tuple[ExpertMode, ...]) -> dict[ExpertMode, float]:
        """Predicted seconds of one MoE layer call per mode (the stores mode in its best schedule)."""
        cost = {ExpertMode.REPLICATED: self.experts_replicated, ExpertMode.COLLECTIVES: self.experts_collectives,
                ExpertMode.STORES: lambda s: self.experts_stores(s, self.expert_schedule(s))}
        return {mode: cost[mode](shape) for mode in modes}

    # -- rings: Ulysses inside each ring step, key/value blocks around the ring ------------------------------------
    def ring_steps(self, blocks: RingBlocks, own: bool = False) -> list[float]:
        """Each ring step's attention of a block and the log-sum-exp merge of its output (by our kernel, its
        epilogue reading and writing the running float32 output, where `own`; else the vendor's kernel and three
        float32 copies); the first step's also the text keys' (the vendor's kernel)."""
        def attend(keys: int, by_own: bool) -> float:
            merge = (2 * blocks.merged_bytes() / self.costs.copy_rate if by_own
                     else self.copy(3 * blocks.merged_bytes()))
            return self.costs.attention_time(blocks.flops(keys), keys, blocks.shape.head_dim, by_own) + merge

        block = attend(blocks.block_keys, own)
        text = attend(blocks.shape.text_tokens, False) if blocks.shape.text_tokens else 0.0
        return [text + block] + [block] * (blocks.ring - 1)

    def ring_send(self, blocks: RingBlocks, nodes: Nodes) -> float:
        """One block by NCCL point-to-point: within a node at the calibration's all-to-all rate, between nodes at
        the network's."""
        rate = nodes.internode_rate if nodes.ring_crosses(blocks.ulysses, blocks.ring) else self.costs.alltoall_rate
        return self.costs.launch + blocks.block_bytes() / rate

    def ring_forward(self, blocks: RingBlocks, tiles: AttentionTiles = ATTENTION_TILES) -> ForwardTrain:
        """Forwarding one block from our attention kernel in a fused ring step: the Burst-Gap train of its key
        tiles' stores, one burst per wave of work tiles (the module's docstring), and what it adds to the step."""
        s = blocks.shape
        work_tiles = s.batch * blocks.heads * ceil_div(blocks.query_rows, tiles.rows)
        producers = min(self.costs.sms, work_tiles)
        waves = work_tiles / producers
        key_tiles = s.batch * blocks.heads * ceil_div(blocks.block_keys, tiles.keys)  # each forwarded once
        compute = self.costs.attention_time(blocks.flops(blocks.block_keys), blocks.block_keys, s.head_dim, True)
        storing = max(1, min(producers, round(key_tiles / waves)))
        nbytes = blocks.block_bytes()
        gap, burst_bytes, bursts = compute / waves, nbytes / waves, math.ceil(waves)
        return ForwardTrain(nbytes, bursts, burst_bytes, storing, gap,
                            store_train(self.model, gap, burst_bytes, storing, bursts))

    def ulysses_around_ring(self, blocks: RingBlocks) -> float:
        """The Ulysses exchanges around the ring (q, k, v in, the output back: the reference path's all-to-alls),
        or at Ulysses degree 1 the copies that join the text and image rows."""
        nbytes = blocks.shape.tensor_bytes()
        if blocks.ulysses == 1:
            return 4 * self.copy(nbytes)
        return 4 * self.exchange(nbytes, blocks.shape.text_tokens > 0)

    def ring_call(self, shape: AttentionShape, ring_degree: int, ulysses_degree: int,
                  transport: RingTransport | str, nodes: Nodes | None = None) -> float:
        """Predicted seconds of one attention call of `shape` (shape.degree = ring_degree x ulysses_degree ranks)
        as Ulysses inside each step of a ring, its blocks moved by `transport` ("serial", "overlap" or "fused";
        see the module's docstring). `nodes` None: every rank on one node. The fused ring spans one node only."""
        transport = RingTransport(transport)
        nodes = nodes or Nodes(shape.degree)
        blocks = RingBlocks.of(shape, ring_degree, ulysses_degree)
        if transport is RingTransport.FUSED and nodes.ring_crosses(ulysses_degree, ring_degree):
            raise ValueError(f"the fused ring spans one node; {ring_degree} x {ulysses_degree} ranks cross nodes of "
                             f"{nodes.ranks_per_node}")
        steps = self.ring_steps(blocks, own=transport is RingTransport.FUSED)
        passed, last = steps[:-1], steps[-1]  # every step but the last sends its block on
        if transport is RingTransport.SERIAL:
            ring = sum(steps) + len(passed) * self.ring_send(blocks, nodes)
        elif transport is RingTransport.OVERLAP:
            send = self.ring_send(blocks, nodes)
            ring = sum(max(step, send) for step in passed) + last
        else:
            ring = sum(passed) + len(passed) * self.ring_forward(blocks).added + last
        return self.ulysses_around_ring(blocks) + ring

    def predict_ring(self, shape: AttentionShape, ring_degree: int, ulysses_degree: int,
                     strategies: Mapping[str, PlannedStrategy], nodes: Nodes | None = None) -> dict[str, float]:
        """Predicted seconds of one ring call of `shape` per strategy that can run this ring: one per transport
        (the first strategy of each names it), the fused ring only where the ring stays within a node."""
        nodes = nodes or Nodes(shape.degree)
        crosses = nodes.ring_crosses(ulysses_degree, ring_degree)
        found: dict[str, float] = {}
        seen: set[RingTransport] = set()
        for name, strategy in strategies.items():
            transport = strategy.ring
            if transport is None or transport in seen or (transport is RingTransport.FUSED and crosses):
                continue
            seen.add(transport)
            found[name] = self.ring_call(shape, ring_degree, ulysses_degree, transport, nodes)
        return found

    def layer_splits(self, shape: AttentionShape, nodes: Nodes, strategies: Mapping[str, PlannedStrategy]
                     ) -> list[SplitPrediction]:
        """Every way to run `shape` over its shape.degree ranks, fastest first: Ulysses U (dividing the heads,
        within a node) x ring R; at R = 1 by each strategy's Ulysses call, with a ring by each ring transport of
        the strategies (`predict_ring`)."""
        found = []
        for ulysses in range(1, min(shape.degree, nodes.ranks_per_node) + 1):
            if shape.degree % ulysses or shape.heads % ulysses:
                continue
            ring = shape.degree // ulysses
            if ring == 1:
                found += [SplitPrediction(ulysses, 1, name, seconds)
                          for name, seconds in self.predict(shape, strategies).items()]
                continue
            found += [SplitPrediction(ulysses, ring, name, seconds, strategies[name].ring)
                      for name, seconds in self.predict_ring(shape, ring, ulysses, strategies, nodes).items()]
        return sorted(found, key=lambda split: split.seconds)

    def predict(self, shape: AttentionShape, strategies: Mapping[str, PlannedStrategy]) -> dict[str, float]:
        """Predicted seconds of one Ulysses attention call per strategy, from each strategy's cost function."""
        return {name: strategy.call(self, shape) for name, strategy in strategies.items()}
