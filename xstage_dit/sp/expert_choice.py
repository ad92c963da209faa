"""Expert-choice routing over the whole sequence while the tokens are split across ranks.

In expert-choice routing each expert takes the top C = ceil(capacity_factor * S / E) tokens of a sample's whole
sequence. A rank that ranked only its own S/N tokens would pick other tokens than one process does, so the
router scores of every rank are gathered (they are small: S x E per sample) and every rank takes the one-process
selection, then keeps the selections whose token it holds. No size leaves the device: the selections keep the
static shape (E * B * C,), this rank's first, grouped by expert, with their count per expert for a grouped matmul
that computes only those."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime.distributed import all_gather_into, waiting_for
from .sharding import SequenceShard


@dataclass(frozen=True)
class ExpertChoice:
    """One layer's selections on this rank, E * B * C of them, this rank's first and grouped by expert.

    rows: the selected token's row in this rank's (B * L) tokens (0 for other ranks' tokens);
    mine: whether this rank holds the token;
    weights: the gate weight one process gives the selection (normalised over the experts that took its token);
    counts: this rank's selections per expert, (E,) int64 (the grouped matmul's group sizes)."""

    rows: torch.Tensor
    mine: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor


def choose_tokens(scores: torch.Tensor, capacity_factor: float, shard: SequenceShard) -> ExpertChoice:
    """`scores`: this rank's router scores, (B, L, E), L its tokens (padding included); at degree 1, L is the
    whole sequence."""
    batch, local_len, num_experts = scores.shape
    if shard.degree > 1:
        whole = scores.new_empty((shard.degree * batch, local_len, num_experts))
        with waiting_for(lambda: "the other ranks' expert-choice router scores"):
            all_gather_into(whole, scores.contiguous(), shard.group)
        seq_len = shard.seq_len
        whole = whole.unflatten(0, (shard.degree, batch)).transpose(0, 1).flatten(1, 2)[:, :seq_len]  # no padding
    else:
        seq_len, whole = local_len, scores
    capacity = max(1, math.ceil(capacity_factor * seq_len / num_experts))

    affinity = whole.transpose(1, 2)  # (B, E, S)
    top = torch.topk(affinity, k=capacity, dim=-1)
    gating = affinity.gather(-1, top.indices).transpose(0, 1).reshape(-1)  # expert-major, as one process
    token = top.indices.transpose(0, 1).reshape(-1)
    sample = torch.arange(batch, device=scores.device).view(1, batch, 1).expand(num_experts, -1, capacity).reshape(-1)
    flat = sample * seq_len + token
    sums = torch.zeros(batch * seq_len, dtype=gating.dtype, device=scores.device).scatter_add_(0, flat, gating)
    weights = gating / (sums[flat] + 1e-12)

    local = token - shard.rank * local_len
    mine = (local >= 0) & (local < local_len)
    rows = torch.where(mine, sample * local_len + local, 0)
    expert = torch.arange(num_experts, device=scores.device).repeat_interleave(batch * capacity)
    order = torch.where(mine, expert, num_experts).argsort(stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=scores.device).index_add_(0, expert, mine.long())
    return ExpertChoice(rows=rows[order], mine=mine[order], weights=weights[order], counts=counts)
