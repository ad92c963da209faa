"""Numerical comparisons the tests share."""
from __future__ import annotations

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||, the tests' measure of agreement with a reference, computed in float64 (outputs in
    bf16 or float32 against references in any precision)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm()).item()


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
