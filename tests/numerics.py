"""Numerical comparisons the tests share."""
from __future__ import annotations

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, the tests' measure of agreement with a reference, computed in float64 (outputs in
    bf16 or float32 against references in any precision)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()
