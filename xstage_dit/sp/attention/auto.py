"""backend="auto": per attention shape, the backend the Burst-Gap planner predicts fastest on this machine.

Without a calibration of this GPU (`xstage-dit calibrate`), auto runs the reference backend and says so once."""
from __future__ import annotations

from functools import lru_cache

import torch

from ...logging_utils import logger, warn_once
from ...burst_gap.planner import AttentionShape, Planner
from .backends import FALLBACK, Backend, backends, costs_of, get_backend
from .layout import UlyssesLayout
from ..planner import attention_shape, planner_for


class Auto:
    """The chooser behind backend="auto"."""

    name = "auto"

    def candidates(self) -> tuple[Backend, ...]:
        return tuple(backends())

    def pick(self, query: torch.Tensor, layout: UlyssesLayout | None, fabric_ready: bool) -> Backend:
        planner = planner_for(query.device, layout.degree if layout else 1)
        if planner is None:
            if query.is_cuda:
                warn_once(f"xstage_dit: no Burst-Gap calibration for {torch.cuda.get_device_name(query.device)}; "
                          f"backend='auto' runs {FALLBACK!r} (run `xstage-dit calibrate` once on this machine)")
            return get_backend(FALLBACK)
        # degree 1 runs the backends' local kernels: no fabric needed
        runnable = tuple(b for b in backends() if b.takes(query, fabric_ready or layout is None))
        return decide(planner, attention_shape(query, layout), runnable)


@lru_cache(maxsize=256)
def decide(planner: Planner, shape: AttentionShape, candidates: tuple[Backend, ...]) -> Backend:
    """The candidate the planner predicts fastest for `shape` (said once per shape in the log)."""
    predicted = planner.predict(shape, costs_of(candidates))
    name = min(predicted, key=predicted.__getitem__)
    logger.info("xstage_dit auto: %s -> %s (predicted ms: %s)", shape, name,
                ", ".join(f"{n} {seconds * 1e3:.3f}" for n, seconds in predicted.items()))
    return get_backend(name)


CHOICE = Auto()
