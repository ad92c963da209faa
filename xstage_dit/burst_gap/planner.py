"""The planner: one machine's calibration (the fitted Burst-Gap model and measured kernel costs) as one cost core
(burst_gap/cost.py), the domains that price their work with it (`ulysses`: burst_gap/ulysses_plan.py, `rings`:
ring_plan.py, `experts`: moe_plan.py; each module's docstring has its formulas), and the choice among the
attention strategies and the Ulysses x ring splits of a layer's ranks.

The planner names no strategy: each registry entry (sp/attention/backends.py) hands it a `PlannedStrategy`, the
prediction of its Ulysses call (a `Cost`) and the transport its ring's blocks take (a `RingTransport`, or None
where it runs no ring). `predict`, `predict_ring` and `layer_splits` take that mapping of names to records.

`layer_splits` predicts every U x R of a layer's ranks (U dividing the heads, within a node) with each strategy
that can run it, fastest first; `xstage-dit plan` prints them and the pick."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

from .calibration import Calibration, KernelCosts
from .cost import CostCore
from .model import BurstGapModel
from .moe_plan import ExpertPlanner
from .ring_plan import Nodes, RingPlanner, RingTransport
from .ulysses_plan import AttentionShape, Cost, UlyssesPlanner


@dataclass(frozen=True)
class PlannedStrategy:
    """What the planner reads of one attention strategy: `call`, its predicted Ulysses call (ring degree 1), and
    `ring`, how its ring's key/value blocks travel (None: it runs no ring). Strategies whose rings travel alike
    are one ring prediction: the Ulysses exchange around a ring is modelled as the serial one."""

    call: Cost
    ring: RingTransport | None


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


class Planner:
    """One cost core and the domains over it: `ulysses` (Ulysses attention calls and the fused kernel's tile
    order), `rings` (ring calls by transport), `experts` (MoE layer calls and the stores mode's schedule)."""

    def __init__(self, model: BurstGapModel, costs: KernelCosts) -> None:
        self.core = CostCore(model, costs)
        self.ulysses = UlyssesPlanner(self.core)
        self.rings = RingPlanner(self.core)
        self.experts = ExpertPlanner(self.core)

    @classmethod
    def from_calibration(cls, calibration: Calibration) -> "Planner":
        return cls(calibration.model, calibration.costs)

    def predict(self, shape: AttentionShape, strategies: Mapping[str, PlannedStrategy]) -> dict[str, float]:
        """Predicted seconds of one Ulysses attention call per strategy, from each strategy's cost function."""
        return {name: strategy.call(self.ulysses, shape) for name, strategy in strategies.items()}

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
            found[name] = self.rings.call(shape, ring_degree, ulysses_degree, transport, nodes)
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
