"""Wan 2.1 / 2.2: self-attention over video tokens, cross-attention to text.

Video tokens are split after patch embedding (entry of the first block) together with the rotary table;
cross-attention then runs locally on each rank's token shard, since every rank holds all text tokens. Wan 2.2
TI2V's per-token timesteps are split with the tokens on entry, so its per-token modulation (every block's and
the output norm's) comes out split too. Wan VACE runs its control blocks first, on the video tokens and the
control video's tokens (padded to the same length): both are split at the first control block, and each block's
hint, computed per token, is added to the split tokens of its main block.

While RoPE is fused (XStageConfig.fuse_rope), the self-attention modules run `WanNormRopeProcessor`: where the
routed attention takes q and k before their prologue (a Ulysses degree above 1 and a backend that stores them
into the all-to-all: sp/attention/routing.py `joint_attention`), q and k go over as projected, with their RMSNorms
(over all heads, as Wan normalises) and rotation applied in the stores; everywhere else diffusers' processor runs
as is."""
from __future__ import annotations

from typing import Any

import torch
from diffusers import WanTransformer3DModel, WanVACETransformer3DModel
from diffusers.models.transformers import transformer_wan
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...fusions.plain import reads_plain
from ...kernels.rotary_args import JointTokens, NormRope
from ...sp.attention import routing
from ...sp.plan import FUSED_ROPE, PerToken, SequenceParallelPlan, model_only
from .. import cfg_rules
from ..processors import ReplacedProcessors, StandInProcessor, rms_norm_eps


def _self_attention(model: nn.Module) -> list[nn.Module]:
    return [block.attn1 for block in (*getattr(model, "vace_blocks", []), *model.blocks)]


def _normed_rotated(tokens: torch.Tensor, norm: nn.RMSNorm, cos: torch.Tensor, sin: torch.Tensor) -> JointTokens:
    return JointTokens((tokens,), NormRope((norm.weight,), (rms_norm_eps(norm),), cos, sin, across_heads=True))


class WanNormRopeProcessor(StandInProcessor):
    """diffusers' Wan self-attention, with q and k handed to the routed attention before their norms and rotation
    where it takes them so (`routing.joint_attention_offered`); otherwise, and should it refuse the tensors
    themselves, diffusers' processor runs the call. Wan's rotation reads cos at even and sin at odd positions of
    tables that repeat each value twice, which is the interleaved rotation our kernels compute."""

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        hidden = None
        if (rotary_emb is not None and encoder_hidden_states is None and attention_mask is None
                and routing.joint_attention_offered(hidden_states.shape[1], hidden_states.device)
                and all(reads_plain(norm, nn.RMSNorm, f"WanAttention.{name} in the norm + RoPE pass")
                        for name, norm in (("norm_q", attn.norm_q), ("norm_k", attn.norm_k)))):
            query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in
                                 transformer_wan._get_qkv_projections(attn, hidden_states, None))
            cos, sin = (table[0, :, 0] for table in rotary_emb)  # (1, S, 1, D) tables
            hidden = routing.joint_attention(_normed_rotated(query, attn.norm_q, cos, sin),
                                             _normed_rotated(key, attn.norm_k, cos, sin), JointTokens((value,)),
                                             None, self._attention_backend)
        if hidden is None:
            return transformer_wan.WanAttnProcessor.__call__(self, attn, hidden_states, encoder_hidden_states,
                                                             attention_mask, rotary_emb)
        return attn.to_out[1](attn.to_out[0](hidden.flatten(2, 3).type_as(value)))


def _takes_norm_rope(attn: nn.Module) -> bool:
    return (type(attn.processor) is transformer_wan.WanAttnProcessor and attn.add_k_proj is None
            and all(isinstance(norm, nn.RMSNorm) and norm.weight is not None for norm in (attn.norm_q, attn.norm_k)))


def norm_rope_processors(model: nn.Module) -> list[Any]:
    """Every self-attention module that runs diffusers' processor with RMSNorm q/k norms runs
    `WanNormRopeProcessor` (while RoPE is fused)."""
    return [ReplacedProcessors(_self_attention(model), _takes_norm_rope, WanNormRopeProcessor)]

_CFG = CfgPlan(PAIRS, output_shape=cfg_rules.video_output_shape, pipeline_uses_cfg=cfg_rules.guidance_above_one)

PLANS = {
    WanTransformer3DModel: SequenceParallelPlan(
        family="Wan",
        call_site=("diffusers.models.transformers.transformer_wan", routing.DISPATCH),
        attention_modules=_self_attention,
        cfg=_CFG,
        shard_inputs={"": {"timestep": PerToken(1)}, "blocks.0": {"hidden_states": 1}},
        shard_outputs={"rope": {0: 1, 1: 1}},
        gather_outputs={"proj_out": 1},
        installs={FUSED_ROPE: model_only(norm_rope_processors)},
    ),
    WanVACETransformer3DModel: SequenceParallelPlan(
        family="Wan VACE",
        call_site=("diffusers.models.transformers.transformer_wan", routing.DISPATCH),
        attention_modules=_self_attention,
        cfg=_CFG,
        shard_inputs={"vace_blocks.0": {"hidden_states": 1, "control_hidden_states": 1},
                      "blocks.0": {"hidden_states": 1}},
        shard_outputs={"rope": {0: 1, 1: 1}},
        gather_outputs={"proj_out": 1},
        installs={FUSED_ROPE: model_only(norm_rope_processors)},
    ),
}
