"""The ring domain of the planner: the predicted time of one attention call run as Ulysses inside each step of a
ring, per way its key/value blocks travel, priced by the cost core (burst_gap/cost.py).

shape.degree = U x R ranks, Ulysses groups of U consecutive ranks inside each step of a ring of R. A rank attends
its H/U heads of the text and its Ulysses group's block (T + U*L query rows) over the text keys once, then one
block of U*L image keys per step, and merges each call's output by log-sum-exp (three float32 copies of its
output; the fused ring's kernel merges in its epilogue); with A_i the i-th step's attention plus merge (the first's
with the text's) and V = 2 * B * U*L * H/U * D * e the block's keys and values:

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
  destination: its drain rate R), one tile per work tile of the matching row index (`RingPlanner.forward`). That
  is a Burst-Gap train: per wave of K = #SMs work tiles, a burst of the block's bytes over the waves
  (V_w = V / waves) after a gap of one work tile's attention (G = A / waves), each wave stalling
  max(0, V_w/R - G - T0_iss), the last wave's bytes landing before the barrier: F = store_train(...),
  sum_{i<R-1} (A_i + F) + A_{R-1}. The block is delivered in the kernel's key tiles (sizes.ATTENTION_TILES): the
  train's bursts are as small as the waves make them, so the drain hides under the gap wherever V/R < A.

The serial and overlap transports attend with the vendor's kernel."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ..sizes import ATTENTION_TILES, AttentionTiles, ceil_div
from .cost import CostCore, store_train
from .ulysses_plan import AttentionShape


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


class RingPlanner:
    """Ring calls (Ulysses inside each ring step, key/value blocks around the ring) priced by one cost core."""

    def __init__(self, core: CostCore) -> None:
        self.core = core

    def steps(self, blocks: RingBlocks, own: bool = False) -> list[float]:
        """Each ring step's attention of a block and the log-sum-exp merge of its output (by our kernel, its
        epilogue reading and writing the running float32 output, where `own`; else the vendor's kernel and three
        float32 copies); the first step's also the text keys' (the vendor's kernel)."""
        costs = self.core.costs

        def attend(keys: int, by_own: bool) -> float:
            merge = (2 * blocks.merged_bytes() / costs.copy_rate if by_own
                     else self.core.copy(3 * blocks.merged_bytes()))
            return costs.attention_time(blocks.flops(keys), keys, blocks.shape.head_dim, by_own) + merge

        block = attend(blocks.block_keys, own)
        text = attend(blocks.shape.text_tokens, False) if blocks.shape.text_tokens else 0.0
        return [text + block] + [block] * (blocks.ring - 1)

    def send(self, blocks: RingBlocks, nodes: Nodes) -> float:
        """One block by NCCL point-to-point: within a node at the calibration's all-to-all rate, between nodes at
        the network's."""
        costs = self.core.costs
        rate = nodes.internode_rate if nodes.ring_crosses(blocks.ulysses, blocks.ring) else costs.alltoall_rate
        return costs.launch + blocks.block_bytes() / rate

    def forward(self, blocks: RingBlocks, tiles: AttentionTiles = ATTENTION_TILES) -> ForwardTrain:
        """Forwarding one block from our attention kernel in a fused ring step: the Burst-Gap train of its key
        tiles' stores, one burst per wave of work tiles (the module's docstring), and what it adds to the step."""
        s, costs = blocks.shape, self.core.costs
        work_tiles = s.batch * blocks.heads * ceil_div(blocks.query_rows, tiles.rows)
        producers = min(costs.sms, work_tiles)
        waves = work_tiles / producers
        key_tiles = s.batch * blocks.heads * ceil_div(blocks.block_keys, tiles.keys)  # each forwarded once
        compute = costs.attention_time(blocks.flops(blocks.block_keys), blocks.block_keys, s.head_dim, True)
        storing = max(1, min(producers, round(key_tiles / waves)))
        nbytes = blocks.block_bytes()
        gap, burst_bytes, bursts = compute / waves, nbytes / waves, math.ceil(waves)
        return ForwardTrain(nbytes, bursts, burst_bytes, storing, gap,
                            store_train(self.core.model, gap, burst_bytes, storing, bursts))

    def ulysses_around(self, blocks: RingBlocks) -> float:
        """The Ulysses exchanges around the ring (q, k, v in, the output back: the reference path's all-to-alls),
        or at Ulysses degree 1 the copies that join the text and image rows."""
        nbytes = blocks.shape.tensor_bytes()
        if blocks.ulysses == 1:
            return 4 * self.core.copy(nbytes)
        return 4 * self.core.exchange(nbytes, blocks.shape.text_tokens > 0)

    def call(self, shape: AttentionShape, ring_degree: int, ulysses_degree: int, transport: RingTransport | str,
             nodes: Nodes | None = None) -> float:
        """Predicted seconds of one attention call of `shape` (shape.degree = ring_degree x ulysses_degree ranks)
        as Ulysses inside each step of a ring, its blocks moved by `transport` ("serial", "overlap" or "fused";
        see the module's docstring). `nodes` None: every rank on one node. The fused ring spans one node only."""
        transport = RingTransport(transport)
        nodes = nodes or Nodes(shape.degree)
        blocks = RingBlocks.of(shape, ring_degree, ulysses_degree)
        if transport is RingTransport.FUSED and nodes.ring_crosses(ulysses_degree, ring_degree):
            raise ValueError(f"the fused ring spans one node; {ring_degree} x {ulysses_degree} ranks cross nodes of "
                             f"{nodes.ranks_per_node}")
        steps = self.steps(blocks, own=transport is RingTransport.FUSED)
        passed, last = steps[:-1], steps[-1]  # every step but the last sends its block on
        if transport is RingTransport.SERIAL:
            ring = sum(steps) + len(passed) * self.send(blocks, nodes)
        elif transport is RingTransport.OVERLAP:
            send = self.send(blocks, nodes)
            ring = sum(max(step, send) for step in passed) + last
        else:
            ring = sum(passed) + len(passed) * self.forward(blocks).added + last
        return self.ulysses_around(blocks) + ring
