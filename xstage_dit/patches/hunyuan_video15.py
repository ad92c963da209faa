"""HunyuanVideo 1.5: joint [video, text] attention (text last) in dual-stream blocks; its text stream holds the
image-conditioning tokens, the ByT5 tokens and the prompt tokens, valid ones first, and a padding mask.

Video tokens are split at the patch embedding's output together with the rotary table (video tokens only). Its
processor turns the padding mask into a (queries x keys) mask, the outer product of the key-padding mask, whose
first query is a video token and never masked: attention takes that row (`QueryKeyMasks.FIRST_ROW`). The rows of
masked (padding) text queries then differ from the model's, and no other token reads them: padding keys stay masked."""
from __future__ import annotations

from diffusers import HunyuanVideo15Transformer3DModel

from ..cfg_plan import PAIRS, CfgPlan
from ..sp import routing
from ..sp.masks import QueryKeyMasks
from ..sp.plan import SequenceParallelPlan
from . import cfg_rules

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
    )
}
