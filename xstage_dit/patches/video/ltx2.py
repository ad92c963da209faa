"""LTX-2: a video stream and an audio stream through the same blocks, each with self-attention, prompt
cross-attention and a feed-forward, and cross-attention between the streams (audio-to-video: video queries over
audio keys; video-to-audio: audio queries over video keys).

The video tokens are split on entry with their per-token inputs, and so are the video rotary tables the model
builds (self-attention's and cross-attention's); the video self-attention runs Ulysses. The audio stream, a few
hundred tokens, stays whole on every rank: its own attention and its attention to the prompt run locally, and so
does audio-to-video (each rank's video queries over all audio keys). Video-to-audio attends every video token:
its keys and values are gathered (`gathered_key_modules`). The video output is gathered at `proj_out`.
Spatio-temporal guidance needs nothing more: a perturbed sample's self-attention output is its values, per token."""
from __future__ import annotations

from typing import Any

from diffusers import LTX2VideoTransformer3DModel

from ...cfg.plan import BATCH, CfgPlan
from ...sp.attention import routing
from ...sp.plan import PerToken, SequenceParallelPlan


def _check_inputs(arguments: dict[str, Any]) -> None:
    if arguments.get("video_self_attention_mask") is not None:
        raise NotImplementedError("xstage_dit: LTX-2 with a video self-attention mask (IC-LoRA) is not supported yet")


PLANS = {
    LTX2VideoTransformer3DModel: SequenceParallelPlan(
        family="LTX-2",
        call_site=("diffusers.models.transformers.transformer_ltx2", routing.DISPATCH),
        attention_modules=lambda model: [block.attn1 for block in model.transformer_blocks],
        gathered_key_modules=lambda model: [block.video_to_audio_attn for block in model.transformer_blocks],
        # its pipelines batch the branches (both streams' outputs come back gathered); their spatio-temporal and
        # modality guidance calls carry the positive samples only, split where there are several
        cfg=CfgPlan(BATCH, batch_inputs={
            "hidden_states": 0, "audio_hidden_states": 0, "encoder_hidden_states": 0,
            "audio_encoder_hidden_states": 0, "timestep": 0, "audio_timestep": 0, "sigma": 0, "audio_sigma": 0,
            "encoder_attention_mask": 0, "audio_encoder_attention_mask": 0, "video_coords": 0, "audio_coords": 0,
            "perturbation_mask": 0, "video_keyframes_mask": 0}),
        shard_inputs={"": {"hidden_states": 1, "timestep": PerToken(1), "video_keyframes_mask": PerToken(1)}},
        shard_outputs={"rope": {0: 1, 1: 1}, "cross_attn_rope": {0: 1, 1: 1}},
        gather_outputs={"proj_out": 1},
        check_inputs=_check_inputs,
    )
}
