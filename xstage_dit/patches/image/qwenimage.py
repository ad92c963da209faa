"""QwenImage: joint [text, image] attention (text first) with a text padding mask.

Packed image tokens are split on entry with the image rotary table (complex, image rows only); the text rotary
table and the text tokens stay whole. The model builds its mask from the local token count. Edit models with
`zero_cond_t` (Edit-2511) pick each image token's modulation by `modulate_index`, which every block gets and
which is split with the tokens there.

A ControlNet (QwenImageControlNetPipeline's, each of a QwenImageMultiControlNetModel's) is split the same way;
the residuals it returns stay split, and the transformer adds this rank's tokens of them to its own.

The text lengths the model derives from its mask are computed without diffusers' host-to-device copy of the full
length (`text_lengths_without_copy`), which would keep the forward out of a CUDA graph."""
from __future__ import annotations

from typing import Any, Callable

import torch
from diffusers import QwenImageControlNetModel, QwenImageTransformer2DModel
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...hooks.module_forward import ReboundName
from ...sp.attention import routing
from ...sp.plan import FAMILY_CHANGES, LocalOrWhole, PerToken, PlanContext, SequenceParallelPlan
from .. import cfg_rules

_QWEN = "diffusers.models.transformers.transformer_qwenimage"
_QWEN_CONTROLNET = "diffusers.models.controlnets.controlnet_qwenimage"
TextLengths = tuple[int, torch.Tensor | None, torch.Tensor | None]


def text_lengths_without_copy(original: Callable[..., TextLengths]) -> Callable[..., TextLengths]:
    """diffusers' `compute_text_seq_len_from_mask`, with the full length that stands in for a prompt without
    valid tokens given as a scalar instead of a tensor copied from the host; the same results. Inputs without a
    mask, or with one of the wrong shape, go to diffusers' function (its answer, its error)."""

    def compute_text_seq_len_from_mask(encoder_hidden_states: torch.Tensor,
                                       encoder_hidden_states_mask: torch.Tensor | None) -> TextLengths:
        batch_size, text_len = encoder_hidden_states.shape[:2]
        if encoder_hidden_states_mask is None or encoder_hidden_states_mask.shape[:2] != (batch_size, text_len):
            return original(encoder_hidden_states, encoder_hidden_states_mask)
        mask = encoder_hidden_states_mask.to(torch.bool)
        positions = torch.arange(text_len, device=encoder_hidden_states.device)
        last_valid = torch.where(mask, positions, 0).max(dim=1).values + 1
        return text_len, torch.where(mask.any(dim=1), last_valid, text_len), mask

    return compute_text_seq_len_from_mask


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    return [ReboundName(_QWEN, "compute_text_seq_len_from_mask", text_lengths_without_copy)]


def _install_controlnet(model: nn.Module, context: PlanContext) -> list[Any]:
    return [ReboundName(_QWEN_CONTROLNET, "compute_text_seq_len_from_mask", text_lengths_without_copy)]


PLANS = {
    QwenImageTransformer2DModel: SequenceParallelPlan(
        family="QwenImage",
        call_site=(_QWEN, routing.DISPATCH),
        attention_modules=lambda model: [block.attn for block in model.transformer_blocks],
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.token_output_shape, pipeline_uses_cfg=cfg_rules.true_cfg),
        shard_inputs={"": {"hidden_states": 1, "controlnet_block_samples": LocalOrWhole(1)},
                      "transformer_blocks.*": {"modulate_index": PerToken(1)}},
        shard_outputs={"pos_embed": {0: 0}},
        gather_outputs={"proj_out": 1},
        installs={FAMILY_CHANGES: _install},
    ),
    QwenImageControlNetModel: SequenceParallelPlan(
        family="QwenImage ControlNet",
        call_site=(_QWEN, routing.DISPATCH),
        attention_modules=lambda model: [block.attn for block in model.transformer_blocks],
        cfg=None,
        # the control image's tokens split after their embedding; the residuals it returns stay this rank's
        # tokens, which the enabled transformer adds to its own
        shard_inputs={"": {"hidden_states": 1}},
        shard_outputs={"pos_embed": {0: 0}, "controlnet_x_embedder": {0: 1}},
        installs={FAMILY_CHANGES: _install_controlnet},
    ),
}
