"""When a pipeline call runs classifier-free guidance, from its bound arguments (defaults applied): the rules
the pipelines themselves apply, for the CFG split of pipelines that call the transformer once per branch."""
from __future__ import annotations

from typing import Any


def true_cfg_with_pooled_negatives(a: dict[str, Any]) -> bool:
    """FluxPipeline, HunyuanVideoPipeline: true_cfg_scale > 1 and a negative prompt (or both negative embeds)."""
    has_negative = a.get("negative_prompt") is not None or (
        a.get("negative_prompt_embeds") is not None and a.get("negative_pooled_prompt_embeds") is not None
    )
    return a.get("true_cfg_scale", 1.0) > 1 and has_negative


def true_cfg(a: dict[str, Any]) -> bool:
    """QwenImagePipeline: true_cfg_scale > 1 and a negative prompt or negative embeds."""
    has_negative = a.get("negative_prompt") is not None or a.get("negative_prompt_embeds") is not None
    return a.get("true_cfg_scale", 1.0) > 1 and has_negative


def guidance_above_one(a: dict[str, Any]) -> bool:
    """WanPipeline (do_classifier_free_guidance)."""
    return a.get("guidance_scale", 1.0) > 1
