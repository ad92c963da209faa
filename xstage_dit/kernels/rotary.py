"""Rotary position embedding on interleaved pairs, in one pass over the tensor, alone or after the RMSNorm that
DiTs apply to each head's query and key vectors.

out[..., 2i] = x[2i] cos[2i] - x[2i+1] sin[2i];  out[..., 2i+1] = x[2i+1] cos[2i+1] + x[2i] sin[2i+1]

in float32, rounded once to x's dtype: diffusers' `apply_rotary_emb(use_real=True, use_real_unbind_dim=-1)`
computes the same with nine kernels over float32 temporaries (over ten times the bytes of x moved);
this kernel reads x and the tables once and writes the result once. With the norm, the normalised vector is
rounded to x's dtype first, as the norm module's output is, then rotated; the norm's own pass and the
concatenation of text and image tokens that sits between norm and rotation in a joint-attention processor are
folded into the same read and write."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .attention_args import Strides
from .rotary_args import NormedTokens, RotaryTables

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ELEMENTS_PER_PROGRAM = 4096  # rows x head_dim per program: 8 KiB of bf16 in, 8 KiB out
# Triton's CPU interpreter runs one program at a time, each op a numpy call over the block: few large programs
INTERPRETED_ELEMENTS_PER_PROGRAM = 65536
_MAX_ROWS = 2**31 - INTERPRETED_ELEMENTS_PER_PROGRAM  # row indices are int32 in the kernel


@triton.jit
def _token_rows(rows, seq, heads, BLOCK_ROWS: tl.constexpr):
    """This program's rows: a row is one (batch, token, head) vector; consecutive rows are the heads of one token
    (they share its cos/sin row in cache). Returns (in bounds, batch, token, head), int64 indices."""
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    h = (row % heads).to(tl.int64)
    s = ((row // heads) % seq).to(tl.int64)
    b = (row // (heads * seq)).to(tl.int64)
    return (row < rows)[:, None], b, s, h


@triton.jit
def rotated(x, tables, table_rows, ok, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The float32 (BLOCK_ROWS, HEAD_DIM) rows x rotated by the rows `table_rows` (int64) of `tables` (a
    RotaryTables record). The caller launches without FMA contraction, so that x cos and rotated sin are rounded
    to float32 before the sum, as in diffusers' code."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    cos = tl.load(tables.cos + (table_rows * tables.row_stride)[:, None] + d, mask=ok, other=0.0)
    sin = tl.load(tables.sin + (table_rows * tables.row_stride)[:, None] + d, mask=ok, other=0.0)
    even, odd = tl.split(tl.reshape(x, [BLOCK_ROWS, HEAD_DIM // 2, 2]))
    turned = tl.reshape(tl.join(-odd, even), [BLOCK_ROWS, HEAD_DIM])  # the pair (x0, x1) turned to (-x1, x0)
    return x * cos + turned * sin


@triton.jit
def joined_rows(first, second, first_rows, b, s, h, ok, HEAD_DIM: tl.constexpr):
    """The (rows, HEAD_DIM) tile of rows (batch b, token s, head h) of the parts `first` and `second` (PartArgs
    records) joined along the tokens (token s < first_rows is first's): one load per element, from whichever part
    holds its token."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    first_at = first.tokens + (b * first.strides.batch + s * first.strides.seq + h * first.strides.head)[:, None] + d
    second_at = second.tokens + (b * second.strides.batch + (s - first_rows) * second.strides.seq
                                 + h * second.strides.head)[:, None] + d
    return tl.load(tl.where((s < first_rows)[:, None], first_at, second_at), mask=ok, other=0.0)


@triton.jit
def part_normed(x, first, second, s, first_rows, ok, HEAD_DIM: tl.constexpr):
    """The rows of `joined_rows` normalised by the RMSNorm of their part (its PartArgs' weight (HEAD_DIM,) and
    eps), rounded to x's dtype as the norm module's output is; float32 for what follows."""
    in_first = s < first_rows
    d = tl.arange(0, HEAD_DIM)[None, :]
    # the weights read as whole (rows, HEAD_DIM) tiles (cached), so that everything shares one register layout
    weight = tl.load(tl.where(in_first[:, None], first.weight + d, second.weight + d), mask=ok, other=0.0)
    x32 = x.to(tl.float32)
    inverse_rms = tl.math.rsqrt(tl.sum(x32 * x32, axis=1) / HEAD_DIM + tl.where(in_first, first.eps, second.eps))
    return (x32 * inverse_rms[:, None] * weight.to(tl.float32)).to(x.dtype).to(tl.float32)


@triton.jit
def _rotate_into(x, tables, Out, out_strides, ok, b, s, h, BLOCK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Stores the float32 rows x rotated by their tokens' (cos, sin) rows."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    out = rotated(x, tables, s, ok, BLOCK_ROWS, HEAD_DIM)
    tl.store(Out + (b * out_strides.batch + s * out_strides.seq + h * out_strides.head)[:, None] + d,
             out.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(X, x_strides, tables, Out, out_strides, rows, seq, heads,
                   HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Strides are Strides records (kernels/attention_args.py), `tables` a RotaryTables record."""
    ok, b, s, h = _token_rows(rows, seq, heads, BLOCK_ROWS)
    d = tl.arange(0, HEAD_DIM)[None, :]
    x = tl.load(X + (b * x_strides.batch + s * x_strides.seq + h * x_strides.head)[:, None] + d, mask=ok,
                other=0.0)
    _rotate_into(x.to(tl.float32), tables, Out, out_strides, ok, b, s, h, BLOCK_ROWS, HEAD_DIM)


@triton.jit
def _norm_rope_kernel(first, second, first_len, tables, Out, out_strides, rows, seq, heads,
                      HEAD_DIM: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """`first` and `second` are PartArgs records with their norms, `tables` a RotaryTables record."""
    # rows over the output's tokens: the first `first_len` come from `first` (normalised with its weight), the
    # rest from `second`
    ok, b, s, h = _token_rows(rows, seq, heads, BLOCK_ROWS)
    x = joined_rows(first, second, first_len, b, s, h, ok, HEAD_DIM)
    normed = part_normed(x, first, second, s, first_len, ok, HEAD_DIM)
    _rotate_into(normed, tables, Out, out_strides, ok, b, s, h, BLOCK_ROWS, HEAD_DIM)


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
    batch, seq, heads, _ = x_bshd.shape
    _launch(_rotary_kernel, out_bshd, batch * seq * heads, warmup, X=x_bshd, x_strides=Strides.of(x_bshd),
            tables=RotaryTables.of(cos, sin), seq=seq, heads=heads)
    return out


def _launch(kernel: triton.runtime.JITFunction, out: torch.Tensor, rows: int, warmup: bool, **args: object) -> None:
    """`kernel` over the `rows` (batch, token, head) rows of `out` (B, S, H, D), its other arguments by name; or
    with `warmup` only compiled for the active driver."""
    head_dim = out.shape[-1]
    per_program = ELEMENTS_PER_PROGRAM if out.is_cuda or warmup else INTERPRETED_ELEMENTS_PER_PROGRAM
    block_rows = max(1, per_program // head_dim)
    grid = (triton.cdiv(rows, block_rows),)
    args.update(Out=out, out_strides=Strides.of(out), rows=rows)
    # no FMA contraction: x cos and rotated sin are rounded to float32 before the sum, as in diffusers' code
    switches = dict(HEAD_DIM=head_dim, BLOCK_ROWS=block_rows, num_warps=4, enable_fp_fusion=False)
    if warmup:
        kernel.warmup(grid=grid, **args, **switches)
    else:
        kernel[grid](**args, **switches)


def _like(part: NormedTokens, first: torch.Tensor, head_dim: int) -> bool:
    tokens = part.tokens
    return (tokens.dim() == 4 and tokens.shape[0] == first.shape[0] and tokens.shape[2:] == first.shape[2:]
            and tokens.dtype == first.dtype and tokens.stride(-1) == 1 and tokens.device == first.device
            and part.weight.shape == (head_dim,) and part.weight.stride(-1) == 1
            and part.weight.device == first.device)


def norm_rope_accepts(parts: Sequence[NormedTokens], cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether `norm_rotate` runs these inputs: one or two parts alike but in length, (B, S, H, D) with a
    power-of-two head_dim (last, contiguous), each with a (D,) weight, and float32 (S_total, D) tables, all on
    one device."""
    if len(parts) not in (1, 2):
        return False
    first = parts[0].tokens
    batch, _, heads, head_dim = first.shape if first.dim() == 4 else (0, 0, 0, 0)
    tokens = sum(part.tokens.shape[1] for part in parts)
    return (first.dtype in _DTYPES and head_dim >= 2 and head_dim & (head_dim - 1) == 0
            and batch * tokens * heads < _MAX_ROWS
            and all(_like(part, first, head_dim) for part in parts)
            and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.shape == sin.shape == (tokens, head_dim)
            and cos.stride() == sin.stride() and cos.stride(-1) == 1
            and cos.device == first.device and sin.device == first.device)


def norm_rotate(parts: Sequence[NormedTokens], cos: torch.Tensor, sin: torch.Tensor,
                warmup: bool = False) -> torch.Tensor:
    """The parts' tokens, concatenated along S, each normalised by its RMSNorm and rotated by the tables' rows:
    a new (B, S_total, H, D) tensor of the parts' dtype. For inputs the caller checked with `norm_rope_accepts`;
    `warmup` only compiles the kernel for the active driver's target."""
    first = parts[0].tokens
    batch, _, heads, head_dim = first.shape
    seq = cos.shape[0]
    out = first.new_empty(batch, seq, heads, head_dim)
    # one part is also the last: all its rows come first
    _launch(_norm_rope_kernel, out, batch * seq * heads, warmup, first=parts[0].args(), second=parts[-1].args(),
            first_len=first.shape[1] if len(parts) == 2 else seq, tables=RotaryTables.of(cos, sin), seq=seq,
            heads=heads)
    return out
