"""HunyuanVideo: joint [video, text] attention (text last) in dual- and single-stream blocks, a text padding
mask, and a token refiner that attends over text only (left alone: it is not routed).

Video tokens are split at the patch embedding's output together with the rotary table (video tokens only);
the model builds its attention mask from the local token count, so the text mask lines up by itself.

Image-to-video with `token_replace` modulates the first frame's tokens apart from the others: its blocks take
the count of them at the front of the sequence (`num_tokens`), which becomes the count at the front of this
rank's chunk (the whole first frame on the first ranks, part of it on one, none after)."""
from __future__ import annotations

from typing import Any, Callable

from diffusers import HunyuanVideoTransformer3DModel
from diffusers.models.transformers import transformer_hunyuan_video
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...hooks.module_forward import forward_signature
from ...sp.attention import routing
from ...sp.plan import PlanContext, SequenceParallelPlan
from ...sp.sharding import SequenceShard
from .. import cfg_rules
from ..image.flux import attention_of_both_streams

_TOKEN_REPLACE_BLOCKS = (transformer_hunyuan_video.HunyuanVideoTokenReplaceTransformerBlock,
                         transformer_hunyuan_video.HunyuanVideoTokenReplaceSingleTransformerBlock)


class _LocalFirstFrame:
    """Every token-replace block's `num_tokens` (the first frame's tokens, counted over the whole sequence)
    replaced on entry by the number of them this rank holds, until `remove`."""

    def __init__(self, model: nn.Module, shard: SequenceShard) -> None:
        blocks = [block for block in model.modules() if isinstance(block, _TOKEN_REPLACE_BLOCKS)]
        self._hooks = [block.register_forward_pre_hook(self._localiser(block, shard), with_kwargs=True)
                       for block in blocks]

    @staticmethod
    def _localiser(block: nn.Module, shard: SequenceShard) -> Callable[[nn.Module, tuple, dict], tuple]:
        position = list(forward_signature(block).parameters).index("num_tokens")

        def localise(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if kwargs.get("num_tokens") is not None:
                kwargs["num_tokens"] = shard.local_prefix_len(kwargs["num_tokens"])
            elif position < len(args) and args[position] is not None:
                args = (*args[:position], shard.local_prefix_len(args[position]), *args[position + 1:])
            return args, kwargs

        return localise

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    return [_LocalFirstFrame(model, context.shard)] if context.shard.degree > 1 else []


PLANS = {
    HunyuanVideoTransformer3DModel: SequenceParallelPlan(
        family="HunyuanVideo",
        call_site=("diffusers.models.transformers.transformer_hunyuan_video", routing.DISPATCH),
        # its processor imports apply_rotary_emb from embeddings inside the call
        rotary_site="diffusers.models.embeddings",
        attention_modules=attention_of_both_streams,
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.video_output_shape,
                    pipeline_uses_cfg=cfg_rules.true_cfg_with_pooled_negatives),
        shard_outputs={"x_embedder": {0: 1}, "rope": {0: 0, 1: 0}},
        gather_outputs={"proj_out": 1},
        text_first=False,
        install=_install,
    )
}
