"""One patch per diffusers model family; each says where that model's tokens are sharded and which attention
modules see the whole sequence (patches/README.md says how to add a family)."""
from __future__ import annotations

from torch import nn

from ..sp.plan import SequenceParallelPlan
from .image import chroma, flux, flux2, hidream, nucleusmoe, qwenimage, qwenimage21, sd3, zimage
from .video import cogvideox, hunyuan_video, hunyuan_video15, ltx, ltx2, wan

_PLANS: dict[type, SequenceParallelPlan] = {
    **chroma.PLANS, **flux.PLANS, **flux2.PLANS, **wan.PLANS, **hunyuan_video.PLANS, **qwenimage.PLANS, **ltx.PLANS,
    **ltx2.PLANS, **sd3.PLANS, **cogvideox.PLANS, **hidream.PLANS, **nucleusmoe.PLANS, **hunyuan_video15.PLANS,
    **zimage.PLANS, **qwenimage21.PLANS,
}


def supported_models() -> tuple[type, ...]:
    """The transformer classes `enable` has a plan for."""
    return tuple(_PLANS)


def supported_families() -> list[str]:
    return sorted({f"{plan.family} ({cls.__name__})" for cls, plan in _PLANS.items()})


def is_supported(model: nn.Module) -> bool:
    return type(model) in _PLANS


def plan_for(model: nn.Module) -> SequenceParallelPlan:
    """The plan for `model`'s class; a clear error naming what is supported otherwise."""
    plan = _PLANS.get(type(model))
    if plan is None:
        raise TypeError(
            f"xstage_dit has no sequence-parallel patch for {type(model).__name__}; "
            f"supported: {', '.join(supported_families())}"
        )
    return plan
