"""The mixture-of-experts domain of the planner: the predicted time of one expert-choice MoE layer call per mode,
and the stores mode's schedule, priced by the cost core (burst_gap/cost.py).

Each of E experts takes C tokens per sample, B * C rows; per rank:

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
from dataclasses import dataclass

from ..sizes import EXPERT_TILES, ExpertTiles, ceil_div
from .cost import CostCore, store_train


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


class ExpertPlanner:
    """MoE layer calls priced by one cost core."""

    def __init__(self, core: CostCore) -> None:
        self.core = core

    def calibrated(self) -> bool:
        """Whether the calibration measured the expert kernels (older ones did not)."""
        return bool(self.core.costs.expert_tflops)

    def gathered_scores(self, shape: ExpertShape) -> float:
        """Every mode's start: the router scores of the whole sequence on every rank."""
        return self.core.copy(shape.batch * shape.tokens * shape.experts * shape.element_bytes)

    def replicated(self, shape: ExpertShape) -> float:
        slot_bytes = shape.slots * shape.row_bytes
        compute = self.core.costs.expert_time(shape.flops(shape.slots / shape.degree),
                                              shape.rows_per_expert / shape.degree, own=False)
        # gather the slot rows, weigh them, sum each token's rows in expert order
        return self.gathered_scores(shape) + compute + 3 * self.core.copy(slot_bytes)

    def collectives(self, shape: ExpertShape) -> float:
        costs = self.core.costs
        n = shape.degree
        group_bytes = n * shape.batch * shape.local_tokens * shape.row_bytes
        collective = costs.launch + group_bytes * (n - 1) / n / costs.alltoall_rate
        mine = shape.slots / n
        compute = costs.expert_time(shape.flops(mine), shape.rows_per_expert, own=False)
        # gather, weigh, zero + add
        copies = 2 * self.core.copy(mine * shape.row_bytes) + self.core.copy(group_bytes)
        return self.gathered_scores(shape) + 2 * collective + compute + copies

    def stores(self, shape: ExpertShape, schedule: ExpertSchedule, tiles: ExpertTiles = EXPERT_TILES) -> float:
        costs = self.core.costs
        n = shape.degree
        mine = shape.slots / n
        remote = (n - 1) / n
        sent = mine * shape.row_bytes
        dispatch = costs.launch + max(sent / costs.copy_rate, self.core.model.delivery_time(sent * remote, costs.sms))
        summed = self.core.copy((mine + shape.batch * shape.local_tokens) * shape.row_bytes)
        kernels = self.kernels(shape, schedule, tiles)
        return self.gathered_scores(shape) + dispatch + kernels + 2 * costs.launch + summed

    def kernels(self, shape: ExpertShape, schedule: ExpertSchedule, tiles: ExpertTiles = EXPERT_TILES) -> float:
        """The expert kernel's launches under `schedule`, with the combine stores' Burst-Gap stalls."""
        costs = self.core.costs
        n = shape.degree
        experts = shape.experts // n
        rows = shape.rows_per_expert
        rate = costs.expert_time(shape.flops(experts * rows), rows, own=True) - costs.launch
        up_share = 4.0 / 6.0  # of an expert's flops: gate and up (2F columns) against down (D columns)
        up_tiles = tiles.up_tiles(rows, shape.width)
        down_tiles = tiles.down_tiles(rows, shape.dim)
        tile_bytes = tiles.rows * tiles.down_columns * shape.element_bytes * (n - 1) / n
        total = 0.0
        for up, down in schedule.launches(experts):
            compute = rate * (len(up) * up_share + len(down) * (1 - up_share)) / experts
            total += costs.launch + compute
            storing = len(down) * down_tiles
            if not storing:
                continue
            in_flight = min(costs.sms, storing + len(up) * up_tiles)
            producers = max(1, round(in_flight * storing / (storing + len(up) * up_tiles)))
            bursts = math.ceil(storing / producers)
            total += store_train(self.core.model, compute / bursts, producers * tile_bytes, producers, bursts)
        return total

    def schedule(self, shape: ExpertShape) -> ExpertSchedule:
        """The schedule predicted fastest for the stores mode (fewer launches on ties)."""
        return min(SCHEDULES, key=lambda schedule: self.kernels(shape, schedule))

    def predict(self, shape: ExpertShape, modes: tuple[ExpertMode, ...]) -> dict[ExpertMode, float]:
        """Predicted seconds of one MoE layer call per mode (the stores mode in its best schedule)."""
        cost = {ExpertMode.REPLICATED: self.replicated, ExpertMode.COLLECTIVES: self.collectives,
                ExpertMode.STORES: lambda s: self.stores(s, self.schedule(s))}
        return {mode: cost[mode](shape) for mode in modes}
