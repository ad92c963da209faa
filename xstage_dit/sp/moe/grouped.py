"""Mixture-of-experts rows grouped by expert, without host synchronisation, for both routings (token choice:
sp/moe/token_choice.py; expert choice: sp/moe/choice.py):

- `sort_by_expert`: the token copies sorted by expert on the device, with their count per expert;
- `packed_swiglu_experts`: every expert projection as one grouped matmul over the sorted rows, the group sizes
  on the device, instead of a Python loop sized by `.cpu()` counts;
- `slot_table`, `add_contributions`: each token's expert outputs summed in expert order, never as atomic adds
  (which land in any order): a call gives the same bits every time."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...kernels import triton_runs_on


@dataclass(frozen=True)
class ExpertOrder:
    """A stable sort of copies by expert: `order` lists the valid copies first, grouped by expert in expert order
    (each expert's in their original order), then the others; `counts` (E,) int64: each expert's valid copies."""

    order: torch.Tensor
    counts: torch.Tensor


def sort_by_expert(experts: torch.Tensor, valid: torch.Tensor, num_experts: int) -> ExpertOrder:
    """Copy i goes to expert experts[i] (in [0, num_experts)) where valid[i]. Sync-free: no bincount (it reads
    the maximum back on CUDA); the counts are integer sums, the same in any order."""
    order = torch.where(valid, experts, num_experts).argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device).index_add_(0, experts, valid.long())
    return ExpertOrder(order=order, counts=counts)


def packed_swiglu_experts(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                          counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts in the packed layout (gate_up (E, D, 2F): the gate's F columns, then the up projection's;
    down (E, F, D)) on rows grouped by expert, `counts` rows each (rows after them stay uncomputed), as grouped
    matmuls."""
    offsets = counts.cumsum(0).to(torch.int32)
    gate, up = F.grouped_mm(x, gate_up, offs=offsets).chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate) * up, down, offs=offsets).type_as(x)


def slot_table(rows: torch.Tensor, experts: torch.Tensor, valid: torch.Tensor | None, tokens: int,
               num_experts: int) -> torch.Tensor:
    """(tokens, num_experts) int32: which selection (its index in `rows`) each expert made of each token, -1
    where it made none; selection i took token rows[i] for expert experts[i], where valid[i] (None: all)."""
    spill = tokens  # invalid selections all land in one extra row, dropped
    table = torch.full((tokens + 1, num_experts), -1, dtype=torch.int32, device=rows.device)
    where = rows if valid is None else torch.where(valid, rows, spill)
    table[where, experts] = torch.arange(rows.numel(), dtype=torch.int32, device=rows.device)
    return table[:tokens]


def add_contributions(base: torch.Tensor, contributions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """base (T, D) plus each token's rows of `contributions` summed in expert order (`slots`: slot_table's), in
    float32, rounded once: the Triton kernel where Triton runs, else the same sum in torch."""
    if triton_runs_on(base.device):
        from ...kernels.experts import sum_contributions

        return sum_contributions(base, contributions, slots)
    # index -1 (no contribution) picks the zero row appended last
    rows = torch.cat([contributions, contributions.new_zeros(1, contributions.shape[1])])[slots.long()]
    return (base.float() + rows.float().sum(1)).to(base.dtype)
