"""FLUX.1: joint [text, image] attention in dual- and single-stream blocks.

Image tokens and their position ids are split on entry, and so are the text tokens and theirs where the
sequence allows (`JointText`: the model drops its text at the end, and masks none of it); otherwise the text
stays whole on every rank. Either way the rotary table the model builds from [local txt_ids, local img_ids]
follows each local token's true position.

While RoPE is fused (XStageConfig.fuse_rope), the blocks whose processor is diffusers' `FluxAttnProcessor` run
`NormRopeProcessor`: the same attention, with each of query and key normalised, joined ([text, image]) and rotated
by one kernel pass (ops.norm_rope) where diffusers runs two norms, a concatenation and a rotation. While MLPs are
fused (XStageConfig.fuse_mlp), the single-stream blocks write no concatenation before their output projection
(patches/image/flux_mlp.py). Chroma's plan installs the same (install_flux_blocks).

A ControlNet (FluxControlNetPipeline's, each of a FluxMultiControlNetModel's, Union ones too) is a Flux-like
transformer of its own: its plan splits its image tokens as the transformer's does and leaves the residuals it
returns split; the transformer adds this rank's tokens of them to its own (residuals given whole are split on
entry). An IP-Adapter's attention over the image-prompt tokens (FluxIPAdapterAttnProcessor's second call) is
cross-attention over keys every rank holds whole: each rank attends its own image queries to them."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import FluxControlNetModel, FluxTransformer2DModel
from diffusers.models.transformers import transformer_flux
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...fusions.plain import reads_plain
from ...kernels.rotary_args import JointTokens, NormedTokens
from ...sp.attention import ops, routing
from ...sp.plan import FUSED_ROPE, SPLIT_PROJECTION, JointText, LocalOrWhole, SequenceParallelPlan, model_only
from .. import cfg_rules
from .flux_mlp import split_projection_blocks
from ..processors import ReplacedProcessors, StandInProcessor, rms_norm_eps


def attention_of_both_streams(model: nn.Module) -> list[nn.Module]:
    """The `attn` of every dual-stream and single-stream block (the Flux layout, which FLUX.2 keeps)."""
    return [block.attn for block in (*model.transformer_blocks, *model.single_transformer_blocks)]


def _normed(tokens: torch.Tensor, norm: nn.RMSNorm) -> NormedTokens:
    return NormedTokens(tokens, norm.weight, rms_norm_eps(norm))


def _norm_rope(parts: list[NormedTokens], rotary: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The parts normalised, joined along the tokens and rotated: in one kernel where it takes them, else as
    diffusers' processor does it (norms, concatenation, then the module's `apply_rotary_emb`, which xstage_dit
    routes)."""
    if rotary is not None and ops.norm_rope_kernel_runs(parts, *rotary):
        return ops.norm_rope(parts, *rotary)
    normed = [F.rms_norm(part.tokens, part.weight.shape, part.weight, part.eps) for part in parts]
    joined = normed[0] if len(normed) == 1 else torch.cat(normed, dim=1)
    return joined if rotary is None else transformer_flux.apply_rotary_emb(joined, rotary, sequence_dim=1)


class NormRopeProcessor(StandInProcessor):
    """diffusers' Flux attention with the query and key prologue in one kernel pass each (`_norm_rope`); it calls
    the projections helper and attention through the diffusers module's names, so that whatever routes them
    (xstage_dit) applies. Set only on modules whose q/k norms are RMSNorms with weights."""

    def __call__(self, attn: nn.Module, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None) -> Any:
        if not _norms_plain(attn):
            return transformer_flux.FluxAttnProcessor.__call__(self, attn, hidden_states, encoder_hidden_states,
                                                               attention_mask, image_rotary_emb)
        # diffusers' helper follows fuse_qkv_projections; the text's three are read only where the module has
        # text projections (fused ones return placeholders without them)
        projections = transformer_flux._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query, key, value = (t.unflatten(-1, (-1, attn.head_dim)) for t in projections[:3])
        query_parts, key_parts = [_normed(query, attn.norm_q)], [_normed(key, attn.norm_k)]
        value_parts = [value]
        if attn.added_kv_proj_dim is not None:  # text leads the joint sequence
            text_query, text_key, text_value = (t.unflatten(-1, (-1, attn.head_dim)) for t in projections[3:])
            query_parts.insert(0, _normed(text_query, attn.norm_added_q))
            key_parts.insert(0, _normed(text_key, attn.norm_added_k))
            value_parts.insert(0, text_value)
        hidden_states = None
        if image_rotary_emb is not None:
            # a Ulysses backend that stores q, k, v into the all-to-all applies the norms, concatenation and
            # rotation on the way
            hidden_states = routing.joint_attention(
                JointTokens.normed_and_rotated(query_parts, *image_rotary_emb),
                JointTokens.normed_and_rotated(key_parts, *image_rotary_emb), JointTokens(tuple(value_parts)),
                attention_mask, self._attention_backend)
        if hidden_states is None:
            query, key = _norm_rope(query_parts, image_rotary_emb), _norm_rope(key_parts, image_rotary_emb)
            hidden_states = transformer_flux.dispatch_attention_fn(
                query, key, torch.cat(value_parts, dim=1) if len(value_parts) > 1 else value,
                attn_mask=attention_mask, backend=self._attention_backend, parallel_config=self._parallel_config,
            )
        hidden_states = hidden_states.flatten(2, 3).to(value.dtype)
        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        text, image = hidden_states[:, :text_len], hidden_states[:, text_len:]
        image = attn.to_out[1](attn.to_out[0](image.contiguous()))
        return image, attn.to_add_out(text.contiguous())


def _norm_names(attn: nn.Module) -> list[str]:
    return ["norm_q", "norm_k", *(["norm_added_q", "norm_added_k"] if attn.added_kv_proj_dim is not None else [])]


def _norms_plain(attn: nn.Module) -> bool:
    """Whether the norms' weights may be read this call (fusions/plain.py): one with hooks, say, runs diffusers'
    processor instead."""
    return all(reads_plain(getattr(attn, name), nn.RMSNorm, f"{type(attn).__name__}.{name} in the norm + RoPE pass")
               for name in _norm_names(attn))


def _takes_norm_rope(attn: nn.Module) -> bool:
    norms = [getattr(attn, name) for name in _norm_names(attn)]
    return (type(attn.processor) is transformer_flux.FluxAttnProcessor
            and all(isinstance(norm, nn.RMSNorm) and norm.weight is not None for norm in norms))


def norm_rope_processors(model: nn.Module) -> list[Any]:
    """Every attention module of both streams that runs diffusers' processor with RMSNorm q/k norms runs
    `NormRopeProcessor` (FLUX.1's and Chroma's plans, while RoPE is fused)."""
    return [ReplacedProcessors(attention_of_both_streams(model), _takes_norm_rope, NormRopeProcessor)]


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
                           "encoder_hidden_states": JointText(-2), "txt_ids": JointText(-2),
                           "controlnet_block_samples": LocalOrWhole(-2),
                           "controlnet_single_block_samples": LocalOrWhole(-2)}},
        gather_outputs={"proj_out": -2},
        local_cross_attention=True,
        installs={FUSED_ROPE: model_only(norm_rope_processors), SPLIT_PROJECTION: model_only(split_projection_blocks)},
    ),
    FluxControlNetModel: SequenceParallelPlan(
        family="Flux ControlNet",
        call_site=("diffusers.models.transformers.transformer_flux", routing.DISPATCH),
        rotary_site="diffusers.models.transformers.transformer_flux",
        attention_modules=attention_of_both_streams,
        cfg=None,
        # the prompt stays whole: a Union ControlNet puts its mode's token before it; the control image's tokens
        # are split after their embedding (an image, or tokens, in; tokens out), and the residuals it returns stay
        # this rank's tokens, which the enabled transformer adds to its own
        shard_inputs={"": {"hidden_states": -2, "img_ids": -2}},
        shard_outputs={"controlnet_x_embedder": {0: -2}},
        installs={FUSED_ROPE: model_only(norm_rope_processors), SPLIT_PROJECTION: model_only(split_projection_blocks)},
    ),
}
