"""FLUX.2 (Flux2Pipeline, Flux2KleinPipeline, Flux2KleinKVPipeline): joint [text, image] attention in dual- and
single-stream blocks, with position ids for text and image tokens alike.

Image tokens (reference images' tokens included, which the pipelines append to them) and `img_ids` are split on
entry, and the prompt and `txt_ids` too where the sequence allows (`JointText`: the model drops its text at the
end and masks none of it); otherwise the prompt stays whole on every rank. The rotary tables the model builds from
the local ids follow each local token.

The reference images' KV cache (`kv_cache_mode`, Flux2KleinKVPipeline): the call that extracts it puts the
reference tokens before the image tokens; they stay whole on every rank (they attend only to themselves, which
every rank computes whole), so each rank caches their keys and values whole, as one process does. Text and
image queries attend to them through `attention_with_whole_keys` (diffusers' `_flux2_kv_causal_attention`
rebound): the split tokens' keys exchanged as usual, the reference keys of each rank's heads attended where they
are, in the extracting call and in every call that reads the cache."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from diffusers import Flux2Transformer2DModel
from diffusers.models import attention_dispatch
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...hooks.module_forward import ReboundName
from ...sp.attention import routing
from ...sp.attention.layout import WholeKeys
from ...sp.plan import FAMILY_CHANGES, JointText, PlanContext, SequenceParallelPlan, TextAndImage
from ...sp.sharding import SequenceShard
from .. import cfg_rules
from .flux import attention_of_both_streams

_MODULE = "diffusers.models.transformers.transformer_flux2"


class _ReferenceTokens:
    """A forward pre-hook that tells the split, from the call's arguments alone, how many image tokens follow the
    reference tokens that lead them in a call extracting their KV cache (those stay whole on every rank)."""

    def __init__(self, model: nn.Module, shard: SequenceShard) -> None:
        self.shard = shard
        self._signature = inspect.signature(model.forward)
        self._handle = model.register_forward_pre_hook(self._measure, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    def _measure(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        arguments = self._signature.bind_partial(*args, **kwargs).arguments
        extracting = arguments.get("kv_cache_mode") == "extract"
        reference = arguments.get("num_ref_tokens", 0) if extracting else 0
        self.shard.seq_len = arguments["hidden_states"].shape[1] - reference


def _kv_causal_attention(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """diffusers' attention of the KV-cache processors, [text, reference, image] tokens, for split image tokens:
    text and image queries over their keys and the reference's whole keys (`attention_with_whole_keys`), the
    reference's own queries over the reference alone (diffusers' dispatch, unrouted: every rank computes it
    whole)."""

    @functools.wraps(original)
    def _flux2_kv_causal_attention(query, key, value, num_txt_tokens, num_ref_tokens, kv_cache=None, backend=None):
        if kv_cache is not None:  # [text, image] queries and keys, the reference's from the cache
            out = routing.attention_with_whole_keys(query, key, value, WholeKeys(*kv_cache.get()))
            return original(query, key, value, num_txt_tokens, num_ref_tokens, kv_cache, backend) if out is None \
                else out
        if not num_ref_tokens:
            return original(query, key, value, num_txt_tokens, num_ref_tokens, kv_cache, backend)
        sizes = [num_txt_tokens, num_ref_tokens, query.shape[1] - num_txt_tokens - num_ref_tokens]
        (q_txt, q_ref, q_img), (k_txt, k_ref, k_img), (v_txt, v_ref, v_img) = (t.split(sizes, dim=1)
                                                                               for t in (query, key, value))
        out = routing.attention_with_whole_keys(torch.cat([q_txt, q_img], dim=1), torch.cat([k_txt, k_img], dim=1),
                                                torch.cat([v_txt, v_img], dim=1), WholeKeys(k_ref, v_ref))
        if out is None:
            return original(query, key, value, num_txt_tokens, num_ref_tokens, kv_cache, backend)
        reference = attention_dispatch.dispatch_attention_fn(q_ref, k_ref, v_ref, backend=backend)
        return torch.cat([out[:, :num_txt_tokens], reference, out[:, num_txt_tokens:]], dim=1)

    return _flux2_kv_causal_attention


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    return [_ReferenceTokens(model, context.shard), ReboundName(_MODULE, "_flux2_kv_causal_attention",
                                                                _kv_causal_attention)]


PLANS = {
    Flux2Transformer2DModel: SequenceParallelPlan(
        family="FLUX.2",
        call_site=(_MODULE, routing.DISPATCH),
        rotary_site=_MODULE,
        attention_modules=attention_of_both_streams,
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.token_output_shape,
                    pipeline_uses_cfg=cfg_rules.guidance_above_one_unless_distilled),
        # ids are (S, 4) or (B, S, 4): the sequence is the second-to-last dim either way; the reference tokens of
        # a call extracting their KV cache lead the image tokens, whole
        shard_inputs={"": {"hidden_states": TextAndImage(1), "img_ids": TextAndImage(-2),
                           "encoder_hidden_states": JointText(1), "txt_ids": JointText(-2)}},
        gather_outputs={"proj_out": 1},
        installs={FAMILY_CHANGES: _install},
    )
}
