"""HunyuanVideo: joint [video, text] attention (text last) in dual- and single-stream blocks, a text padding
mask, and a token refiner that attends over text only (left alone: it is not routed).

Video tokens are split at the patch embedding's output together with the rotary table (video tokens only);
the model builds its attention mask from the local token count, so the text mask lines up by itself.

Image-to-video with `token_replace` modulates the first frame's tokens apart from the others: its blocks take
the count of them at the front of the sequence (`num_tokens`), which becomes the count at the front of this
rank's chunk (the whole first frame on the first ranks, part of it on one, none after)."""
from __future__ import annotations

from typing import Any

from diffusers import HunyuanVideoTransformer3DModel
from diffusers.models.transformers import transformer_hunyuan_video
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...sp.attention import routing
from ...sp.plan import FAMILY_CHANGES, PlanContext, PrefixCount, SequenceParallelPlan, split_inputs
from .. import cfg_rules
from ..image.flux import attention_of_both_streams

_TOKEN_REPLACE_BLOCKS = (transformer_hunyuan_video.HunyuanVideoTokenReplaceTransformerBlock,
                         transformer_hunyuan_video.HunyuanVideoTokenReplaceSingleTransformerBlock)


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    """Every token-replace block's `num_tokens` made the count of first-frame tokens this rank holds."""
    if context.shard.degree == 1:
        return []
    return [split_inputs(block, context.shard, {"num_tokens": PrefixCount()})
            for block in model.modules() if isinstance(block, _TOKEN_REPLACE_BLOCKS)]


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
        installs={FAMILY_CHANGES: _install},
    )
}
