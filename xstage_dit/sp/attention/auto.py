"""backend="auto": per attention call, the strategy the Burst-Gap planner predicts fastest on this machine, among
those that take the call: by its Ulysses call's cost, or in a ring by its ring's.

Without a calibration of this GPU (`xstage-dit calibrate`), auto runs the reference strategy and says so once.
Its FP8 variant chooses among the strategies' FP8 variants alike (priced as the strategies themselves)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ...logging_utils import logger, warn_once
from ...burst_gap.planner import Planner
from ...burst_gap.ulysses_plan import AttentionShape
from .backends import FALLBACK, Call, Precision, Strategy, backends, costs_of, get_backend
from ..planner import attention_shape, planner_for, ring_shape


@dataclass(frozen=True)
class Auto:
    """The chooser behind backend="auto": among the strategies of its `precision`."""

    name: str = "auto"
    precision: Precision = Precision.NATIVE
    fp8: Auto | None = None

    def candidates(self) -> tuple[Strategy, ...]:
        return tuple(backends(self.precision))

    def pick(self, call: Call) -> Strategy:
        query, layout = call.query, call.layout
        ranks = 1 if layout is None else layout.degree * layout.ring_degree
        planner = planner_for(query.device, ranks)
        fallback = get_backend(FALLBACK)
        if self.precision is Precision.FP8:
            fallback = fallback.fp8
        if planner is None:
            if query.is_cuda:
                warn_once(f"xstage_dit: no Burst-Gap calibration for {torch.cuda.get_device_name(query.device)}; "
                          f"backend={self.name!r} runs {fallback.name!r} (run `xstage-dit calibrate` once on this "
                          "machine)")
            return fallback.pick(call)
        runnable = tuple(strategy for strategy in self.candidates() if strategy.refusal(call) is None)
        if not runnable:  # none of its precision takes the call: the fallback says why, and runs FALLBACK's
            return fallback.pick(call)
        if call.ring:
            return decide_ring(planner, ring_shape(query, layout), layout.ring_degree, layout.degree, runnable)
        return decide(planner, attention_shape(query, layout, call.fp8_payloads), runnable)


@lru_cache(maxsize=256)
def decide(planner: Planner, shape: AttentionShape, candidates: tuple[Strategy, ...]) -> Strategy:
    """The candidate the planner predicts fastest for `shape` (said once per shape in the log)."""
    return _fastest(shape, planner.predict(shape, costs_of(candidates)))


@lru_cache(maxsize=256)
def decide_ring(planner: Planner, shape: AttentionShape, ring_degree: int, ulysses_degree: int,
                candidates: tuple[Strategy, ...]) -> Strategy:
    """The candidate whose ring the planner predicts fastest for `shape` over ring_degree x ulysses_degree ranks
    (strategies whose rings travel alike: the first of them)."""
    return _fastest(shape, planner.predict_ring(shape, ring_degree, ulysses_degree, costs_of(candidates)))


def _fastest(shape: AttentionShape, predicted: dict[str, float]) -> Strategy:
    name = min(predicted, key=predicted.__getitem__)
    logger.info("xstage_dit auto: %s -> %s (predicted ms: %s)", shape, name,
                ", ".join(f"{n} {seconds * 1e3:.3f}" for n, seconds in predicted.items()))
    return get_backend(name)


CHOICE = Auto(fp8=Auto("auto+fp8", Precision.FP8))
