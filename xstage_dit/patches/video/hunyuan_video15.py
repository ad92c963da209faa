"""HunyuanVideo 1.5: joint [video, text] attention (text last) in dual-stream blocks; its text stream holds the
image-conditioning tokens, the ByT5 tokens and the prompt tokens, valid ones first, and a padding mask.

Video tokens are split at the patch embedding's output together with the rotary table (video tokens only).
diffusers' processor turns the padding mask into a (queries x keys) mask, the outer product of the key-padding
mask, materialized per block (S² bytes: gigabytes at 720p, and SDPA's slow masked kernel). While enabled, the
blocks run `KeyPaddingProcessor`, the same attention with the key-padding mask alone. Only the rows of masked
(padding) text queries change, and no other token reads them: padding keys stay masked. A processor set by the user
is kept; attention takes its mask's first row, a video token that is never masked (`QueryKeyMasks.FIRST_ROW`)."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import HunyuanVideo15Transformer3DModel
from diffusers.models import embeddings
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers import transformer_hunyuan_video15
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...sp.attention import routing
from ...sp.attention.masks import QueryKeyMasks
from ...sp.plan import PROCESSORS, SequenceParallelPlan, model_only
from .. import cfg_rules
from ..processors import ReplacedProcessors, StandInProcessor


class KeyPaddingProcessor(StandInProcessor):
    """diffusers' HunyuanVideo 1.5 attention, masked by key padding (B, 1, 1, keys). It calls attention and the
    rotary embedding through their modules' names, so that whatever routes those names (xstage_dit) applies."""

    def __call__(self, attn: Attention, hidden_states: torch.Tensor,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        query, key, value = (attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states))
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        query, key = attn.norm_q(query), attn.norm_k(key)
        if image_rotary_emb is not None:
            query = embeddings.apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = embeddings.apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        text_len = 0
        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            text = [proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                    for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)]
            if attn.norm_added_q is not None:
                text[0] = attn.norm_added_q(text[0])
            if attn.norm_added_k is not None:
                text[1] = attn.norm_added_k(text[1])
            query, key, value = (torch.cat([t, e], dim=1) for t, e in zip((query, key, value), text))
        mask = None
        if attention_mask is not None:  # the text tokens' padding; every video key attends
            mask = F.pad(attention_mask, (key.shape[1] - attention_mask.shape[1], 0), value=True).bool()
            mask = mask[:, None, None, :]
        hidden_states = transformer_hunyuan_video15.dispatch_attention_fn(
            query, key, value, attn_mask=mask, dropout_p=0.0, is_causal=False, backend=self._attention_backend,
            parallel_config=self._parallel_config,
        ).flatten(2, 3).to(query.dtype)
        if not text_len:
            return hidden_states, encoder_hidden_states
        hidden_states, encoder_hidden_states = hidden_states[:, :-text_len], hidden_states[:, -text_len:]
        if getattr(attn, "to_out", None) is not None:
            hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if getattr(attn, "to_add_out", None) is not None:
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def _processors(model: nn.Module) -> list[Any]:
    stock = transformer_hunyuan_video15.HunyuanVideo15AttnProcessor2_0
    return [ReplacedProcessors([block.attn for block in model.transformer_blocks],
                               lambda attn: type(attn.processor) is stock, KeyPaddingProcessor)]


PLANS = {
    HunyuanVideo15Transformer3DModel: SequenceParallelPlan(
        family="HunyuanVideo 1.5",
        call_site=("diffusers.models.transformers.transformer_hunyuan_video15", routing.DISPATCH),
        # its processor imports apply_rotary_emb from embeddings inside the call
        rotary_site="diffusers.models.embeddings",
        attention_modules=lambda model: [block.attn for block in model.transformer_blocks],
        # its pipeline guides through a guider: with classifier-free guidance, two calls a step (cond first)
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.video_output_shape,
                    pipeline_uses_cfg=cfg_rules.guider_guides_every_step),
        shard_outputs={"x_embedder": {0: 1}, "rope": {0: 0, 1: 0}},
        gather_outputs={"proj_out": 1},
        text_first=False,
        query_key_masks=QueryKeyMasks.FIRST_ROW,
        installs={PROCESSORS: model_only(_processors)},
    )
}
