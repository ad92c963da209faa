"""Token-choice mixture of experts (each token's top-k experts, HiDream) on rows grouped by expert
(sp/moe/grouped.py): the copies sorted by expert, the experts as grouped matmuls, each token's contributions
summed in expert order.

Routing (dispatch) and combining are separate steps so that expert parallelism can slot in between them: a rank
holding some experts dispatches the group's gathered tokens to those only (patches/hidream.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...fusions.plain import why_not_plain, why_not_plain_tensor
from .grouped import packed_swiglu_experts, slot_table, sort_by_expert
from .ops import expert_sum


@dataclass(frozen=True)
class Dispatch:
    """Token copies sorted by expert: `tokens[i]` is the source row of sorted copy i, `experts[i]` its expert (of
    the held ones), `weights` its gate weight, `counts[e]` the copies of held expert e (on the device). `mine`,
    where only some experts are held: which sorted copies go to them (those come first; the rest are not
    computed and add nothing)."""

    tokens: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    mine: torch.Tensor | None = None


def dispatch(expert_index: torch.Tensor, expert_weight: torch.Tensor, top_k: int, num_experts: int,
             held: slice | None = None) -> Dispatch:
    """Sort the routing choices by expert. `expert_index`, `expert_weight`: (tokens * top_k,), token-major as
    gates return them. `held`: the experts this rank holds (expert parallel), whose copies come first, grouped
    by expert; None: all of them."""
    if held is None:
        held = slice(0, num_experts)
    share = held.stop - held.start
    local = expert_index - held.start
    mine = (local >= 0) & (local < share)
    expert = local.clamp(0, share - 1)  # a copy for an expert not held is sorted last and counted nowhere
    order = sort_by_expert(expert, mine, share)
    return Dispatch(tokens=order.order // top_k, experts=expert[order.order], weights=expert_weight[order.order],
                    counts=order.counts, mine=None if share == num_experts else mine[order.order])


def why_not_stackable(experts: nn.ModuleList) -> str | None:
    """Why `experts`' weights cannot be stacked for the grouped matmuls (a quantized weight: its class holds other
    numbers than its values); None where they can."""
    for index, expert in enumerate(experts):
        for name in ("w1", "w3", "w2"):
            why = why_not_plain_tensor("weight", getattr(expert, name).weight)
            if why is not None:
                return f"routed expert {index}.{name} {why}"
    return None


class GroupedSwiGLUExperts:
    """Routed SwiGLU experts (w2(silu(w1 x) * w3 x), bias-free nn.Linear layers) held as stacked weights in the
    packed layout: one stack of [w1; w3] per expert, one of w2.

    The experts' own parameters are re-pointed at views of the stacks, so the model's memory does not grow and
    the experts still work as plain modules (an adapter merged into them in place lands in the stacks)."""

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
        kept = experts[self.held]
        width, dim = kept[0].w1.weight.shape
        gate_up = kept[0].w1.weight.data.new_empty((len(kept), 2 * width, dim))  # nn.Linear's (out, in)
        down = kept[0].w2.weight.data.new_empty((len(kept), dim, width))
        for i, expert in enumerate(kept):
            for weight, stacked in ((expert.w1.weight, gate_up[i, :width]), (expert.w3.weight, gate_up[i, width:]),
                                    (expert.w2.weight, down[i])):
                weight.data = stacked.copy_(weight.data)
        for i in self._away:
            for name in ("w1", "w3", "w2"):
                getattr(experts[i], name).weight.data = torch.empty(0, device=down.device, dtype=down.dtype)
        # as packed_swiglu_experts takes them: (E, D, 2F) and (E, F, D), views of the (out, in) stacks
        self.gate_up, self.down = gate_up.transpose(1, 2), down.transpose(1, 2)
        self.num_experts = len(experts)
        self._expert_type = type(experts[0])

    def why_not_plain(self) -> str | None:
        """Why the stacks cannot compute the experts this call: an expert, or its w1, w3 or w2, that is no longer
        the plain module (an adapter's layer, hooks: fusions/plain.py); None where they can."""
        for index, expert in enumerate(self.experts):
            parts = [("", expert, self._expert_type), *((f".{name}", getattr(expert, name), nn.Linear)
                                                         for name in ("w1", "w3", "w2"))]
            for name, module, kind in parts:
                why = why_not_plain(module, kind)
                if why is not None:
                    return f"routed expert {index}{name} {why}"
        return None

    def restore(self) -> None:
        """The experts moved to the host back on the device."""
        for i, weights in self._away.items():
            for name, weight in weights.items():
                getattr(self.experts[i], name).weight.data = weight.to(self.down.device)

    def __call__(self, x: torch.Tensor, routed: Dispatch) -> torch.Tensor:
        """sum_k weight * expert_k(x) per token, for (tokens, C) inputs, each token's contributions summed in
        expert order."""
        out = packed_swiglu_experts(self.gate_up, self.down, x[routed.tokens], routed.counts)
        out = out * routed.weights.unsqueeze(-1).to(out.dtype)
        slots = slot_table(routed.tokens, routed.experts, routed.mine, x.shape[0], self.gate_up.shape[0])
        return expert_sum(torch.zeros_like(x), out, slots)
