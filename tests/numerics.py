"""Numerical comparisons the tests share."""
from __future__ import annotations

import torch

from xstage_dit.testing.numerics import relative_error  # noqa: F401  (the tests' measure, shared with examples)


# FP8 attention (INT8 q·kᵀ of smoothed keys, e4m3 p·v) against float64 on standard-normal inputs: the relative
# error of its output and the largest error of its log-sum-exp, and at most how many times bf16's error on the same
# inputs (the yardstick) its output's error may be. e4m3 keeps 3 mantissa bits where bf16 keeps 7: each product's
# rounding is 16 times coarser. The yardstick on the CPU is the float32 kernel on inputs rounded to bf16; on a GPU
# our bf16 kernel, whose output rounding adds to the yardstick less than the FP8 kernel's INT8 scores add to its
# error: half as much again as 16 there.
FP8_ATTENTION_ERROR = 0.05
FP8_LSE_ERROR = 0.03
FP8_OVER_BF16 = 16
FP8_OVER_BF16_KERNEL = 24


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int,
                        key_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q kᵀ / sqrt(D)) v over keys [0, kv_len) in float64, for (B, S, H, D) tensors, k and v with H or a
    divisor of H heads; `key_mask` (B, M): keys [0, M) it marks False are ignored. Returns the output and the
    natural-log log-sum-exp (B, H, Sq)."""
    group = q.shape[2] // k.shape[2]
    k, v = (t[:, :kv_len].repeat_interleave(group, 2).double() for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k) * q.shape[-1] ** -0.5
    if key_mask is not None:
        keep = torch.ones(q.shape[0], kv_len, dtype=torch.bool, device=q.device)
        keep[:, : key_mask.shape[1]] = key_mask
        scores = scores.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1)


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
