"""Which way each mixture-of-experts layer call runs across the Ulysses group (burst_gap/moe_plan.py's ExpertMode):
the modes `enable(expert_parallel=...)` allows, and per call shape the one the Burst-Gap planner predicts fastest.

- False, or degree 1: replicated.
- True: the experts are sharded (E/N per rank); the rows travel over the group's symmetric-memory fabric where
  the backend opened one (X-Stage stores), else over collectives.
- None: every expert stays on every rank and the planner picks among replicated and the expert-parallel modes
  per shape (a rank then runs its E/N experts out of the whole stacks); without a calibration that measured the
  expert kernels, replicated, said once."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ...logging_utils import logger, warn_once
from ...burst_gap.moe_plan import ExpertMode, ExpertSchedule, ExpertShape
from ...burst_gap.planner import Planner
from ..planner import planner_for


@dataclass(frozen=True)
class ExpertModes:
    """The modes a model's MoE layers may run, the one to run without a planner first (the stores mode runs on
    the Ulysses group's fabric, sp/fabric.py)."""

    allowed: tuple[ExpertMode, ...] = (ExpertMode.REPLICATED,)

    @classmethod
    def resolve(cls, expert_parallel: bool | None, degree: int, fabric_ready: bool) -> "ExpertModes":
        """`fabric_ready`: the group has its symmetric-memory fabric."""
        if degree == 1 or expert_parallel is False:
            return cls()
        if expert_parallel:
            return cls((ExpertMode.STORES if fabric_ready else ExpertMode.COLLECTIVES,))
        parallel = (ExpertMode.STORES, ExpertMode.COLLECTIVES) if fabric_ready else (ExpertMode.COLLECTIVES,)
        return cls((ExpertMode.REPLICATED, *parallel))

    @property
    def sharded(self) -> bool:
        """Whether a rank keeps only its E/N experts on the device."""
        return ExpertMode.REPLICATED not in self.allowed

    def choose(self, shape: ExpertShape, device: torch.device) -> ExpertMode:
        if len(self.allowed) == 1:
            return self.allowed[0]
        planner = _expert_planner(device, shape.degree)
        if planner is None:
            return self.allowed[0]
        return decide(planner, shape, self.allowed)

    def schedule(self, shape: ExpertShape, device: torch.device) -> ExpertSchedule:
        """The stores mode's schedule: the planner's, else one wave."""
        planner = _expert_planner(device, shape.degree)
        return ExpertSchedule() if planner is None else _schedule(planner, shape)


def _expert_planner(device: torch.device, degree: int) -> Planner | None:
    planner = planner_for(device, degree)
    if planner is None or not planner.experts.calibrated():
        if device.type == "cuda":
            warn_once("xstage_dit: this GPU's Burst-Gap calibration does not predict mixture-of-experts layers; "
                      "they run in their default mode (run `xstage-dit calibrate` once on this machine)")
        return None
    return planner


@lru_cache(maxsize=256)
def _schedule(planner: Planner, shape: ExpertShape) -> ExpertSchedule:
    """The planner's schedule for `shape`, computed once (every layer call of that shape asks)."""
    return planner.experts.schedule(shape)


@lru_cache(maxsize=256)
def decide(planner: Planner, shape: ExpertShape, allowed: tuple[ExpertMode, ...]) -> ExpertMode:
    """The allowed mode the planner predicts fastest for `shape` (said once per shape in the log)."""
    predicted = planner.experts.predict(shape, allowed)
    mode = min(predicted, key=predicted.__getitem__)
    logger.info("xstage_dit experts: %s -> %s (predicted ms: %s)", shape, mode.value,
                ", ".join(f"{m.value} {seconds * 1e3:.3f}" for m, seconds in predicted.items()))
    return mode
