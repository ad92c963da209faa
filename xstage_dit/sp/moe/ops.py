"""The mixture-of-experts layers' custom ops, as `torch.library` ops so that a compiled graph keeps them opaque:

- xstage::expert_choice: an expert-choice MoE layer's routed experts, in the mode chosen per shape on the host (no
  collective, fabric kernel or host decision is traced); `expert_choice` is its one caller;
- xstage::add_contributions: each token's expert outputs summed in expert order (sp/moe/grouped.py) where a
  compiler traces the layer (token choice): the compiled call sums as the eager one does, bit for bit."""
from __future__ import annotations

import torch

from ...burst_gap.moe_plan import ExpertMode, ExpertSchedule
from ...runtime.distributed import resolve_group
from ..sharding import SequenceShard
from .grouped import add_contributions
from .layer import ExpertChoiceCall, run_expert_choice
from .modes import ExpertModes

# the op carries each mode as its position here
_MODES = tuple(ExpertMode)
_MODE_CODES = {mode: code for code, mode in enumerate(_MODES)}


@torch.library.custom_op("xstage::expert_choice", mutates_args=())
def expert_choice_op(hidden: torch.Tensor, shared: torch.Tensor, scores: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor, capacity_factor: float, route_scale: float, seq_len: int, degree: int,
                     rank: int, group_name: str, modes: list[int], own_start: int, own_stop: int, waves: int,
                     interleaved: bool) -> torch.Tensor:
    """`expert_choice`'s records as the op's scalars: the modes as their codes in the order of preference, the
    stores mode's fixed schedule as its fields (`waves` 0: the planner's), this rank's experts and the split as
    theirs."""
    shard = SequenceShard(degree, rank, resolve_group(group_name) if degree > 1 else None)
    shard.seq_len = seq_len
    call = ExpertChoiceCall(capacity_factor, route_scale, ExpertModes(tuple(_MODES[code] for code in modes)),
                            slice(own_start, own_stop), ExpertSchedule(waves, interleaved) if waves else None)
    return run_expert_choice(hidden, shared, scores, gate_up, down, call, shard)


@expert_choice_op.register_fake
def _(hidden, shared, scores, gate_up, down, capacity_factor, route_scale, seq_len, degree, rank, group_name, modes,
      own_start, own_stop, waves, interleaved):
    return torch.empty_like(shared)


def expert_choice(hidden: torch.Tensor, shared: torch.Tensor, scores: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, call: ExpertChoiceCall, shard: SequenceShard) -> torch.Tensor:
    """An expert-choice MoE layer's call (sp/moe/layer.py's run_expert_choice) through the op: hidden, shared
    (B, L, D) this rank's tokens and their shared-expert output, scores (B, L, E) their router scores, the
    experts' weights; the call's records passed field by field."""
    schedule = call.schedule or ExpertSchedule(waves=0)  # 0 waves: the planner's
    return expert_choice_op(
        hidden, shared, scores, gate_up, down, capacity_factor=call.capacity_factor, route_scale=call.route_scale,
        seq_len=shard.seq_len, degree=shard.degree, rank=shard.rank,
        group_name=shard.group.group_name if shard.group is not None else "",
        modes=[_MODE_CODES[mode] for mode in call.modes.allowed], own_start=call.own.start, own_stop=call.own.stop,
        waves=schedule.waves, interleaved=schedule.interleaved)


@torch.library.custom_op("xstage::add_contributions", mutates_args=())
def add_contributions_op(base: torch.Tensor, contributions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    return add_contributions(base, contributions, slots)


@add_contributions_op.register_fake
def _(base, contributions, slots):
    return torch.empty_like(base)


def expert_sum(base: torch.Tensor, contributions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """add_contributions for code a compiler may trace: through the op where a graph is being compiled (its
    kernel is not traced), else called directly (the op's eager dispatch costs host time)."""
    if torch.compiler.is_compiling():
        return add_contributions_op(base, contributions, slots)
    return add_contributions(base, contributions, slots)
