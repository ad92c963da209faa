"""One expert-choice MoE layer call across the Ulysses group: the shared expert's output plus the routed experts',
for this rank's tokens, in the mode chosen for the call's shape (sp/moe/modes.py).

It runs inside the custom op xstage::expert_choice (sp/moe/ops.py), so that a compiled model holds the whole routed
part as one node: the mode and the stores mode's schedule are chosen on the host per shape (reading the
machine's calibration, logging the choice), which a compiler must not trace."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .grouped import add_contributions, packed_swiglu_experts, slot_table
from ...burst_gap.moe_plan import ExpertMode, ExpertSchedule, ExpertShape
from .choice import choose_for_experts, choose_tokens, gather_scores, gather_tokens, reduce_tokens, select
from .exchange import expert_exchange, route_slots
from .modes import ExpertModes
from ..fabric import fabric_of
from ..sharding import SequenceShard


@dataclass(frozen=True)
class ExpertChoiceCall:
    """What one layer's call needs besides its tensors: its routing constants, the modes it may run, this rank's
    experts (`own`, of E), and a fixed schedule for the stores mode (None: the planner's)."""

    capacity_factor: float
    route_scale: float
    modes: ExpertModes
    own: slice
    schedule: ExpertSchedule | None = None


def run_expert_choice(hidden: torch.Tensor, shared: torch.Tensor, scores: torch.Tensor, gate_up: torch.Tensor,
                      down: torch.Tensor, call: ExpertChoiceCall, shard: SequenceShard) -> torch.Tensor:
    """hidden, shared: (B, L, D) this rank's tokens and their shared-expert output; scores: (B, L, E) their router
    scores; gate_up (E, D, 2F) and down (E, F, D): every expert, or this rank's where the experts are sharded."""
    batch, local_len, dim = hidden.shape
    selection = select(gather_scores(scores, shard), call.capacity_factor)
    experts, _, capacity = selection.token.shape
    tokens = shard.seq_len if shard.degree > 1 else local_len
    shape = ExpertShape(batch, tokens, dim, down.shape[1], experts, capacity, shard.degree, hidden.element_size())
    mode = call.modes.choose(shape, hidden.device)
    own = (gate_up, down) if call.modes.sharded else (gate_up[call.own], down[call.own])
    if mode is ExpertMode.STORES:
        schedule = call.schedule or call.modes.schedule(shape, hidden.device)
        out = expert_exchange(hidden.reshape(-1, dim), shared.reshape(-1, dim),
                              route_slots(selection.token, local_len, shard.rank),
                              selection.weights * call.route_scale, *own,
                              fabric_of(shard.group.group_name), schedule)
        return out.view(batch, local_len, dim)
    if mode is ExpertMode.REPLICATED:
        # at degree 1 every selection is this rank's, already in expert order: each is computed
        choice = (choose_for_experts(selection, local_len, slice(0, experts)) if shard.degree == 1
                  else choose_tokens(selection, local_len, shard.rank))
        rows, weights, first = hidden.reshape(batch * local_len, dim), (gate_up, down), 0
    else:
        choice = choose_for_experts(selection, local_len, call.own)
        rows, weights, first = gather_tokens(hidden, shard), own, call.own.start
    routed = packed_swiglu_experts(*weights, rows[choice.rows], choice.counts)
    routed = (routed.float() * (choice.weights * call.route_scale).unsqueeze(-1)).to(hidden.dtype)
    # each token's contributions summed in expert order (rows past this rank's selections, not computed, are
    # never read): the same result on every run, where atomic adds would land in any order
    slots = slot_table(choice.rows, choice.experts - first, choice.mine, rows.shape[0], weights[1].shape[0])
    if mode is ExpertMode.REPLICATED:
        out = add_contributions(shared.reshape(batch * local_len, dim), routed, slots)
        return out.reshape(batch, local_len, dim)
    return shared + reduce_tokens(add_contributions(torch.zeros_like(rows), routed, slots), shard, batch)

