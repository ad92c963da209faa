"""HunyuanVideo: joint [video, text] attention (text last) in dual- and single-stream blocks, a text padding
mask, and a token refiner that attends over text only (left alone: it is not routed).

Video tokens are split at the patch embedding's output together with the rotary table (video tokens only);
the model builds its attention mask from the local token count, so the text mask lines up by itself."""
from __future__ import annotations

from diffusers import HunyuanVideoTransformer3DModel
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...sp.attention import routing
from ...sp.plan import SequenceParallelPlan
from .. import cfg_rules
from ..image.flux import attention_of_both_streams


def _check_model(model: nn.Module) -> None:
    if model.config.image_condition_type == "token_replace":
        raise NotImplementedError("xstage_dit: HunyuanVideo image-to-video with token_replace is not supported yet")


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
        check_model=_check_model,
    )
}
