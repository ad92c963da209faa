"""FP8 payloads: what the store kernels send between ranks as e4m3 values with one float32 scale per row (one
token's vector of one head), quantized in the registers of the kernel that stores them and dequantized where they
are read. Half the bytes of bf16 on the wire, plus 4 bytes of scale per row.

A row's scale is amax / 448 (e4m3's largest finite value), with a floor for rows of zeros (their values stay 0).
Each value is rounded to nearest even on e4m3's grid, so it is off by at most 2^-4 of itself, or by 2^-10 of the
scale where it falls below e4m3's normal range (2^-6 of the scale): |x - dequantized| <= 2^-4 |x| + 2^-10 scale.

Every target stores the same bytes: a GPU converts with one instruction (round to nearest even, saturating at
448); Triton's CPU interpreter, which rounds wrongly where a mantissa carries into the exponent, puts the values on
e4m3's grid in float32 arithmetic first (`to_e4m3`). `quantize_rows` and `dequantize_rows` are plain Triton
functions that every kernel storing or reading payloads calls; a Gluon kernel compiles their same source
(attention_hopper.py)."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .attention_args import PAYLOAD_DTYPE, SCALE_DTYPE

E4M3_MAX = tl.constexpr(448.0)  # e4m3's largest finite value (the host reads its `.value`)
_SMALLEST_NORMAL = tl.constexpr(0.015625)  # 2^-6: below it e4m3's values are subnormal, 2^-9 apart
_SUBNORMAL_ROUNDER = tl.constexpr(24576.0)  # 1.5 * 2^14: float32 numbers near it lie 2^-9 apart
_AMAX_FLOOR = tl.constexpr(1e-30)  # a row of zeros gets a tiny normal scale, never a division by zero
# float32 keeps 23 mantissa bits, e4m3 3: rounding drops the low 20 (bit 20 is the last one kept)
_DROPPED = tl.constexpr(20)
_BELOW_HALF = tl.constexpr(0x7FFFF)  # half of the last kept bit, less one: ties round to even
_KEPT = tl.constexpr(-1048576)  # 0xFFF00000 as int32: sign, exponent and the 3 mantissa bits kept
_SIGN = tl.constexpr(-2147483648)  # 0x80000000 as int32
# where Triton's CPU interpreter runs the kernels (read as triton.jit reads it, when the kernels are defined)
_ROUND_IN_FLOAT32 = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def on_e4m3_grid(x):
    """x (|x| <= 448, up to rounding) rounded to nearest even on e4m3's grid, in float32: exactly representable."""
    magnitude = tl.abs(x)
    bits = magnitude.to(tl.int32, bitcast=True)
    normal = ((bits + _BELOW_HALF + ((bits >> _DROPPED) & 1)) & _KEPT).to(tl.float32, bitcast=True)
    subnormal = (magnitude + _SUBNORMAL_ROUNDER) - _SUBNORMAL_ROUNDER
    rounded = tl.minimum(tl.where(magnitude < _SMALLEST_NORMAL, subnormal, normal), E4M3_MAX)
    sign = x.to(tl.int32, bitcast=True) & _SIGN
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def to_e4m3(x):
    """float32 x (|x| <= 448, up to rounding) as e4m3, rounded to nearest even: on a GPU the conversion itself
    (cvt.rn.satfinite); in the interpreter x is put on the grid first (on_e4m3_grid), which it converts exactly."""
    if _ROUND_IN_FLOAT32:
        x = on_e4m3_grid(x)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_rows(x):
    """A (ROWS, D) tile as its e4m3 payload (ROWS, D) and each row's float32 scale (ROWS,)."""
    x = x.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), _AMAX_FLOOR)
    inverse = E4M3_MAX / amax
    payload = to_e4m3(x * tl.expand_dims(inverse, 1))
    return payload, amax / E4M3_MAX


@triton.jit
def dequantize_rows(payload, scales):
    """A (ROWS, D) e4m3 tile and its rows' scales (ROWS,) as float32 values."""
    return payload.to(tl.float32) * tl.expand_dims(scales, 1)


@triton.jit
def _quantize_kernel(x, payload, scales, rows, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = row < rows
    at = row.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    values, row_scales = quantize_rows(tl.load(x + at, mask=ok[:, None], other=0.0))
    tl.store(payload + at, values, mask=ok[:, None])
    tl.store(scales + row, row_scales, mask=ok)


@triton.jit
def _dequantize_kernel(payload, scales, out, rows, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = row < rows
    at = row.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
    values = dequantize_rows(tl.load(payload + at, mask=ok[:, None]), tl.load(scales + row, mask=ok))
    tl.store(out + at, values.to(out.dtype.element_ty), mask=ok[:, None])


# rows per program: 128 rows of head_dim 128 are 16 KiB of payload; Triton's CPU interpreter runs one program at a
# time, so there few large ones
_BLOCK = 128
_INTERPRETED_BLOCK = 1024


def _rows_of(payload: torch.Tensor, scales: torch.Tensor) -> int:
    """Rows of a contiguous payload (..., D) whose scales are (...,), contiguous; raises otherwise."""
    if (payload.dtype != PAYLOAD_DTYPE or scales.dtype != SCALE_DTYPE or payload.shape[:-1] != scales.shape
            or not (payload.is_contiguous() and scales.is_contiguous())):
        raise ValueError(f"an FP8 payload is a contiguous {PAYLOAD_DTYPE} (..., D) tensor with contiguous "
                         f"{SCALE_DTYPE} scales (...,); got {payload.dtype} {tuple(payload.shape)} and {scales.dtype} "
                         f"{tuple(scales.shape)}")
    return scales.numel()


def _grid(rows: int, device: torch.device) -> tuple[tuple[int], int]:
    block = _BLOCK if device.type == "cuda" else _INTERPRETED_BLOCK
    return (triton.cdiv(rows, block),), block


def quantize(x: torch.Tensor, payload: torch.Tensor, scales: torch.Tensor) -> None:
    """x (..., D), contiguous, into `payload` (its shape, e4m3) and `scales` (x.shape[:-1], float32), by rows of D:
    what the store kernels send, for a caller that holds the values whole (tests, benchmarks)."""
    rows = _rows_of(payload, scales)
    if x.shape != payload.shape or not x.is_contiguous():
        raise ValueError(f"quantize: x {tuple(x.shape)} must be contiguous, of the payload's shape "
                         f"{tuple(payload.shape)}")
    grid, block = _grid(rows, x.device)
    _quantize_kernel[grid](x, payload, scales, rows, D=x.shape[-1], BLOCK=block)


def dequantize(payload: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new `dtype` tensor of the payload's values (payload (..., D) e4m3, scales (...,) float32)."""
    rows = _rows_of(payload, scales)
    out = torch.empty(payload.shape, dtype=dtype, device=payload.device)
    grid, block = _grid(rows, payload.device)
    _dequantize_kernel[grid](payload, scales, out, rows, D=payload.shape[-1], BLOCK=block)
    return out
