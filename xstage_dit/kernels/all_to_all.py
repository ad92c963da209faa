"""The Ulysses pre-attention all-to-all as a store kernel: a rank writes its q, k or v, (B, T + L, H, D), straight
into every destination rank's head-sharded buffer, (B, T + N*L, H/N, D): its L sequence rows of head chunk j go to
rank j at the rows of its own tokens (the transpose folded into the stores), and its T replicated text rows of its
own head chunk go to its own buffer's first rows. Destinations are a table of element offsets from this rank's own
buffer `base` (kernels/tables.py: symmetric-memory peers, or local buffers in loopback), all with the strides of
`base`.

The tokens are read as the caller holds them (`JointTokens`): up to two parts joined on the way, and, where the
caller asks for it, each head vector normalised by its part's RMSNorm and rotated (rotary.norm_rotate's
arithmetic), so that a joint-attention prologue costs no pass of its own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_args import StoreRows
from .rotary import joined_rows, part_normed, rotated
from .rotary_args import JointTokens, NormRope
from .tables import ALIGN_ELEMENTS

# rows of one head per program: plain copies move 16 KiB of bf16 per program; with the norm and rotation the
# float32 tile and its (cos, sin) rows are held too, in half as many rows
PLAIN_BLOCK = 64
NORM_ROPE_BLOCK = 32
# Triton's CPU interpreter runs one program at a time: few large programs
INTERPRETED_BLOCK = 256


@triton.jit
def _store_heads_kernel(
    First, Second, FirstWeight, SecondWeight, Cos, Sin, Offsets, Base,
    first_rows, rows, heads, heads_per_rank, rank, text_start, text_rows, sequence_row0, first_eps, second_eps,
    stride_fb, stride_fs, stride_fh, stride_sb, stride_ss, stride_sh,
    stride_db, stride_ds, stride_dh, stride_cs,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, NORM_ROPE: tl.constexpr,
):
    # one program: BLOCK joined rows of one (batch, head)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // heads).to(tl.int64)
    head = pid_bh % heads
    owner = head // heads_per_rank
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_text = (row >= text_start) & (row < text_start + text_rows)
    # every rank holds the text: it keeps the rows of its own heads
    ok = ((row < rows) & (~is_text | (owner == rank)))[:, None]
    row = row.to(tl.int64)
    x = joined_rows(First, Second, first_rows, batch, row, head, ok, stride_fb, stride_fs, stride_fh, stride_sb,
                    stride_ss, stride_sh, HEAD_DIM)
    if NORM_ROPE:
        normed = part_normed(x, FirstWeight, SecondWeight, first_eps, second_eps, row, first_rows, ok, HEAD_DIM)
        x = rotated(normed, Cos, Sin, row, ok, stride_cs, BLOCK, HEAD_DIM).to(x.dtype)
    _store_rows(x, Base, Offsets, batch, head, row, is_text, ok, text_start, text_rows, sequence_row0,
                heads_per_rank, stride_db, stride_ds, stride_dh, HEAD_DIM, ALIGN)


@triton.jit
def _store_tokens_kernel(
    X, Weight, Cos, Sin, Offsets, Base,
    rows, heads, heads_per_rank, rank, text_start, text_rows, sequence_row0, eps,
    stride_xb, stride_xs, stride_xh, stride_db, stride_ds, stride_dh, stride_cs,
    HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
):
    # one program: BLOCK tokens of one batch, every head (the RMSNorm spans a token's whole vector): a first pass
    # over the heads sums the squares, a second (from cache) normalises, rotates and stores each head
    batch = tl.program_id(1).to(tl.int64)
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)[None, :]
    is_text = (row >= text_start) & (row < text_start + text_rows)
    in_rows = (row < rows)[:, None]
    row = row.to(tl.int64)
    at = X + batch * stride_xb + row[:, None] * stride_xs + d
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for head in range(heads):
        x = tl.load(at + head * stride_xh, mask=in_rows, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    inverse_rms = tl.math.rsqrt(squares / (heads * HEAD_DIM) + eps)
    for head in range(heads):
        x = tl.load(at + head * stride_xh, mask=in_rows, other=0.0)
        # the weight read as a whole (rows, head_dim) tile (cached), so that everything shares one layout
        weight = tl.load(Weight + head * HEAD_DIM + d + 0 * row[:, None], mask=in_rows, other=0.0)
        normed = (x.to(tl.float32) * inverse_rms[:, None] * weight.to(tl.float32)).to(x.dtype).to(tl.float32)
        x = rotated(normed, Cos, Sin, row, in_rows, stride_cs, BLOCK, HEAD_DIM).to(x.dtype)
        # every rank holds the text: it keeps the rows of its own heads
        ok = in_rows & (~is_text | (head // heads_per_rank == rank))[:, None]
        _store_rows(x, Base, Offsets, batch, head, row, is_text, ok, text_start, text_rows, sequence_row0,
                    heads_per_rank, stride_db, stride_ds, stride_dh, HEAD_DIM, ALIGN)


@triton.jit
def _store_rows(x, Base, Offsets, batch, head, row, is_text, ok, text_start, text_rows, sequence_row0,
                heads_per_rank, stride_db, stride_ds, stride_dh, HEAD_DIM: tl.constexpr, ALIGN: tl.constexpr):
    """Store the tile x, rows `row` of head `head`: text rows to this rank's own buffer (their owner, where
    `ok` lets them through), sequence rows to the head chunk's owner after its text."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    sequence_row = tl.where(row < text_start, row, row - text_rows)
    to_row = tl.where(is_text, row - text_start, sequence_row0 + sequence_row)
    to_rank = tl.multiple_of(tl.load(Offsets + head // heads_per_rank), ALIGN)
    tl.store(Base + to_rank + batch * stride_db + (head % heads_per_rank) * stride_dh + to_row[:, None] * stride_ds
             + d, x, mask=ok)


def store_heads(tokens: JointTokens, rows: StoreRows, offsets: torch.Tensor, base: torch.Tensor, rank: int,
                warmup: bool = False) -> None:
    """Store the joined `tokens` (B, T + L, H, D) as `rows` says: head chunk j of the sequence rows to rank j's
    buffer, `offsets[j]` elements from `base` (this rank's own buffer, (B, rows, H/N, D), which gives the strides);
    the text rows of this rank's own chunk to `base`. `warmup` only compiles the kernel for the active driver's
    target."""
    first, second = tokens.parts[0], tokens.parts[-1]
    batch, joined, heads, head_dim = tokens.joined_shape
    n_dest = offsets.numel()
    if heads % n_dest or any(part.stride(-1) != 1 for part in tokens.parts) or len(tokens.parts) > 2:
        raise ValueError(f"store_heads: {heads} heads over {n_dest} ranks, {len(tokens.parts)} parts (at most "
                         "2), head_dim axis must be contiguous")
    norm_rope = tokens.norm_rope
    if norm_rope is not None and norm_rope.across_heads:
        _store_tokens(tokens, rows, offsets, base, rank, warmup)
        return
    if norm_rope is None:  # the prologue's arguments go unread
        norm_rope = NormRope((first,), (0.0,), first, first)
        block = PLAIN_BLOCK
    else:
        block = NORM_ROPE_BLOCK
    block = block if base.is_cuda or warmup else INTERPRETED_BLOCK
    weights, eps = norm_rope.weights, norm_rope.eps
    grid = (triton.cdiv(joined, block), batch * heads)
    args = (first, second, weights[0], weights[-1], norm_rope.cos, norm_rope.sin, offsets, base,
            first.shape[1], joined, heads, heads // n_dest, rank, rows.text_start, rows.text_rows, rows.sequence_row0,
            eps[0], eps[-1], *first.stride()[:3], *second.stride()[:3], *base.stride()[:3], norm_rope.cos.stride(0))
    # no FMA contraction in the rotation, as rotary.norm_rotate computes it
    switches = dict(HEAD_DIM=head_dim, BLOCK=block, ALIGN=ALIGN_ELEMENTS, NORM_ROPE=tokens.norm_rope is not None,
                    num_warps=4, enable_fp_fusion=False)
    if warmup:
        _store_heads_kernel.warmup(*args, grid=grid, **switches)
    else:
        _store_heads_kernel[grid](*args, **switches)


def _store_tokens(tokens: JointTokens, rows: StoreRows, offsets: torch.Tensor, base: torch.Tensor, rank: int,
                  warmup: bool) -> None:
    """`store_heads` with a norm across heads (one part)."""
    if len(tokens.parts) != 1:
        raise ValueError(f"store_heads: a norm across heads takes one part, not {len(tokens.parts)}")
    (x,), norm_rope = tokens.parts, tokens.norm_rope
    batch, joined, heads, head_dim = x.shape
    block = NORM_ROPE_BLOCK if base.is_cuda or warmup else INTERPRETED_BLOCK
    grid = (triton.cdiv(joined, block), batch)
    args = (x, norm_rope.weights[0], norm_rope.cos, norm_rope.sin, offsets, base, joined, heads,
            heads // offsets.numel(), rank, rows.text_start, rows.text_rows, rows.sequence_row0, norm_rope.eps[0],
            *x.stride()[:3], *base.stride()[:3], norm_rope.cos.stride(0))
    # no FMA contraction in the rotation, as rotary.rotate computes it
    switches = dict(HEAD_DIM=head_dim, BLOCK=block, ALIGN=ALIGN_ELEMENTS, num_warps=4, enable_fp_fusion=False)
    if warmup:
        _store_tokens_kernel.warmup(*args, grid=grid, **switches)
    else:
        _store_tokens_kernel[grid](*args, **switches)
