"""Numerical comparisons the tests share."""
from __future__ import annotations

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, the tests' measure of agreement with a reference, computed in float64 (outputs in
    bf16 or float32 against references in any precision)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


# kernels/fp8.py rounds each value of a row scaled to amax 448 to nearest on e4m3's grid: by at most 2^-4 of itself
# (3 mantissa bits), or, below e4m3's normal range, by half its subnormal step 2^-9, i.e. 2^-10 of the row's scale
FP8_RELATIVE = 2.0 ** -4
FP8_SUBNORMAL = 2.0 ** -10


def fp8_error_bound(reference: torch.Tensor, slack: float = 0.0) -> torch.Tensor:
    """Per element, how far an FP8 payload (kernels/fp8.py, rows along the last axis) of values computed within
    `slack` x their row's largest of `reference` may lie from `reference`: 2^-4 of the value, 2^-10 of the row's
    scale amax / 448, and the slack itself, which the rounding may grow by 2^-4 of it."""
    magnitude = reference.double().abs()
    amax = magnitude.amax(-1, keepdim=True)
    return FP8_RELATIVE * magnitude + FP8_SUBNORMAL * amax / 448 + (1 + FP8_RELATIVE) * slack * amax


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """x (..., D) as the kernels that read an FP8 payload of it see it: quantized by rows of D and dequantized
    (kernels/fp8.py's own kernels), in x's dtype."""
    from xstage_dit.kernels.fp8 import PAYLOAD_DTYPE, SCALE_DTYPE, dequantize, quantize

    x = x.contiguous()
    payload = torch.empty(x.shape, dtype=PAYLOAD_DTYPE, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=SCALE_DTYPE, device=x.device)
    quantize(x, payload, scales)
    return dequantize(payload, scales, x.dtype)
