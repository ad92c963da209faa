"""Rotary position embedding on interleaved pairs, in one pass over the tensor.

out[..., 2i] = x[2i] cos[2i] - x[2i+1] sin[2i];  out[..., 2i+1] = x[2i+1] cos[2i+1] + x[2i] sin[2i+1]

in float32, rounded once to x's dtype: diffusers' `apply_rotary_emb(use_real=True, use_real_unbind_dim=-1)`
computes the same with nine kernels over float32 temporaries (over ten times the bytes of x moved);
this kernel reads x and the tables once and writes the result once."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ELEMENTS_PER_PROGRAM = 4096  # rows x head_dim per program: 8 KiB of bf16 in, 8 KiB out
_MAX_ROWS = 2**31 - ELEMENTS_PER_PROGRAM  # row indices are int32 in the kernel


@triton.jit
def _rotary_kernel(X, Cos, Sin, Out, rows, seq, heads,
                   stride_xb, stride_xs, stride_xh, stride_ob, stride_os, stride_oh, stride_cs,
                   HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    # a row is one (batch, token, head) vector; consecutive rows are the heads of one token (they share its
    # cos/sin row in cache)
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    ok = (row < rows)[:, None]
    h = (row % heads).to(tl.int64)
    s = ((row // heads) % seq).to(tl.int64)
    b = (row // (heads * seq)).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)[None, :]
    x = tl.load(X + (b * stride_xb + s * stride_xs + h * stride_xh)[:, None] + d, mask=ok, other=0.0)
    cos = tl.load(Cos + (s * stride_cs)[:, None] + d, mask=ok, other=0.0)
    sin = tl.load(Sin + (s * stride_cs)[:, None] + d, mask=ok, other=0.0)
    even, odd = tl.split(tl.reshape(x.to(tl.float32), [BLOCK_ROWS, HEAD_DIM // 2, 2]))
    rotated = tl.reshape(tl.join(-odd, even), [BLOCK_ROWS, HEAD_DIM])  # the pair (x0, x1) turned to (-x1, x0)
    out = x.to(tl.float32) * cos + rotated * sin  # launched without FMA contraction: rounded as diffusers rounds
    tl.store(Out + (b * stride_ob + s * stride_os + h * stride_oh)[:, None] + d, out.to(Out.dtype.element_ty),
             mask=ok)


def rotary_accepts(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> bool:
    """Whether `rotary_interleaved` runs these inputs: a 4-D x with a power-of-two head_dim (last, contiguous)
    and float32 (S, head_dim) tables for its S tokens, on x's device."""
    # checked on every routed call: plain comparisons, cheap on the host
    head_dim = x.shape[-1]
    return (x.dim() == 4 and sequence_dim in (1, 2) and x.dtype in _DTYPES and x.stride(-1) == 1
            and head_dim >= 2 and head_dim & (head_dim - 1) == 0 and x.numel() // head_dim < _MAX_ROWS
            and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.shape == sin.shape == (x.shape[sequence_dim], head_dim)
            and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and cos.device == x.device and sin.device == x.device)


def rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int) -> torch.Tensor:
    """x rotated by (cos, sin) on interleaved pairs: x is (B, S, H, D) for sequence_dim 1, (B, H, S, D) for 2;
    cos and sin are (S, D) float32. Returns a new tensor of x's shape and dtype (and strides, where x is dense).
    Raises ValueError for inputs `rotary_accepts` refuses."""
    if not rotary_accepts(x, cos, sin, sequence_dim):
        raise ValueError(f"rotary_interleaved: unsupported inputs x {tuple(x.shape)} {x.dtype} (sequence dim "
                         f"{sequence_dim}), tables {tuple(cos.shape)} {cos.dtype}")
    return rotate(x, cos, sin, sequence_dim)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sequence_dim: int,
           warmup: bool = False) -> torch.Tensor:
    """`rotary_interleaved` for inputs the caller already checked with `rotary_accepts` (the router checks once per
    call: host time counts there). `warmup` only compiles the kernel for the active driver's target."""
    out = torch.empty_like(x)
    # the kernel walks (batch, token, head) rows
    x_bshd, out_bshd = (x, out) if sequence_dim == 1 else (x.transpose(1, 2), out.transpose(1, 2))
    batch, seq, heads, head_dim = x_bshd.shape
    rows = batch * seq * heads
    block_rows = max(1, ELEMENTS_PER_PROGRAM // head_dim)
    grid = (triton.cdiv(rows, block_rows),)
    args = (x_bshd, cos, sin, out_bshd, rows, seq, heads, *x_bshd.stride()[:3], *out_bshd.stride()[:3],
            cos.stride(0))
    # no FMA contraction: x cos and rotated sin are rounded to float32 before the sum, as in diffusers' code
    switches = dict(HEAD_DIM=head_dim, BLOCK_ROWS=block_rows, num_warps=4, enable_fp_fusion=False)
    if warmup:
        _rotary_kernel.warmup(*args, grid=grid, **switches)
    else:
        _rotary_kernel[grid](*args, **switches)
    return out
