"""backend="auto": per attention shape, the backend the Burst-Gap planner predicts fastest on this machine.

The planner needs this GPU's calibration (`xstage-dit calibrate`); without one, auto runs the reference
backend and says so once. Every rank reads the same calibration and sees the same shape, so every rank of a
group makes the same choice (they must: the backends' collectives differ)."""
from __future__ import annotations

from functools import lru_cache

import torch

from ..logging_utils import logger, warn_once
from ..runtime.distributed import ranks_share_gpus
from ..xstage.calibration import find_calibration
from ..xstage.planner import BACKENDS, AttentionShape, Planner
from .backends import LocalAttention, UlyssesLayout, get_backend, runnable

FALLBACK = "reference"


@lru_cache(maxsize=None)
def planner_for(device: torch.device, world_size: int) -> Planner | None:
    if device.type != "cuda":
        return None
    gpu = torch.cuda.get_device_name(device)
    calibration = find_calibration(gpu, world_size, "same-gpu" if ranks_share_gpus() else None)
    if calibration is None:
        return None
    logger.info("xstage_dit: backend='auto' plans with the %s calibration (%d ranks)", calibration.topology,
                calibration.world_size)
    return Planner.from_calibration(calibration)


def _candidates(query: torch.Tensor, pool_ready: bool) -> tuple[str, ...]:
    """The backends the planner predicts that can run these inputs here."""
    return tuple(name for name in BACKENDS if runnable(name, query, pool_ready))


def _shape(query: torch.Tensor, layout: UlyssesLayout | None) -> AttentionShape:
    batch, tokens, heads, head_dim = query.shape
    if layout is None:
        return AttentionShape(batch, tokens, 0, heads, head_dim, 1, query.element_size())
    return AttentionShape(batch, layout.seq_len, layout.text_len, heads, head_dim, layout.degree,
                          query.element_size())


def choose(query: torch.Tensor, layout: UlyssesLayout | None, pool_ready: bool) -> str:
    """The backend for this call (layout None: degree 1). `pool_ready`: the group has a symmetric pool."""
    planner = planner_for(query.device, layout.degree if layout else 1)
    if planner is None:
        if query.is_cuda:
            warn_once(f"xstage_dit: no Burst-Gap calibration for {torch.cuda.get_device_name(query.device)}; "
                      f"backend='auto' runs {FALLBACK!r} (run `xstage-dit calibrate` once on this machine)")
        return FALLBACK
    shape = _shape(query, layout)
    # degree 1 runs the backends' local kernels: no pool needed
    return _decide(planner, shape, _candidates(query, pool_ready or layout is None))


@lru_cache(maxsize=256)
def _decide(planner: Planner, shape: AttentionShape, candidates: tuple[str, ...]) -> str:
    name = planner.choose(shape, candidates)
    predicted = planner.predict(shape)
    logger.info("xstage_dit auto: %s -> %s (predicted ms: %s)", shape, name,
                ", ".join(f"{n} {predicted[n] * 1e3:.3f}" for n in candidates))
    return name


def choose_local(query: torch.Tensor) -> LocalAttention:
    """Degree 1: the attention kernel of the backend the planner picks."""
    return get_backend(choose(query, None, pool_ready=False)).local


def rotated_tile_order(query: torch.Tensor, layout: UlyssesLayout) -> bool:
    """The fused kernel's tile order for this call: rotated unless the planner predicts rank-major faster
    (rotated is the default without a calibration: the model never predicts it slower)."""
    planner = planner_for(query.device, layout.degree)
    return True if planner is None else _tile_order(planner, _shape(query, layout))


@lru_cache(maxsize=256)
def _tile_order(planner: Planner, shape: AttentionShape) -> bool:
    return planner.tile_order(shape)
