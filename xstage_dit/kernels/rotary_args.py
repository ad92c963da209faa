"""The records a norm + RoPE call hands its kernels (kernels/rotary.py, and the fused backend's store kernel in
kernels/all_to_all.py), importable without Triton. The NamedTuples are the kernels' own view (Triton passes a
NamedTuple argument as a tuple whose fields the kernel reads by name)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from .attention_args import Strides


class RotaryTables(NamedTuple):
    """The (cos, sin) tables, (S, D) float32 with one stride, as the kernels read them: token s rotates by row s."""

    cos: torch.Tensor
    sin: torch.Tensor
    row_stride: int

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> RotaryTables:
        return cls(cos, sin, cos.stride(0))


class PartArgs(NamedTuple):
    """One part of joined tokens, (B, S, H, D), as the kernels read it; `weight` and `eps`: the RMSNorm of its
    head vectors, None where the kernel does not normalise (its NORM_ROPE switch is off)."""

    tokens: torch.Tensor
    strides: Strides
    weight: torch.Tensor | None = None
    eps: float | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor, weight: torch.Tensor | None = None, eps: float | None = None) -> PartArgs:
        return cls(tokens, Strides.of(tokens), weight, eps)


@dataclass(frozen=True)
class NormedTokens:
    """(B, S, H, D) tokens whose head vectors an RMSNorm (weight (D,), eps) normalises before they are rotated."""

    tokens: torch.Tensor
    weight: torch.Tensor
    eps: float

    def args(self) -> PartArgs:
        return PartArgs.of(self.tokens, self.weight, self.eps)


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

    def end_args(self) -> tuple[PartArgs, PartArgs]:
        """The kernels' view of the first and the last part, with their norms where given: one part is both (its
        rows all come first, the kernels never read the last)."""
        first, last, norm_rope = self.parts[0], self.parts[-1], self.norm_rope
        if norm_rope is None:
            return PartArgs.of(first), PartArgs.of(last)
        return (PartArgs.of(first, norm_rope.weights[0], norm_rope.eps[0]),
                PartArgs.of(last, norm_rope.weights[-1], norm_rope.eps[-1]))

    def normed_parts(self) -> list[NormedTokens]:
        """The parts with their norms (for inputs with `norm_rope`)."""
        assert self.norm_rope is not None
        return [NormedTokens(part, weight, eps)
                for part, weight, eps in zip(self.parts, self.norm_rope.weights, self.norm_rope.eps)]
