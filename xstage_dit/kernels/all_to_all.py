"""The Ulysses pre-attention all-to-all as a store kernel: a rank writes its q, k or v, (B, T + L, H, D), straight
into every destination rank's head-sharded buffer, (B, T + N*L, H/N, D): its L sequence rows of head chunk j go to
rank j at the rows of its own tokens (the transpose folded into the stores), and its T replicated text rows of its
own head chunk go to its own buffer's first rows. Destinations are a table of element offsets from this rank's own
buffer `base` (kernels/tables.py: symmetric-memory peers, or local buffers in loopback), all with the strides of
`base`.

The tokens are read as the caller holds them (`JointTokens`): up to two parts joined on the way, and, where the
caller asks for it, each head vector normalised by its part's RMSNorm and rotated (rotary.norm_rotate's
arithmetic), so that a joint-attention prologue costs no pass of its own.

Given the scale buffers of an FP8 payload (`PayloadScales`), each head vector is quantized in registers right
before its store (kernels/fp8.py): the destination buffers are e4m3, half the bytes of bf16 on the wire."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_args import Destinations, PayloadScales, Strides, StoreRows
from .fp8 import PAYLOAD_DTYPE, quantize_rows
from .rotary import joined_rows, part_normed, rotated
from .rotary_args import JointTokens, PartArgs, RotaryTables
from .tables import ALIGN_ELEMENTS

# rows of one head per program: plain copies move 16 KiB of bf16 per program; with the norm and rotation the
# float32 tile and its (cos, sin) rows are held too, in half as many rows
PLAIN_BLOCK = 64
NORM_ROPE_BLOCK = 32
# Triton's CPU interpreter runs one program at a time: few large programs
INTERPRETED_BLOCK = 256


@triton.jit
def _store_heads_kernel(first, second, first_rows, rows, heads, tables, dest, store_rows, scales,
                        HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, NORM_ROPE: tl.constexpr,
                        FP8: tl.constexpr):
    """`first` and `second`: PartArgs records (with their norms and `tables`, a RotaryTables record, where
    NORM_ROPE; else None); `dest` a Destinations record, `store_rows` a StoreRows record; `scales` a PayloadScales
    record where FP8 (else None)."""
    # one program: BLOCK joined rows of one (batch, head)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // heads).to(tl.int64)
    head = pid_bh % heads
    owner = head // dest.heads_per_rank
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    is_text = (row >= store_rows.text_start) & (row < store_rows.text_start + store_rows.text_rows)
    # every rank holds the text: it keeps the rows of its own heads
    ok = ((row < rows) & (~is_text | (owner == dest.rank)))[:, None]
    row = row.to(tl.int64)
    x = joined_rows(first, second, first_rows, batch, row, head, ok, HEAD_DIM)
    if NORM_ROPE:
        normed = part_normed(x, first, second, row, first_rows, ok, HEAD_DIM)
        x = rotated(normed, tables, row, ok, BLOCK, HEAD_DIM).to(x.dtype)
    _store_tile(x, dest, store_rows, scales, batch, head, row, is_text, ok, HEAD_DIM, ALIGN, FP8)


@triton.jit
def _store_tokens_kernel(part, tables, dest, store_rows, scales, rows, heads,
                         HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, FP8: tl.constexpr):
    """`part`: a PartArgs record whose norm spans a token's every head (weight (heads * HEAD_DIM,)); `tables` a
    RotaryTables record, `dest` a Destinations record, `store_rows` a StoreRows record, `scales` a PayloadScales
    record where FP8 (else None)."""
    # one program: BLOCK tokens of one batch, every head (the RMSNorm spans a token's whole vector): a first pass
    # over the heads sums the squares, a second (from cache) normalises, rotates and stores each head
    batch = tl.program_id(1).to(tl.int64)
    row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)[None, :]
    is_text = (row >= store_rows.text_start) & (row < store_rows.text_start + store_rows.text_rows)
    in_rows = (row < rows)[:, None]
    row = row.to(tl.int64)
    at = part.tokens + batch * part.strides.batch + row[:, None] * part.strides.seq + d
    squares = tl.zeros([BLOCK], dtype=tl.float32)
    for head in range(heads):
        x = tl.load(at + head * part.strides.head, mask=in_rows, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, axis=1)
    inverse_rms = tl.math.rsqrt(squares / (heads * HEAD_DIM) + part.eps)
    for head in range(heads):
        x = tl.load(at + head * part.strides.head, mask=in_rows, other=0.0)
        # the weight read as a whole (rows, head_dim) tile (cached), so that everything shares one layout
        weight = tl.load(part.weight + head * HEAD_DIM + d + 0 * row[:, None], mask=in_rows, other=0.0)
        normed = (x.to(tl.float32) * inverse_rms[:, None] * weight.to(tl.float32)).to(x.dtype).to(tl.float32)
        x = rotated(normed, tables, row, in_rows, BLOCK, HEAD_DIM).to(x.dtype)
        # every rank holds the text: it keeps the rows of its own heads
        ok = in_rows & (~is_text | (head // dest.heads_per_rank == dest.rank))[:, None]
        _store_tile(x, dest, store_rows, scales, batch, head, row, is_text, ok, HEAD_DIM, ALIGN, FP8)


@triton.jit
def _store_tile(x, dest, store_rows, scales, batch, head, row, is_text, ok, HEAD_DIM: tl.constexpr,
                ALIGN: tl.constexpr, FP8: tl.constexpr):
    """Store the tile x, rows `row` of head `head`: text rows to this rank's own buffer (their owner, where
    `ok` lets them through), sequence rows to the head chunk's owner after its text; where FP8, as e4m3 with each
    row's scale stored alike into the owner's scale buffer."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    sequence_row = tl.where(row < store_rows.text_start, row, row - store_rows.text_rows)
    to_row = tl.where(is_text, row - store_rows.text_start, store_rows.sequence_row0 + sequence_row)[:, None]
    owner = head // dest.heads_per_rank
    to_rank = tl.multiple_of(tl.load(dest.offsets + owner), ALIGN)
    at = dest.base + to_rank + batch * dest.strides.batch + (head % dest.heads_per_rank) * dest.strides.head
    if FP8:
        x, row_scales = quantize_rows(x)
        tl.store(scales.base + tl.load(scales.offsets + owner) + batch * scales.strides.batch
                 + (head % dest.heads_per_rank) * scales.strides.head + to_row * scales.strides.seq,
                 row_scales[:, None], mask=ok)
    tl.store(at + to_row * dest.strides.seq + d, x, mask=ok)


def store_heads(tokens: JointTokens, rows: StoreRows, offsets: torch.Tensor, base: torch.Tensor, rank: int,
                scales: PayloadScales | None = None, warmup: bool = False) -> None:
    """Store the joined `tokens` (B, T + L, H, D) as `rows` says: head chunk j of the sequence rows to rank j's
    buffer, `offsets[j]` elements from `base` (this rank's own buffer, (B, rows, H/N, D), which gives the strides);
    the text rows of this rank's own chunk to `base`. `scales`: `base` is an FP8 payload (e4m3) whose row scales go
    there. `warmup` only compiles the kernel for the active driver's target."""
    batch, joined, heads, head_dim = tokens.joined_shape
    n_dest = offsets.numel()
    if heads % n_dest or any(part.stride(-1) != 1 for part in tokens.parts) or len(tokens.parts) > 2:
        raise ValueError(f"store_heads: {heads} heads over {n_dest} ranks, {len(tokens.parts)} parts (at most "
                         "2), head_dim axis must be contiguous")
    if (base.dtype == PAYLOAD_DTYPE) != (scales is not None):
        raise ValueError(f"store_heads: an {PAYLOAD_DTYPE} buffer takes the scale buffers of its rows, any other "
                         f"none; got {base.dtype} with{'out' if scales is None else ''} scales")
    dest = Destinations(base=base, offsets=offsets, strides=Strides.of(base), heads_per_rank=heads // n_dest,
                        rank=rank)
    norm_rope = tokens.norm_rope
    if norm_rope is not None and norm_rope.across_heads:
        _store_tokens(tokens, rows, dest, scales, warmup)
        return
    block = PLAIN_BLOCK if norm_rope is None else NORM_ROPE_BLOCK
    block = block if base.is_cuda or warmup else INTERPRETED_BLOCK
    first, second = tokens.end_args()
    tables = None if norm_rope is None else RotaryTables.of(norm_rope.cos, norm_rope.sin)
    # no FMA contraction in the rotation, as rotary.norm_rotate computes it
    _launch(_store_heads_kernel, (triton.cdiv(joined, block), batch * heads), warmup, first=first, second=second,
            first_rows=first.tokens.shape[1], rows=joined, heads=heads, tables=tables, dest=dest, store_rows=rows,
            scales=scales, HEAD_DIM=head_dim, BLOCK=block, ALIGN=ALIGN_ELEMENTS, NORM_ROPE=norm_rope is not None,
            FP8=scales is not None, num_warps=4, enable_fp_fusion=False)


def _store_tokens(tokens: JointTokens, rows: StoreRows, dest: Destinations, scales: PayloadScales | None,
                  warmup: bool) -> None:
    """`store_heads` with a norm across heads (one part)."""
    if len(tokens.parts) != 1:
        raise ValueError(f"store_heads: a norm across heads takes one part, not {len(tokens.parts)}")
    (x,), norm_rope = tokens.parts, tokens.norm_rope
    batch, joined, heads, head_dim = x.shape
    block = NORM_ROPE_BLOCK if dest.base.is_cuda or warmup else INTERPRETED_BLOCK
    # no FMA contraction in the rotation, as rotary.rotate computes it
    _launch(_store_tokens_kernel, (triton.cdiv(joined, block), batch), warmup,
            part=PartArgs.of(x, norm_rope.weights[0], norm_rope.eps[0]),
            tables=RotaryTables.of(norm_rope.cos, norm_rope.sin), dest=dest, store_rows=rows, scales=scales,
            rows=joined, heads=heads, HEAD_DIM=head_dim, BLOCK=block, ALIGN=ALIGN_ELEMENTS, FP8=scales is not None,
            num_warps=4, enable_fp_fusion=False)


def _launch(kernel: triton.runtime.JITFunction, grid: tuple[int, int], warmup: bool, **args: object) -> None:
    """`kernel` over `grid`, its arguments and switches by name; or with `warmup` only compiled for the active
    driver."""
    if warmup:
        kernel.warmup(grid=grid, **args)
    else:
        kernel[grid](**args)
