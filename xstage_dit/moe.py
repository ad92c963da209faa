"""Mixture-of-experts feed-forward without host synchronisation: tokens are sorted by expert on the device and
every expert projection runs as one grouped matmul over the sorted tokens (`torch._grouped_mm`, group offsets
on the device), instead of a Python loop over experts sized by `.cpu()` counts.

Routing (dispatch) and combining are separate steps so that expert parallelism can slot in between them: an
all-to-all of the sorted tokens to the ranks that own their experts, and back."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class Dispatch:
    """Token copies sorted by expert: `tokens[i]` is the source row of sorted copy i, `weights` its gate weight,
    `offsets[e]` the end of expert e's group (int32, on the device)."""

    tokens: torch.Tensor
    weights: torch.Tensor
    offsets: torch.Tensor


def dispatch(expert_index: torch.Tensor, expert_weight: torch.Tensor, top_k: int, num_experts: int) -> Dispatch:
    """Sort the routing choices by expert. `expert_index`, `expert_weight`: (tokens * top_k,), token-major as
    gates return them. Sync-free: no bincount (it reads the maximum back on CUDA)."""
    order = expert_index.argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=expert_index.device)
    counts.index_add_(0, expert_index, torch.ones_like(expert_index))
    return Dispatch(tokens=order // top_k, weights=expert_weight[order], offsets=counts.cumsum(0).to(torch.int32))


class GroupedSwiGLUExperts:
    """Routed SwiGLU experts (w2(silu(w1 x) * w3 x), bias-free nn.Linear layers) held as stacked weights.

    The experts' own parameters are re-pointed at views of the stacks, so the model's memory does not grow and
    the experts still work as plain modules."""

    def __init__(self, experts: nn.ModuleList) -> None:
        self.w1, self.w3, self.w2 = (self._stack(experts, name) for name in ("w1", "w3", "w2"))
        self.num_experts = len(experts)

    @staticmethod
    def _stack(experts: nn.ModuleList, name: str) -> torch.Tensor:
        stacked = torch.stack([getattr(expert, name).weight.data for expert in experts])  # (E, out, in)
        for i, expert in enumerate(experts):
            getattr(expert, name).weight.data = stacked[i]
        return stacked

    def __call__(self, x: torch.Tensor, routed: Dispatch) -> torch.Tensor:
        """sum_k weight * expert_k(x) per token, for (tokens, C) inputs."""
        sorted_x = x[routed.tokens]
        gate = torch._grouped_mm(sorted_x, self.w1.transpose(1, 2), offs=routed.offsets)
        up = torch._grouped_mm(sorted_x, self.w3.transpose(1, 2), offs=routed.offsets)
        out = torch._grouped_mm(F.silu(gate) * up, self.w2.transpose(1, 2), offs=routed.offsets)
        out = out * routed.weights.unsqueeze(-1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, routed.tokens, out.to(x.dtype))
