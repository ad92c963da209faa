"""Wan 2.1 / 2.2: self-attention over video tokens, cross-attention to text.

Video tokens are split after patch embedding (entry of the first block) together with the rotary table;
cross-attention then runs locally on each rank's token shard, since every rank holds all text tokens."""
from __future__ import annotations

from typing import Any

from diffusers import WanTransformer3DModel

from ..cfg_plan import PAIRS, CfgPlan
from ..sp import routing
from ..sp.plan import SequenceParallelPlan
from . import cfg_rules


def _check_inputs(arguments: dict[str, Any]) -> None:
    timestep = arguments.get("timestep")
    if timestep is not None and timestep.ndim == 2:
        raise NotImplementedError("xstage_dit: Wan 2.2 TI2V per-token timesteps are not supported yet")


PLANS = {
    WanTransformer3DModel: SequenceParallelPlan(
        family="Wan",
        call_site=("diffusers.models.transformers.transformer_wan", routing.DISPATCH),
        attention_modules=lambda model: [block.attn1 for block in model.blocks],
        cfg=CfgPlan(
            PAIRS,
            output_shape=cfg_rules.video_output_shape,
            pipeline_uses_cfg=cfg_rules.guidance_above_one,
        ),
        shard_inputs={"blocks.0": {"hidden_states": 1}},
        shard_outputs={"rope": {0: 1, 1: 1}},
        gather_outputs={"proj_out": 1},
        check_inputs=_check_inputs,
    )
}
