"""HiDream-I1: joint [image, text] attention (text last) in double- and single-stream blocks, with llama
hidden states appended per block, and a mixture-of-experts feed-forward. Processors call
F.scaled_dot_product_attention directly.

The model patchifies its latents inside forward; we do that first (same function), so that image tokens,
their position ids and HiDream's own padding mask are split on entry like Flux's, and `img_sizes` become
Python ints (no host sync in unpatchify). The MoE runs sync-free and grouped (xstage_dit.sp.moe.token_choice), each
token's contributions summed in expert order (the same bits every call), with every expert on every rank or, with
`expert_parallel=True`, E/N per rank, the token copies travelling over collectives (an all-gather of the group's
tokens, a reduce-scatter of their sums)."""
from __future__ import annotations

from typing import Any

import torch
from diffusers import HiDreamImageTransformer2DModel
from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU
from torch import nn

from ...cfg.plan import BATCH, CfgPlan
from ...fusions.plain import say_fallback
from ...logging_utils import warn_once
from ...hooks.module_forward import forward_signature
from ...sp.moe.choice import gather_tokens, reduce_tokens
from ...sp.moe.token_choice import GroupedSwiGLUExperts, dispatch, why_not_stackable
from ...sp.attention import routing
from ...sp.plan import FAMILY_CHANGES, MOE_EXPERTS, PlanContext, SequenceParallelPlan


class _PatchifyFirst:
    """A forward pre-hook that hands the model already-patchified inputs, as its forward accepts them."""

    def __init__(self, model: nn.Module) -> None:
        self._signature = forward_signature(model)
        self._handle = model.register_forward_pre_hook(self._patchify, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    def _patchify(self, model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        arguments = dict(self._signature.bind_partial(*args, **kwargs).arguments)
        latents = arguments["hidden_states"]
        if latents.dim() == 4 and arguments.get("hidden_states_masks") is None:
            patch = model.config.patch_size
            tokens, masks, _, img_ids = model.patchify(latents)
            if masks is None:  # square images carry no padding
                masks = torch.ones(tokens.shape[:2], dtype=tokens.dtype, device=tokens.device)
            sizes = [(latents.shape[-2] // patch, latents.shape[-1] // patch)] * latents.shape[0]
            arguments.update(hidden_states=tokens, img_ids=img_ids, hidden_states_masks=masks, img_sizes=sizes)
        return (), arguments


_SHARDED_ADAPTERS = ("expert_parallel=True cannot run (each rank holds only its own experts' weights): merge and "
                     "unload the adapter before enable (pipe.fuse_lora(); pipe.unload_lora_weights()), or enable "
                     "with expert_parallel=False")


class _GroupedMoE:
    """Replaces one MoE layer's `moe_infer` (a Python loop sized by `.cpu()` counts) with the grouped one; with
    the experts sharded, this rank holds E/N experts, computes their share of the group's gathered tokens, and the
    ranks sum each token's contributions in one reduce-scatter."""

    def __init__(self, layer: MOEFeedForwardSwiGLU, context: PlanContext) -> None:
        self.layer = layer
        shard = context.shard
        held = None
        if context.experts.sharded:
            share = len(layer.experts) // shard.degree
            held = slice(shard.rank * share, (shard.rank + 1) * share)
        self.experts = experts = GroupedSwiGLUExperts(layer.experts, held)
        top_k = layer.num_activated_experts

        def moe_infer(x: torch.Tensor, expert_index: torch.Tensor, expert_weight: torch.Tensor) -> torch.Tensor:
            why = experts.why_not_plain()
            if why is not None:
                if held is not None:
                    raise NotImplementedError(f"xstage_dit: HiDream's {why}, which {_SHARDED_ADAPTERS}")
                say_fallback(f"HiDream's grouped MoE: {why}")
                return type(layer).moe_infer(layer, x, expert_index, expert_weight)
            if held is None:
                return experts(x, dispatch(expert_index, expert_weight.view(-1), top_k, experts.num_experts))
            tokens = gather_tokens(x.unsqueeze(0), shard)
            index = gather_tokens(expert_index.view(1, -1, top_k), shard).view(-1)
            weight = gather_tokens(expert_weight.view(1, -1, top_k), shard).view(-1)
            partial = experts(tokens, dispatch(index, weight, top_k, experts.num_experts, held))
            return reduce_tokens(partial, shard, batch=1).view_as(x)

        layer.moe_infer = moe_infer

    def remove(self) -> None:
        del self.layer.moe_infer
        self.experts.restore()


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    return [_PatchifyFirst(model)]


def _moe_layers(model: nn.Module) -> dict[str, MOEFeedForwardSwiGLU]:
    return {name: layer for name, layer in model.named_modules() if isinstance(layer, MOEFeedForwardSwiGLU)}


def _quantized_experts(layers: dict[str, MOEFeedForwardSwiGLU]) -> dict[str, str]:
    """MoE layer name -> why its experts cannot be stacked (a quantized weight), for the layers that hold such."""
    return {name: why for name, why in ((name, why_not_stackable(layer.experts)) for name, layer in layers.items())
            if why is not None}


def _unshardable_experts(model: nn.Module) -> str | None:
    quantized = _quantized_experts(_moe_layers(model))
    if not quantized:
        return None
    name, why = next(iter(quantized.items()))
    return (f"HiDream's {name}: its {why}; enable with expert_parallel=False (quantized experts run diffusers' "
            f"code)")


def _experts(model: nn.Module, context: PlanContext) -> list[Any]:
    """The grouped MoE on each layer whose experts' weights can be stacked; layers with quantized experts run
    diffusers' code (said once; sharding them is refused before any collective: `_unshardable_experts`)."""
    layers = _moe_layers(model)
    quantized = _quantized_experts(layers)
    if quantized:
        name, why = next(iter(quantized.items()))
        warn_once(f"xstage_dit: HiDream's grouped MoE: {len(quantized)} of {len(layers)} MoE layers hold quantized "
                  f"experts ({name}'s {why}): those layers run diffusers' code")
    return [_GroupedMoE(layer, context) for name, layer in layers.items() if name not in quantized]


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [block.block.attn1 for block in (*model.double_stream_blocks, *model.single_stream_blocks)]


PLANS = {
    HiDreamImageTransformer2DModel: SequenceParallelPlan(
        family="HiDream",
        call_site=("diffusers.models.transformers.transformer_hidream_image", routing.SDPA),
        attention_modules=_attention_modules,
        cfg=CfgPlan(BATCH, batch_inputs={
            "hidden_states": 0, "timesteps": 0, "encoder_hidden_states_t5": 0, "encoder_hidden_states_llama3": 1,
            "pooled_embeds": 0, "img_ids": 0, "img_sizes": 0, "hidden_states_masks": 0}),
        shard_inputs={"": {"hidden_states": 1, "img_ids": 1, "hidden_states_masks": 1}},
        gather_outputs={"final_layer": 1},
        text_first=False,
        installs={FAMILY_CHANGES: _install, MOE_EXPERTS: _experts},
        num_experts=lambda model: model.config.num_routed_experts,
        unshardable_experts=_unshardable_experts,
    )
}
