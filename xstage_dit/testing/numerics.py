"""The one measure of agreement the tests, the examples and the benchmarks report."""
from __future__ import annotations

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, computed in float64 (outputs in bf16 or float32 against references in any
    precision)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()
