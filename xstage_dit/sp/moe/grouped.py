"""Mixture-of-experts feed-forward without host synchronisation: tokens are sorted by expert on the device and
every expert projection runs as one grouped matmul over the sorted tokens (`torch._grouped_mm`, group offsets
on the device), instead of a Python loop over experts sized by `.cpu()` counts.

Routing (dispatch) and combining are separate steps so that expert parallelism can slot in between them: a
rank holding some experts dispatches the group's gathered tokens to those only (patches/image/hidream.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Dispatch:
    """Token copies sorted by expert: `tokens[i]` is the source row of sorted copy i, `weights` its gate weight,
    `offsets[e]` the end of expert e's group (int32, on the device). `mine`, where only some experts are held:
    which sorted copies go to them (those come first; the rest are not computed and add nothing)."""

    tokens: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor
    mine: torch.Tensor | None = None


def dispatch(expert_index: torch.Tensor, expert_weight: torch.Tensor, top_k: int, num_experts: int,
             held: slice | None = None) -> Dispatch:
    """Sort the routing choices by expert. `expert_index`, `expert_weight`: (tokens * top_k,), token-major as
    gates return them. `held`: the experts this rank holds (expert parallel), whose copies come first, grouped
    by expert; None: all of them. Sync-free: no bincount (it reads the maximum back on CUDA)."""
    if held is None:
        held = slice(0, num_experts)
    local = expert_index - held.start
    mine = (local >= 0) & (local < held.stop - held.start)
    order = torch.where(mine, local, num_experts).argsort(stable=True)
    counts = torch.zeros(held.stop - held.start, dtype=torch.int64, device=expert_index.device)
    counts.index_add_(0, local.clamp(0, held.stop - held.start - 1), mine.long())
    return Dispatch(tokens=order // top_k, weights=expert_weight[order], offsets=counts.cumsum(0).to(torch.int32),
                    mine=None if held.stop - held.start == num_experts else mine[order])


class GroupedSwiGLUExperts:
    """Routed SwiGLU experts (w2(silu(w1 x) * w3 x), bias-free nn.Linear layers) held as stacked weights.

    The experts' own parameters are re-pointed at views of the stacks, so the model's memory does not grow and
    the experts still work as plain modules."""

    def __init__(self, experts: nn.ModuleList, held: slice | None = None) -> None:
        """`held`: the experts kept on the device (expert parallel); the others' weights move to the host until
        `restore()`."""
        self.experts = experts
        self.held = held if held is not None else slice(0, len(experts))
        self._away = {i: {name: getattr(expert, name).weight.data for name in ("w1", "w3", "w2")}
                      for i, expert in enumerate(experts) if not self.held.start <= i < self.held.stop}
        for weights in self._away.values():
            for name, weight in weights.items():
                weights[name] = weight.to("cpu")
        self.w1, self.w3, self.w2 = (self._stack(experts[self.held], name) for name in ("w1", "w3", "w2"))
        for i in self._away:
            for name in ("w1", "w3", "w2"):
                getattr(experts[i], name).weight.data = torch.empty(0, device=self.w1.device, dtype=self.w1.dtype)
        self.num_experts = len(experts)

    @staticmethod
    def _stack(experts: nn.ModuleList, name: str) -> torch.Tensor:
        stacked = torch.stack([getattr(expert, name).weight.data for expert in experts])  # (E, out, in)
        for i, expert in enumerate(experts):
            getattr(expert, name).weight.data = stacked[i]
        return stacked

    def restore(self) -> None:
        """The experts moved to the host back on the device."""
        for i, weights in self._away.items():
            for name, weight in weights.items():
                getattr(self.experts[i], name).weight.data = weight.to(self.w1.device)

    def __call__(self, x: torch.Tensor, routed: Dispatch) -> torch.Tensor:
        """sum_k weight * expert_k(x) per token, for (tokens, C) inputs."""
        sorted_x = x[routed.tokens]
        gate = torch._grouped_mm(sorted_x, self.w1.transpose(1, 2), offs=routed.offsets)
        up = torch._grouped_mm(sorted_x, self.w3.transpose(1, 2), offs=routed.offsets)
        out = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=routed.offsets)
        out = out * routed.weights.unsqueeze(-1).to(out.dtype)
        if routed.mine is not None:
            out = torch.where(routed.mine.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))
        return torch.zeros_like(x).index_add_(0, routed.tokens, out.to(x.dtype))


def packed_swiglu_experts(gate_up: torch.Tensor, down: torch.Tensor, x: torch.Tensor,
                          counts: torch.Tensor) -> torch.Tensor:
    """Packed SwiGLU experts (NucleusMoE's layout: gate_up (E, D, 2F), down (E, F, D)) on rows grouped by expert,
    `counts` rows each (rows after them stay uncomputed), as grouped matmuls."""
    offsets = counts.cumsum(0).to(torch.int32)
    gate, up = F.grouped_mm(x, gate_up, offs=offsets).chunk(2, dim=-1)
    return F.grouped_mm(F.silu(gate) * up, down, offs=offsets).type_as(x)
