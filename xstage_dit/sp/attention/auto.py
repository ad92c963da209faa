"""backend="auto": per attention call, the strategy the Burst-Gap planner predicts fastest on this machine, among
those that take the call: by its Ulysses call's cost, or in a ring by its ring's.

Without a calibration of this GPU (`xstage-dit calibrate`), auto runs the reference strategy and says so once."""
from __future__ import annotations

from functools import lru_cache

import torch

from ...logging_utils import logger, warn_once
from ...burst_gap.planner import AttentionShape, Planner
from .backends import FALLBACK, Call, Strategy, backends, costs_of, get_backend
from ..planner import attention_shape, planner_for, ring_shape


class Auto:
    """The chooser behind backend="auto"."""

    name = "auto"

    def candidates(self) -> tuple[Strategy, ...]:
        return tuple(backends())

    def pick(self, call: Call) -> Strategy:
        query, layout = call.query, call.layout
        ranks = 1 if layout is None else layout.degree * layout.ring_degree
        planner = planner_for(query.device, ranks)
        if planner is None:
            if query.is_cuda:
                warn_once(f"xstage_dit: no Burst-Gap calibration for {torch.cuda.get_device_name(query.device)}; "
                          f"backend='auto' runs {FALLBACK!r} (run `xstage-dit calibrate` once on this machine)")
            return get_backend(FALLBACK)
        runnable = tuple(strategy for strategy in backends() if strategy.refusal(call) is None)
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


CHOICE = Auto()
