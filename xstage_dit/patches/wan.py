"""Wan 2.1 / 2.2: self-attention over video tokens, cross-attention to text.

Video tokens are split after patch embedding (entry of the first block) together with the rotary table;
cross-attention then runs locally on each rank's token shard, since every rank holds all text tokens. Wan 2.2
TI2V's per-token timesteps are split with the tokens on entry, so its per-token modulation (every block's and
the output norm's) comes out split too. Wan VACE runs its control blocks first, on the video tokens and the
control video's tokens (padded to the same length): both are split at the first control block, and each block's
hint, computed per token, is added to the split tokens of its main block."""
from __future__ import annotations

from diffusers import WanTransformer3DModel, WanVACETransformer3DModel

from ..cfg_plan import PAIRS, CfgPlan
from ..sp import routing
from ..sp.plan import PerToken, SequenceParallelPlan
from . import cfg_rules

_CFG = CfgPlan(PAIRS, output_shape=cfg_rules.video_output_shape, pipeline_uses_cfg=cfg_rules.guidance_above_one)

PLANS = {
    WanTransformer3DModel: SequenceParallelPlan(
        family="Wan",
        call_site=("diffusers.models.transformers.transformer_wan", routing.DISPATCH),
        attention_modules=lambda model: [block.attn1 for block in model.blocks],
        cfg=_CFG,
        shard_inputs={"": {"timestep": PerToken(1)}, "blocks.0": {"hidden_states": 1}},
        shard_outputs={"rope": {0: 1, 1: 1}},
        gather_outputs={"proj_out": 1},
    ),
    WanVACETransformer3DModel: SequenceParallelPlan(
        family="Wan VACE",
        call_site=("diffusers.models.transformers.transformer_wan", routing.DISPATCH),
        attention_modules=lambda model: [block.attn1 for block in (*model.vace_blocks, *model.blocks)],
        cfg=_CFG,
        shard_inputs={"vace_blocks.0": {"hidden_states": 1, "control_hidden_states": 1},
                      "blocks.0": {"hidden_states": 1}},
        shard_outputs={"rope": {0: 1, 1: 1}},
        gather_outputs={"proj_out": 1},
    ),
}
