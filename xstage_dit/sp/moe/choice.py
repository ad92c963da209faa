"""Expert-choice routing over the whole sequence while the tokens are split across ranks.

In expert-choice routing each expert takes the top C = ceil(capacity_factor * S / E) tokens of a sample's whole
sequence. A rank that ranked only its own S/N tokens would pick other tokens than one process does, so the
router scores of every rank are gathered (they are small: S x E per sample) and every rank takes the one-process
selection. Replicated experts: a rank keeps the selections whose token it holds; no size leaves the device, the
selections keep the static shape (E * B * C,), this rank's first, grouped by expert, with their count per expert
for a grouped matmul that computes only those. Expert parallel: a rank owns E/N experts, gathers the group's
tokens, computes every selection of its experts (B * C each) and the ranks sum their contributions to each
token in one reduce-scatter."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ...runtime.distributed import all_gather_stacked, waiting_for
from ..fabric import fabric_of, gather_steps, run_in_lockstep
from ..sharding import SequenceShard
from .grouped import sort_by_expert


@dataclass(frozen=True)
class ExpertChoice:
    """One layer's selections on this rank, E * B * C of them, this rank's first and grouped by expert.

    rows: the selected token's row in this rank's (B * L) tokens (0 for other ranks' tokens);
    experts: the expert that made each selection;
    mine: whether this rank holds the token; None where it computes every selection (expert parallel);
    weights: the gate weight one process gives the selection (normalised over the experts that took its token);
    counts: this rank's selections per expert, (E,) int64 (the grouped matmul's group sizes)."""

    rows: torch.Tensor
    experts: torch.Tensor
    mine: torch.Tensor | None
    weights: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class Selection:
    """The one-process selection: `token` (E, B, C) positions in each sample's sequence; `sample` and `weights`
    (E * B * C,) expert-major: each selection's sample and gate weight."""

    token: torch.Tensor
    sample: torch.Tensor
    weights: torch.Tensor


def gather_scores(scores: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Every rank's router scores as one process has them, (B, S, E), padding removed; this rank's at degree 1.
    Where the group has a fabric (the fused backends) the ranks store their scores into each other's buffers:
    the scores add no collective to a captured step."""
    if shard.degree == 1:
        return scores
    batch, local_len, num_experts = scores.shape
    local = scores.reshape(batch * local_len, num_experts).contiguous()
    fabric = fabric_of(shard.group.group_name)
    if fabric is not None:
        (whole,) = run_in_lockstep([gather_steps(local, fabric, "expert-choice router scores")], fabric.barrier)
    else:
        whole = all_gather_stacked(local, shard.degree, shard.group,
                                   lambda: "the other ranks' expert-choice router scores")
    return whole.view(shard.degree, batch, local_len, num_experts).transpose(0, 1).flatten(1, 2)[:, :shard.seq_len]


def capacity_of(capacity_factor: float, seq_len: int, num_experts: int) -> int:
    """C: the tokens each expert takes of each sample's `seq_len`."""
    return max(1, math.ceil(capacity_factor * seq_len / num_experts))


def select(whole: torch.Tensor, capacity_factor: float) -> Selection:
    """One process's expert choice over router scores (B, S, E) of whole sequences."""
    batch, seq_len, num_experts = whole.shape
    capacity = capacity_of(capacity_factor, seq_len, num_experts)
    affinity = whole.transpose(1, 2)  # (B, E, S)
    top = torch.topk(affinity, k=capacity, dim=-1)
    gating = affinity.gather(-1, top.indices)  # (B, E, C)
    # each token's gates summed over the experts that took it: scattered (an expert takes a token at most
    # once), then summed over the experts, so that the sum does not depend on the order atomic adds land in
    sums = torch.zeros_like(affinity).scatter_(-1, top.indices, gating).sum(1)  # (B, S)
    weights = gating / (sums.gather(-1, top.indices.flatten(1)).view_as(gating) + 1e-12)
    sample = torch.arange(batch, device=whole.device).view(1, batch, 1).expand(num_experts, -1, capacity).reshape(-1)
    return Selection(token=top.indices.transpose(0, 1), sample=sample,
                     weights=weights.transpose(0, 1).reshape(-1))  # expert-major, as one process


def choose_tokens(selection: Selection, local_len: int, rank: int) -> ExpertChoice:
    """Every expert on every rank (replicated): the selections of this rank's tokens, positions
    [rank * local_len, (rank + 1) * local_len) of each sample (padding included; at degree 1, the whole
    sequence)."""
    num_experts = selection.token.shape[0]
    device = selection.token.device
    token = selection.token.reshape(-1)
    local = token - rank * local_len
    mine = (local >= 0) & (local < local_len)
    rows = torch.where(mine, selection.sample * local_len + local, 0)
    expert = torch.arange(num_experts, device=device).repeat_interleave(token.numel() // num_experts)
    order = sort_by_expert(expert, mine, num_experts)
    return ExpertChoice(rows=rows[order.order], experts=expert[order.order], mine=mine[order.order],
                        weights=selection.weights[order.order], counts=order.counts)


def choose_for_experts(selection: Selection, local_len: int, experts: slice) -> ExpertChoice:
    """Expert parallel: every selection of the experts this rank owns (`experts`), whichever rank holds the
    token (each rank holding `local_len` positions of each sample); `rows` index the group's gathered tokens
    (`gather_tokens`). Each expert takes B * C tokens: the shapes are static."""
    _, batch, capacity = selection.token.shape
    token = selection.token[experts].reshape(-1)
    per_expert = batch * capacity
    held = slice(experts.start * per_expert, experts.stop * per_expert)
    owner, local = token // local_len, token % local_len
    rows = (owner * batch + selection.sample[held]) * local_len + local
    owned = torch.arange(experts.start, experts.stop, device=token.device).repeat_interleave(per_expert)
    return ExpertChoice(rows=rows, experts=owned, mine=None, weights=selection.weights[held],
                        counts=torch.full((experts.stop - experts.start,), per_expert, dtype=torch.int64,
                                          device=token.device))


def gather_tokens(x: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
    """Every rank's (B, L, C) tokens, as (N * B * L, C) rows, rank-major."""
    whole = all_gather_stacked(x, shard.degree, shard.group, lambda: "the other ranks' tokens for its experts")
    return whole.flatten(0, 2)


def reduce_tokens(partial: torch.Tensor, shard: SequenceShard, batch: int) -> torch.Tensor:
    """This rank's (B, L, C) share of the sum over ranks of (N * B * L, C) per-token contributions."""
    parts = partial.view(shard.degree * batch, -1, partial.shape[-1])
    mine = parts.new_empty((batch, *parts.shape[1:]))
    with waiting_for(lambda: "the other ranks' expert outputs for its tokens"), torch.no_grad():
        dist.reduce_scatter_tensor(mine, parts, group=shard.group)
    return mine
