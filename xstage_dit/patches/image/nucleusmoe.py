"""NucleusMoE-Image: single-stream blocks whose image queries attend to [image, text] keys (the text is keys only,
optionally with fewer key/value heads, which the processor repeats before attention), and a mixture of experts
with expert-choice routing.

Image tokens are split on entry with the image rows of the rotary table; the text stays whole on every rank. The
model builds its key mask from the local token count. Each MoE layer runs exact expert choice: every rank takes
the selections one process would make over the whole sequence (sp/moe/choice.py) and runs the routed experts
on the selected tokens it holds, as one grouped matmul per projection, without host synchronisation; or, with
`expert_parallel`, on every selection of the experts it owns (sp/moe/choice.py). The model's rotary tables
and prompt lengths are computed without host-to-device copies, so that its forward can be captured in a CUDA
graph."""
from __future__ import annotations

import collections
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import NucleusMoEImageTransformer2DModel
from diffusers.models.transformers import transformer_nucleusmoe_image
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer
from torch import nn

from ...cfg.plan import PAIRS, CfgPlan
from ...fusions.plain import say_fallback, why_not_plain
from ...sp.attention import routing
from ...sp.moe.layer import ExpertChoiceCall
from ...sp.moe.modes import ExpertModes
from ...sp.moe.ops import expert_choice
from ...sp.plan import FAMILY_CHANGES, MOE_EXPERTS, PlanContext, SequenceParallelPlan
from ...burst_gap.moe_plan import ExpertSchedule
from .. import cfg_rules


class ExactExpertChoice:
    """Replaces one MoE layer's forward with whole-sequence expert choice over the plan's split, in the mode the
    context allows and the planner picks per call (sp/moe/modes.py). Where the experts are sharded, the other
    ranks' expert weights move to the host, so the GPU holds only this rank's; `remove()` gives the layer its
    forward and weights back. `schedule` fixes the stores mode's schedule (default: the planner's). Experts that
    are not a plain module (an adapter's layer, hooks: fusions/plain.py) run diffusers' forward in one process;
    across ranks, whose whole-sequence choice only the grouped path makes, they are refused."""

    def __init__(self, layer: NucleusMoELayer, context: PlanContext, schedule: ExpertSchedule | None = None) -> None:
        self.layer = layer
        self.shard = context.shard
        # a degree that does not divide the experts (refused where they are sharded) runs replicated
        modes = context.experts if layer.num_experts % self.shard.degree == 0 else ExpertModes()
        share = layer.num_experts // self.shard.degree
        own = slice(self.shard.rank * share, (self.shard.rank + 1) * share)
        self.call = ExpertChoiceCall(layer.capacity_factor, layer.route_scale, modes, own, schedule)
        self._whole: dict[str, torch.Tensor] = {}
        if modes.sharded:
            for name in ("gate_up_proj", "down_proj"):
                weight = getattr(layer.experts, name)
                self._whole[name] = weight.data.to("cpu")
                weight.data = weight.data[own].clone()
        layer.forward = self.forward

    def remove(self) -> None:
        del self.layer.forward
        for name, whole in self._whole.items():
            weight = getattr(self.layer.experts, name)
            weight.data = whole.to(weight.device)

    def forward(self, hidden_states: torch.Tensor, hidden_states_unmodulated: torch.Tensor,
                timestep: torch.Tensor | None = None) -> torch.Tensor:
        layer, shard = self.layer, self.shard
        why = why_not_plain(layer.experts, transformer_nucleusmoe_image.SwiGLUExperts)
        if why is not None:
            if shard.degree > 1:
                raise NotImplementedError(f"xstage_dit: NucleusMoE-Image's routed-experts module {why}, which its "
                                          "expert choice across ranks cannot run: merge and unload the adapter "
                                          "before enable")
            say_fallback(f"NucleusMoE-Image's expert choice: its routed-experts module {why}")
            return type(layer).forward(layer, hidden_states, hidden_states_unmodulated, timestep)
        local_len = hidden_states.shape[1]
        router_input = hidden_states_unmodulated
        if timestep is not None:
            router_input = torch.cat([timestep.unsqueeze(1).expand(-1, local_len, -1), router_input], dim=-1)
        logits = layer.gate(router_input)
        activation = torch.sigmoid if layer.use_sigmoid else lambda x: F.softmax(x, dim=-1)
        scores = activation(logits.float()).to(logits.dtype)
        return expert_choice(hidden_states, layer.shared_expert(hidden_states), scores, layer.experts.gate_up_proj,
                             layer.experts.down_proj, self.call, shard)


class _TablesOnTheDevice:
    """The rotary tables of each (image shapes, text length, device) computed once and kept: diffusers rebuilds
    them every forward from host tables and host scalars, copies that a CUDA graph cannot hold. A forward that
    torch.compile traces runs diffusers' code: a graph reading the kept tables would guard on which are kept, and
    be compiled anew each time one is added."""

    def __init__(self, pos_embed: nn.Module) -> None:
        self.pos_embed = pos_embed
        self._tables: collections.OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        pos_embed.forward = self.forward

    def remove(self) -> None:
        del self.pos_embed.forward

    def forward(self, video_fhw: Any, device: torch.device | None = None,
                max_txt_seq_len: int | torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return type(self.pos_embed).forward(self.pos_embed, video_fhw, device, max_txt_seq_len)
        key = (repr(video_fhw), str(device), int(max_txt_seq_len) if max_txt_seq_len is not None else None)
        if key not in self._tables:
            self._tables[key] = type(self.pos_embed).forward(self.pos_embed, video_fhw, device, max_txt_seq_len)
            if len(self._tables) > _KEPT_TABLES:
                self._tables.popitem(last=False)
        self._tables.move_to_end(key)
        return self._tables[key]


_KEPT_TABLES = 8


def _text_lengths(encoder_hidden_states: torch.Tensor, encoder_hidden_states_mask: torch.Tensor | None):
    """diffusers' `_compute_text_seq_len_from_mask` without its host-to-device copy of a scalar."""
    batch_size, text_seq_len = encoder_hidden_states.shape[:2]
    if encoder_hidden_states_mask is None:
        return text_seq_len, None, None
    if encoder_hidden_states_mask.shape[:2] != (batch_size, text_seq_len):
        raise ValueError(f"`encoder_hidden_states_mask` shape {encoder_hidden_states_mask.shape} must match "
                         f"(batch_size, text_seq_len)=({batch_size}, {text_seq_len}).")
    mask = encoder_hidden_states_mask.to(torch.bool)
    positions = torch.arange(text_seq_len, device=mask.device)
    last = torch.where(mask, positions, 0).max(dim=1).values + 1
    return text_seq_len, last.masked_fill(~mask.any(dim=1), text_seq_len), mask


class _SyncFreeTextLengths:
    """Rebinds the model module's `_compute_text_seq_len_from_mask` (called by name in its forward) to
    `_text_lengths` while any NucleusMoE model is enabled."""

    holders = 0
    original = transformer_nucleusmoe_image._compute_text_seq_len_from_mask

    def __init__(self) -> None:
        if _SyncFreeTextLengths.holders == 0:
            transformer_nucleusmoe_image._compute_text_seq_len_from_mask = _text_lengths
        _SyncFreeTextLengths.holders += 1

    def remove(self) -> None:
        _SyncFreeTextLengths.holders -= 1
        if _SyncFreeTextLengths.holders == 0:
            transformer_nucleusmoe_image._compute_text_seq_len_from_mask = _SyncFreeTextLengths.original


def _install(model: nn.Module, context: PlanContext) -> list[Any]:
    return [_TablesOnTheDevice(model.pos_embed), _SyncFreeTextLengths()]


def _experts(model: nn.Module, context: PlanContext) -> list[Any]:
    return [ExactExpertChoice(m, context) for m in model.modules() if isinstance(m, NucleusMoELayer)]


def _num_experts(model: nn.Module) -> int:
    return model.config.num_experts if model.config.moe_enabled else 0


PLANS = {
    NucleusMoEImageTransformer2DModel: SequenceParallelPlan(
        family="NucleusMoE-Image",
        call_site=("diffusers.models.transformers.transformer_nucleusmoe_image", routing.DISPATCH),
        attention_modules=lambda model: [block.attn for block in model.transformer_blocks],
        cfg=CfgPlan(PAIRS, output_shape=cfg_rules.token_output_shape, pipeline_uses_cfg=cfg_rules.guidance_above_one),
        shard_inputs={"": {"hidden_states": 1}},
        shard_outputs={"pos_embed": {0: 0}},
        gather_outputs={"proj_out": 1},
        text_first=False,
        installs={FAMILY_CHANGES: _install, MOE_EXPERTS: _experts},
        num_experts=_num_experts,
    )
}
