"""FLUX.2 (Flux2Pipeline, Flux2KleinPipeline): joint [text, image] attention in dual- and single-stream blocks,
with position ids for text and image tokens alike.

Image tokens (reference images' tokens included, which the pipelines append to them) and `img_ids` are split on
entry, and the prompt and `txt_ids` too where the sequence allows (`JointText`: the model drops its text at the
end and masks none of it); otherwise the prompt stays whole on every rank. The rotary tables the model builds from
the local ids follow each local token. The reference images' KV cache (`kv_cache_mode`) is refused."""
from __future__ import annotations

from typing import Any

from diffusers import Flux2Transformer2DModel

from ...cfg.plan import PAIRS, CfgPlan
from ...sp.attention import routing
from ...sp.plan import JointText, SequenceParallelPlan
from .. import cfg_rules
from .flux import attention_of_both_streams


def _check_inputs(arguments: dict[str, Any]) -> None:
    if arguments.get("kv_cache_mode") is not None:
        raise NotImplementedError("xstage_dit: FLUX.2 with the reference images' KV cache (kv_cache_mode) is not "
                                  "supported yet; pass the reference images without it")


PLANS = {
    Flux2Transformer2DModel: SequenceParallelPlan(
        family="FLUX.2",
        call_site=("diffusers.models.transformers.transformer_flux2", routing.DISPATCH),
        rotary_site="diffusers.models.transformers.transformer_flux2",
        attention_modules=attention_of_both_streams,
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.token_output_shape,
                    pipeline_uses_cfg=cfg_rules.guidance_above_one_unless_distilled),
        # ids are (S, 4) or (B, S, 4): the sequence is the second-to-last dim either way
        shard_inputs={"": {"hidden_states": 1, "img_ids": -2,
                           "encoder_hidden_states": JointText(1), "txt_ids": JointText(-2)}},
        gather_outputs={"proj_out": 1},
        check_inputs=_check_inputs,
    )
}
