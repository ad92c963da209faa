"""Facts the CFG split needs about pipelines that call the transformer once per branch: whether a pipeline call
runs classifier-free guidance (from its bound arguments, defaults applied; the rules the pipelines themselves
apply), and the transformer output's shape."""
from __future__ import annotations

import math
from typing import Any

from diffusers import ClassifierFreeGuidance
from torch import nn

from ..logging_utils import warn_once


def video_output_shape(model: nn.Module, arguments: dict[str, Any]) -> tuple[int, ...]:
    """(B, C_out, F, H, W) models: the output has the input's shape with the model's output channels."""
    shape = arguments["hidden_states"].shape
    return (shape[0], model.config.out_channels or model.config.in_channels, *shape[2:])


def token_output_shape(model: nn.Module, arguments: dict[str, Any]) -> tuple[int, ...]:
    """(B, S, C) models ending in `proj_out`: the output has the input's tokens and proj_out's features."""
    return (*arguments["hidden_states"].shape[:-1], model.proj_out.out_features)


def prefixed_token_output_shape(model: nn.Module, arguments: dict[str, Any]) -> tuple[int, ...]:
    """Qwen-Image 2.1: the output also covers the prompt prefix, except in calls that read it from the KV cache."""
    batch, tokens, _ = arguments["hidden_states"].shape
    if arguments.get("kv_cache_mode") != "cached":
        tokens += arguments["encoder_hidden_states"].shape[1]
    return (batch, tokens, model.proj_out.out_features)


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


def guidance_above_one_unless_distilled(a: dict[str, Any]) -> bool:
    """Flux2KleinPipeline: guidance_scale > 1 on a pipeline not configured `is_distilled`; Flux2Pipeline, whose
    config has no such entry, embeds its guidance and never calls the transformer twice."""
    return a.get("guidance_scale", 1.0) > 1 and not getattr(a["self"].config, "is_distilled", True)


def guider_guides_every_step(a: dict[str, Any]) -> bool:
    """HunyuanVideo15Pipeline: its guider runs the conditional call, then the unconditional one, in every step
    (diffusers' ClassifierFreeGuidance over the whole schedule, scale away from "off"). Another guider, or one that
    guides only some steps, makes a varying number of calls per step: every CFG group then computes every call."""
    guider = getattr(a["self"], "guider", None)
    if type(guider) is not ClassifierFreeGuidance:
        warn_once(f"xstage_dit: cfg_degree=2 splits ClassifierFreeGuidance's two calls only, not a "
                  f"{type(guider).__name__}'s: every CFG group computes every call")
        return False
    off = 0.0 if guider.use_original_formulation else 1.0
    if not getattr(guider, "_enabled", False) or math.isclose(guider.guidance_scale, off):
        return False
    if (getattr(guider, "_start", None), getattr(guider, "_stop", None)) != (0.0, 1.0):
        warn_once("xstage_dit: cfg_degree=2 splits a guider's calls only where it guides every step (start=0, "
                  "stop=1): every CFG group computes every call")
        return False
    return True
