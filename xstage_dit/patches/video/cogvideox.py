"""CogVideoX: shared projections over [text (226), video] with joint attention (text first), rotary tables
(video only) computed by the pipeline and passed in. Processors call F.scaled_dot_product_attention directly.

The text and video streams are split apart by the model before the blocks, so video tokens are split at the
first block's input; the rotary tables are split on entry. CFG is one batched call."""
from __future__ import annotations

from diffusers import CogVideoXTransformer3DModel

from ...cfg.plan import BATCH, CfgPlan
from ...sp.attention import routing
from ...sp.plan import SequenceParallelPlan

PLANS = {
    CogVideoXTransformer3DModel: SequenceParallelPlan(
        family="CogVideoX",
        call_site=("diffusers.models.attention_processor", routing.SDPA),
        # its processor imports apply_rotary_emb from embeddings inside the call
        rotary_site="diffusers.models.embeddings",
        attention_modules=lambda model: [block.attn1 for block in model.transformer_blocks],
        cfg=CfgPlan(BATCH, batch_inputs={"hidden_states": 0, "encoder_hidden_states": 0, "timestep": 0,
                                         "ofs": 0}),
        shard_inputs={"": {"image_rotary_emb": 0}, "transformer_blocks.0": {"hidden_states": 1}},
        gather_outputs={"proj_out": 1},
    )
}
