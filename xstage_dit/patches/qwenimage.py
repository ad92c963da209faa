"""QwenImage: joint [text, image] attention (text first) with a text padding mask.

Packed image tokens are split on entry with the image rotary table (complex, image rows only); the text rotary
table and the text tokens stay whole. The model builds its mask from the local token count. Edit models with
`zero_cond_t` (Edit-2511) pick each image token's modulation by `modulate_index`, which every block gets and
which is split with the tokens there."""
from __future__ import annotations

from typing import Any

from diffusers import QwenImageTransformer2DModel

from ..cfg_plan import PAIRS, CfgPlan
from ..sp import routing
from ..sp.plan import PerToken, SequenceParallelPlan
from . import cfg_rules


def _check_inputs(arguments: dict[str, Any]) -> None:
    if arguments.get("controlnet_block_samples") is not None:
        raise NotImplementedError("xstage_dit: QwenImage with ControlNet residuals is not supported yet")


PLANS = {
    QwenImageTransformer2DModel: SequenceParallelPlan(
        family="QwenImage",
        call_site=("diffusers.models.transformers.transformer_qwenimage", routing.DISPATCH),
        attention_modules=lambda model: [block.attn for block in model.transformer_blocks],
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.token_output_shape, pipeline_uses_cfg=cfg_rules.true_cfg),
        shard_inputs={"": {"hidden_states": 1}, "transformer_blocks.*": {"modulate_index": PerToken(1)}},
        shard_outputs={"pos_embed": {0: 0}},
        gather_outputs={"proj_out": 1},
        check_inputs=_check_inputs,
    )
}
