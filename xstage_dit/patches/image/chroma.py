"""Chroma: FLUX.1's dual- and single-stream blocks (its processor is Flux's), modulation from an approximator, and
a prompt padding mask that every block turns into an additive (queries x keys) outer product of the joint
[text, image] mask: 1 added to the logits of valid pairs, 0 wherever a padding token is the query or the key.

Image tokens and their ids are split on entry, and so is the image part of the joint mask; the text stays whole
(its padding is masked, not dropped). The padding tokens' own rows are not masked, and other tokens read them
(as keys, without the bonus): attention rebuilds the pair bias over the gathered tokens
(`QueryKeyMasks.PAIR_BIAS`), which only the reference backend attends with.

The timestep embedding's guidance term runs on the model's device (`DeviceGuidanceEmbeddings`): diffusers computes
it on the host and copies it over in every forward, a copy that keeps the forward out of a CUDA graph."""
from __future__ import annotations

from typing import Any

import torch
from diffusers import ChromaTransformer2DModel
from diffusers.models.transformers import transformer_chroma
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...hooks.module_forward import SwappedClasses
from ...sp.attention import routing
from ...sp.attention.masks import QueryKeyMasks
from ...sp.plan import (FAMILY_CHANGES, FUSED_ROPE, SPLIT_PROJECTION, PlanContext, SequenceParallelPlan, TextAndImage,
                        model_only)
from .. import cfg_rules
from .flux import attention_of_both_streams, norm_rope_processors
from .flux_mlp import split_projection_blocks

_FLUX = "diffusers.models.transformers.transformer_flux"  # Chroma's blocks run Flux's processor


class DeviceGuidanceEmbeddings(transformer_chroma.ChromaCombinedTimestepTextProjEmbeddings):
    """diffusers' Chroma timestep embeddings with the guidance projection (of zeros) computed on the timestep's
    device; the same values (the sine of 0 is 0 and its cosine 1 on any device)."""

    def forward(self, timestep: torch.Tensor) -> torch.Tensor:
        mod_index_length = self.mod_proj.shape[0]
        batch_size = timestep.shape[0]
        timesteps_proj = self.time_proj(timestep).to(dtype=timestep.dtype)
        guidance_proj = self.guidance_proj(timestep.new_zeros(batch_size)).to(dtype=timestep.dtype)
        mod_proj = self.mod_proj.to(dtype=timesteps_proj.dtype, device=timesteps_proj.device).repeat(batch_size, 1, 1)
        timestep_guidance = torch.cat([timesteps_proj, guidance_proj], dim=1).unsqueeze(1)
        input_vec = torch.cat([timestep_guidance.repeat(1, mod_index_length, 1), mod_proj], dim=-1)
        return input_vec.to(timestep.dtype)


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    embeddings = [module for module in model.modules()
                  if type(module) is transformer_chroma.ChromaCombinedTimestepTextProjEmbeddings]
    return [SwappedClasses(embeddings, DeviceGuidanceEmbeddings)]


def _refuse_controlnet_and_ip_adapter(arguments: dict[str, Any]) -> None:
    """ControlNet residuals and IP-Adapter embeddings, which no Chroma pipeline of diffusers passes, are refused."""
    if arguments.get("controlnet_block_samples") is not None:
        raise NotImplementedError("xstage_dit: Chroma with ControlNet residuals is not supported")
    if "ip_adapter_image_embeds" in (arguments.get("joint_attention_kwargs") or {}):
        raise NotImplementedError("xstage_dit: Chroma with IP-Adapter is not supported")


PLANS = {
    ChromaTransformer2DModel: SequenceParallelPlan(
        family="Chroma",
        call_site=(_FLUX, routing.DISPATCH),
        rotary_site=_FLUX,
        attention_modules=attention_of_both_streams,
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.token_output_shape, pipeline_uses_cfg=cfg_rules.guidance_above_one),
        shard_inputs={"": {"hidden_states": -2, "img_ids": -2, "attention_mask": TextAndImage(-1)}},
        gather_outputs={"proj_out": -2},
        check_inputs=_refuse_controlnet_and_ip_adapter,
        query_key_masks=QueryKeyMasks.PAIR_BIAS,
        installs={FAMILY_CHANGES: _install, FUSED_ROPE: model_only(norm_rope_processors),
                  SPLIT_PROJECTION: model_only(split_projection_blocks)},
    )
}
