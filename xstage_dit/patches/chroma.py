"""Chroma: FLUX.1's dual- and single-stream blocks (its processor is Flux's), modulation from an approximator, and
a prompt padding mask that every block turns into an additive (queries x keys) outer product of the joint
[text, image] mask: 1 added to the logits of valid pairs, 0 wherever a padding token is the query or the key.

Image tokens and their ids are split on entry, and so is the image part of the joint mask; the text stays whole
(its padding is masked, not dropped). The padding tokens' own rows are not masked, and other tokens read them
(as keys, without the bonus): attention rebuilds the pair bias over the gathered tokens
(`QueryKeyMasks.PAIR_BIAS`), which only the reference backend attends with."""
from __future__ import annotations

from diffusers import ChromaTransformer2DModel

from ..cfg_plan import PAIRS, CfgPlan
from ..sp import routing
from ..sp.masks import QueryKeyMasks
from ..sp.plan import JointTokens, SequenceParallelPlan
from . import cfg_rules
from .flux import attention_of_both_streams, install_flux_blocks, refuse_controlnet_and_ip_adapter

_FLUX = "diffusers.models.transformers.transformer_flux"  # Chroma's blocks run Flux's processor


PLANS = {
    ChromaTransformer2DModel: SequenceParallelPlan(
        family="Chroma",
        call_site=(_FLUX, routing.DISPATCH),
        rotary_site=_FLUX,
        attention_modules=attention_of_both_streams,
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.token_output_shape, pipeline_uses_cfg=cfg_rules.guidance_above_one),
        shard_inputs={"": {"hidden_states": -2, "img_ids": -2, "attention_mask": JointTokens(-1)}},
        gather_outputs={"proj_out": -2},
        check_inputs=refuse_controlnet_and_ip_adapter("Chroma"),
        query_key_masks=QueryKeyMasks.PAIR_BIAS,
        install=install_flux_blocks,
    )
}
