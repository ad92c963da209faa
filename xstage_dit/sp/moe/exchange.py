"""Expert parallel over a fabric (X-Stage): no collective moves a token; the kernels store the rows where they go.

Every rank knows the whole selection (expert choice over the gathered router scores), so every rank computes
where each slot's rows come from and go, on the device (`route_slots`), and the buffers have static shapes:

1. dispatch: a store kernel writes each selected token this rank holds into its expert owner's receive buffer;
2. barrier: every rank's rows have landed;
3. the experts: SwiGLU tiles, then down-projection tiles whose epilogue multiplies each row by its gate weight
   and stores it into the combine buffer of the rank holding its token, in waves of this rank's experts
   (`ExpertSchedule`: interleaved, a wave's combine stores share a launch with the next wave's SwiGLU tiles);
4. barrier: every contribution to this rank's tokens has landed;
5. each token's output is its shared-expert output plus its contributions, summed in expert order (the same
   order whatever the ranks' timing: the result is deterministic).

A rank's receive buffer is read in step 3 before it arrives at step 4's barrier, and a peer stores into it only
after passing the next layer's first barrier; its combine buffer is read in step 5 before it arrives at the next
layer's first barrier, which a peer passes before it stores again. `expert_steps` is the algorithm paused before
each barrier (fabric.run_in_lockstep runs N simulated ranks of it over a loopback fabric in tests)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...burst_gap.moe_plan import ExpertSchedule
from .grouped import slot_table
from ..fabric import Fabric, Steps, View, run_in_lockstep


@dataclass(frozen=True)
class SlotRoutes:
    """Where one rank's slots (kernels/experts.py's layout, E * B * C of them) come from and go:
    src_rows: this rank's token row (of its B * L) of each slot, -1 where another rank holds the token;
    owner: the rank holding each slot's token;
    slot_of: (B * L, E), the slot in which each expert took each of this rank's tokens, -1 where it did not."""

    src_rows: torch.Tensor
    owner: torch.Tensor
    slot_of: torch.Tensor


def route_slots(token: torch.Tensor, local_len: int, rank: int) -> SlotRoutes:
    """`token`: (E, B, C) each slot's token position in its sample's whole sequence; this rank holds positions
    [rank * local_len, (rank + 1) * local_len) of every sample."""
    experts, batch, capacity = token.shape
    owner = token // local_len
    row = torch.arange(batch, device=token.device).view(1, batch, 1) * local_len + token % local_len
    mine = owner == rank
    expert = torch.arange(experts, device=token.device).view(experts, 1, 1).expand_as(token)
    return SlotRoutes(src_rows=torch.where(mine, row, -1).reshape(-1).to(torch.int32),
                      owner=owner.reshape(-1).to(torch.int32),
                      slot_of=slot_table(row.reshape(-1), expert.reshape(-1), mine.reshape(-1), batch * local_len,
                                         experts))


def expert_steps(tokens: torch.Tensor, shared: torch.Tensor, routes: SlotRoutes, scale: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, fabric: Fabric,
                 schedule: ExpertSchedule) -> Steps[torch.Tensor]:
    """One rank's expert-parallel MoE over `fabric`: `tokens` and `shared` (B * L, D) this rank's tokens and their
    shared-expert output; `scale` (E * B * C,) each slot's gate weight; `gate_up` (E_r, D, 2F) and `down`
    (E_r, F, D) this rank's experts, E_r = E / N. Returns the (B * L, D) output."""
    from ...kernels.experts import Combine, ExpertOperands, run_experts, store_rows, sum_contributions  # Triton

    dim, width = tokens.shape[1], down.shape[1]
    slots = routes.owner.numel()
    per_rank = slots // fabric.world_size
    # the combine's rows are summed after the last barrier: kept past the call
    buffers = fabric.carve([View("experts-received", (per_rank, dim), tokens.dtype),
                            View("experts-combine", (slots, dim), tokens.dtype, kept=True)])
    received, combine = buffers["experts-received"], buffers["experts-combine"]
    store_rows(tokens, routes.src_rows, received.destinations, received.tensor)
    yield "the expert dispatch"
    mine = slice(fabric.rank * per_rank, (fabric.rank + 1) * per_rank)
    operands = ExpertOperands(received=received.tensor, gate_up=gate_up, down=down,
                              act=tokens.new_empty((per_rank, width)),
                              combine=Combine(buffer=combine.tensor, destinations=combine.destinations,
                                              scale=scale[mine].contiguous(), owner=routes.owner[mine].contiguous(),
                                              slot0=mine.start))
    for up_experts, down_experts in schedule.launches(gate_up.shape[0]):
        run_experts(operands, up_experts, down_experts, schedule.interleaved)
    yield "the expert combine"
    return sum_contributions(shared, combine.tensor, routes.slot_of)


def expert_exchange(tokens: torch.Tensor, shared: torch.Tensor, routes: SlotRoutes, scale: torch.Tensor,
                    gate_up: torch.Tensor, down: torch.Tensor, fabric: Fabric,
                    schedule: ExpertSchedule) -> torch.Tensor:
    """One rank's expert-parallel MoE over `fabric` (see `expert_steps`)."""
    (out,) = run_in_lockstep([expert_steps(tokens, shared, routes, scale, gate_up, down, fabric, schedule)],
                             fabric.barrier)
    return out
