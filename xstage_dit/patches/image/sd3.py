"""Stable Diffusion 3 / 3.5: joint [image, text] attention (text last, 77 + 256 tokens), SD3.5's extra
image-only `attn2` in dual-attention layers. Processors call F.scaled_dot_product_attention directly.

Image tokens are split at the patch embedding's output (positions already added); CFG is one batched call."""
from __future__ import annotations

from typing import Any

from diffusers import SD3Transformer2DModel
from torch import nn

from ...cfg.plan import BATCH, CfgPlan
from ...sp.attention import routing
from ...sp.plan import SequenceParallelPlan


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    modules = []
    for block in model.transformer_blocks:
        modules.append(block.attn)
        if getattr(block, "attn2", None) is not None:  # SD3.5 dual attention: image-only self-attention
            modules.append(block.attn2)
    return modules


def _check_inputs(arguments: dict[str, Any]) -> None:
    if arguments.get("block_controlnet_hidden_states") is not None:
        raise NotImplementedError("xstage_dit: SD3 with ControlNet residuals is not supported yet")
    if "ip_adapter_image_embeds" in (arguments.get("joint_attention_kwargs") or {}):
        raise NotImplementedError("xstage_dit: SD3 with IP-Adapter is not supported yet")


PLANS = {
    SD3Transformer2DModel: SequenceParallelPlan(
        family="SD3",
        call_site=("diffusers.models.attention_processor", routing.SDPA),
        attention_modules=_attention_modules,
        cfg=CfgPlan(BATCH, batch_inputs={"hidden_states": 0, "encoder_hidden_states": 0,
                                         "pooled_projections": 0, "timestep": 0}),
        shard_outputs={"pos_embed": {0: 1}},
        gather_outputs={"proj_out": 1},
        text_first=False,
        check_inputs=_check_inputs,
    )
}
