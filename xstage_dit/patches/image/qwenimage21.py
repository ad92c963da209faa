"""Qwen-Image 2.1: one block-causal stream, [prefix, target image]. The prefix (the prompt, with condition-image
blocks placed between its tokens) is causal and each image block bidirectional; the target image's tokens
attend to every token. Under `causal_condition` the pipeline prefills the prefix's keys and values once (a KV
cache) and later steps compute only the target's tokens.

The model assembles the joint sequence and its per-token tables whole; the target's tokens are split at the
first block and each block's per-token inputs with them (rotary table, modulation mask, key-padding mask), the
prefix's entries kept whole on every rank, and the output projection's target rows are gathered. Each rank holds
the whole prefix: its rows attend only to prefix keys, so the processor's per-segment calls for them run as in
one process (the attention declines calls within the prefix); the target's call, over the prefix's keys and the
target's, runs Ulysses with the prefix as keys-only text. The KV cache holds the whole prefix on every rank.
The flex-attention processor (one BlockMask over the whole sequence) is refused."""
from __future__ import annotations

import math
from typing import Any

from diffusers import QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21AttnProcessor
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...hooks.module_forward import forward_signature
from ...sp.attention import routing
from ...sp.plan import FAMILY_CHANGES, PlanContext, SequenceParallelPlan, TextAndImage
from ...sp.sharding import SequenceShard
from .. import cfg_rules

# latent tokens per image slot of the vision-language sequence (a 2x2 group)
_TOKENS_PER_SLOT = 4


def _check_model(model: nn.Module) -> None:
    processors = {type(block.attn.processor).__name__ for block in model.transformer_blocks}
    if processors != {QwenImage21AttnProcessor.__name__}:
        raise NotImplementedError(
            f"xstage_dit: Qwen-Image 2.1 runs with its QwenImage21AttnProcessor (the per-segment prefill); this model "
            f"has {sorted(processors)} (the flex processor's BlockMask spans the whole sequence)")


class _PrefixAndTarget:
    """A forward pre-hook that tells the split, from the call's arguments alone (no host sync), how many target
    tokens there are (`seq_len`: the last image block of `img_shapes`) and how long the prefix is."""

    def __init__(self, model: nn.Module, shard: SequenceShard) -> None:
        self.shard = shard
        self._signature = forward_signature(model)
        self._handle = model.register_forward_pre_hook(self._measure, with_kwargs=True)

    def remove(self) -> None:
        self._handle.remove()

    def _measure(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.shard.degree > 1:  # a processor set after enable (at degree 1 diffusers attends with any)
            _check_model(model)
        arguments = self._signature.bind_partial(*args, **kwargs).arguments
        if len({tuple(map(tuple, shapes)) for shapes in arguments["img_shapes"]}) > 1:
            raise ValueError("xstage_dit: Qwen-Image 2.1's samples must share one image layout (as its model reads "
                             "the first sample's)")
        shapes, img_mask = arguments["img_shapes"][0], arguments["img_mask"]
        image_tokens = sum(math.prod(shape) for shape in shapes)
        # every image slot of the vision-language sequence stands for a 2x2 group of latent tokens
        joint_len = img_mask.shape[1] + image_tokens - image_tokens // _TOKENS_PER_SLOT
        self.shard.seq_len = math.prod(shapes[-1])
        self.shard.whole_prefix_len = joint_len - self.shard.seq_len


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    return [_PrefixAndTarget(model, context.shard)]


# the per-token inputs every block takes over the joint sequence (the prefix's entries first)
_PER_TOKEN = {"rotary_emb": TextAndImage(0), "target_token_mask": TextAndImage(0), "key_valid": TextAndImage(1),
              "attention_mask": TextAndImage(3)}

PLANS = {
    QwenImage21Transformer2DModel: SequenceParallelPlan(
        family="Qwen-Image 2.1",
        call_site=("diffusers.models.transformers.transformer_qwenimage21", routing.DISPATCH),
        attention_modules=lambda model: [block.attn for block in model.transformer_blocks],
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.prefixed_token_output_shape,
                    pipeline_uses_cfg=cfg_rules.true_cfg),
        shard_inputs={"transformer_blocks.0": {"hidden_states": TextAndImage(1)}, "transformer_blocks.*": _PER_TOKEN,
                      "norm_out": {"target_token_mask": TextAndImage(0)}},
        gather_outputs={"proj_out": TextAndImage(1)},
        check_model=_check_model,
        installs={FAMILY_CHANGES: _install},
    )
}
