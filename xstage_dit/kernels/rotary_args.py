"""The record a norm + RoPE call hands its kernel (kernels/rotary.py), importable without Triton."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class NormedTokens:
    """(B, S, H, D) tokens whose head vectors an RMSNorm (weight (D,), eps) normalises before they are rotated."""

    tokens: torch.Tensor
    weight: torch.Tensor
    eps: float
