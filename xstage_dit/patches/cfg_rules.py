"""Facts the CFG split needs about pipelines that call the transformer once per branch: whether a pipeline call
runs classifier-free guidance (from its bound arguments, defaults applied; the rules the pipelines themselves
apply), and the transformer output's shape."""
from __future__ import annotations

from typing import Any

from torch import nn


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
