"""LTX-Video: self-attention over video tokens, cross-attention to (masked) text.

Packed video tokens are split on entry with the rotary table, and per-token timesteps (image-to-video,
Condition: conditioning tokens are less noisy) with them; cross-attention runs locally on each rank's tokens
(its text mask masks keys only, so it holds for any query split). CFG is one batched call."""
from __future__ import annotations

from diffusers import LTXVideoTransformer3DModel

from ...cfg.plan import BATCH, CfgPlan
from ...sp.attention import routing
from ...sp.plan import PerToken, SequenceParallelPlan

PLANS = {
    LTXVideoTransformer3DModel: SequenceParallelPlan(
        family="LTX-Video",
        call_site=("diffusers.models.transformers.transformer_ltx", routing.DISPATCH),
        attention_modules=lambda model: [block.attn1 for block in model.transformer_blocks],
        cfg=CfgPlan(BATCH, batch_inputs={"hidden_states": 0, "encoder_hidden_states": 0, "timestep": 0,
                                         "encoder_attention_mask": 0, "video_coords": 0}),
        shard_inputs={"": {"hidden_states": 1, "timestep": PerToken(1)}},
        shard_outputs={"rope": {0: 1, 1: 1}},
        gather_outputs={"proj_out": 1},
    )
}
