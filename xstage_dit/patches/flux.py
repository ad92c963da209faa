"""FLUX.1: joint [text, image] attention in dual- and single-stream blocks.

Image tokens and their position ids are split on entry, and so are the text tokens and theirs where the
sequence allows (`JointText`: the model drops its text at the end, and masks none of it); otherwise the text
stays whole on every rank. Either way the rotary table the model builds from [local txt_ids, local img_ids]
follows each local token's true position."""
from __future__ import annotations

from typing import Any, Callable

from diffusers import FluxTransformer2DModel
from torch import nn

from ..cfg_plan import PAIRS, CfgPlan
from ..sp import routing
from ..sp.plan import JointText, SequenceParallelPlan
from . import cfg_rules


def attention_of_both_streams(model: nn.Module) -> list[nn.Module]:
    """The `attn` of every dual-stream and single-stream block (the Flux layout, which FLUX.2 keeps)."""
    return [block.attn for block in (*model.transformer_blocks, *model.single_transformer_blocks)]


def refuse_controlnet_and_ip_adapter(family: str) -> Callable[[dict[str, Any]], None]:
    """The input check of a model with Flux's forward: ControlNet residuals and IP-Adapter embeddings are
    refused."""

    def check(arguments: dict[str, Any]) -> None:
        for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
            if arguments.get(name) is not None:
                raise NotImplementedError(f"xstage_dit: {family} with ControlNet residuals ({name}) is not "
                                          "supported yet")
        if "ip_adapter_image_embeds" in (arguments.get("joint_attention_kwargs") or {}):
            raise NotImplementedError(f"xstage_dit: {family} with IP-Adapter is not supported yet")

    return check


PLANS = {
    FluxTransformer2DModel: SequenceParallelPlan(
        family="Flux",
        call_site=("diffusers.models.transformers.transformer_flux", routing.DISPATCH),
        rotary_site="diffusers.models.transformers.transformer_flux",
        attention_modules=attention_of_both_streams,
        cfg=CfgPlan(
            PAIRS,
            output_shape=cfg_rules.token_output_shape,
            pipeline_uses_cfg=cfg_rules.true_cfg_with_pooled_negatives,
        ),
        # ids are (S, 3), or the deprecated (1, S, 3): the sequence is the second-to-last dim either way
        shard_inputs={"": {"hidden_states": -2, "img_ids": -2,
                           "encoder_hidden_states": JointText(-2), "txt_ids": JointText(-2)}},
        gather_outputs={"proj_out": -2},
        check_inputs=refuse_controlnet_and_ip_adapter("Flux"),
    )
}
