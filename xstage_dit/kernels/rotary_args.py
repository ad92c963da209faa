"""The records a norm + RoPE call hands its kernels (kernels/rotary.py, and the fused backend's store kernel in
kernels/all_to_all.py), importable without Triton."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class NormedTokens:
    """(B, S, H, D) tokens whose head vectors an RMSNorm (weight (D,), eps) normalises before they are rotated."""

    tokens: torch.Tensor
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class NormRope:
    """What a kernel applies to the head vectors of joined parts before storing them: each part's RMSNorm (its
    weight and eps, by part), then the rotation by the (cos, sin) rows of the joined tokens, as
    `rotary.norm_rotate` computes it. The norm spans one head vector (weight (D,)), or with `across_heads` a
    token's whole vector, every head (weight (H*D,); one part), as Wan normalises q and k before splitting the
    heads."""

    weights: tuple[torch.Tensor, ...]
    eps: tuple[float, ...]
    cos: torch.Tensor
    sin: torch.Tensor
    across_heads: bool = False


@dataclass(frozen=True)
class JointTokens:
    """q, k or v of one rank's joint-attention call as the kernel that stores it reads them: `parts` (1 or 2
    tensors (B, rows, H, D)) joined along the tokens, with `norm_rope` applied on the way where given; what the
    caller would otherwise have joined (and normalised and rotated) into one tensor first."""

    parts: tuple[torch.Tensor, ...]
    norm_rope: NormRope | None = None

    @staticmethod
    def normed_and_rotated(parts: Sequence[NormedTokens], cos: torch.Tensor, sin: torch.Tensor) -> JointTokens:
        return JointTokens(tuple(part.tokens for part in parts),
                           NormRope(tuple(part.weight for part in parts), tuple(part.eps for part in parts), cos, sin))

    @property
    def rows(self) -> int:
        return sum(part.shape[1] for part in self.parts)

    @property
    def joined_shape(self) -> tuple[int, int, int, int]:
        batch, _, heads, head_dim = self.parts[0].shape
        return batch, self.rows, heads, head_dim

    def normed_parts(self) -> list[NormedTokens]:
        """The parts with their norms (for inputs with `norm_rope`)."""
        assert self.norm_rope is not None
        return [NormedTokens(part, weight, eps)
                for part, weight, eps in zip(self.parts, self.norm_rope.weights, self.norm_rope.eps)]
