"""The quantized operands of FP8 attention (kernels/attention.py with fp8=True), made by one small kernel per
tensor before the attention kernel runs. As SageAttention2 does, q·kᵀ runs in INT8 and p·v in FP8 e4m3, both
with float32 scales and float32 sums across key tiles:

- q: INT8, one scale per query tile (BLOCK_M rows of one head), the tile's largest |q| mapped to 127;
- k: smoothed first: each (batch, key head) loses its mean key over the attended keys. A vector subtracted from
  every key moves each query's scores by one constant, which the softmax ignores, and the component all keys
  share (large in DiT keys) no longer spends the INT8 range. Then INT8 with one scale per key tile. The
  log-sum-exp is not invariant: each query's q · mean (`q_shift`, float32, from the unquantized q) is added back
  to it, so ring steps' and splits' partial results still merge exactly;
- v: smoothed too (its mean over the attended keys, `v_mean`, comes back as a term of the output: the softmax's
  weights sum to one), then e4m3 with one scale per channel (it factors out of p·v: applied once to the output),
  stored channel-major (each channel's keys contiguous), the operand layout Hopper's FP8 tensor-core
  instructions take for p·v; for the Hopper kernel, each 32-key slice in the order its p·v takes the weights
  (OPERAND_KEY_ORDER), padding keys zeros.

INT8 rather than e4m3 for q·kᵀ, at the same tensor-core rate: a tile's INT8 step is 1/127 of its largest value,
four times finer than e4m3's relative step (1/8, its 3 mantissa bits) for a value a quarter that size.
Quantizing in a separate pass (rather than in the attention kernel's loads) reads each input once instead of once
per query tile, and leaves the attention kernel's loop as it was, reading 8-bit tiles and one scale per tile."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention_args import QuantizedOperands, Strides, ValueOrder
from .fp8 import E4M3_MAX, to_e4m3

# the kernels' constants (the host reads their `.value`)
INT8_MAX = tl.constexpr(127.0)
# the smallest range a scale covers: a tile of smaller values (zeros, say: one key, smoothed) quantizes on a step
# still far from float32's underflow, so that a query tile's and a key tile's scales multiplied leave masked keys'
# scores (attention.py: a large negative times that product) negligible
SMALLEST_RANGE = tl.constexpr(1e-4)
CHANNEL_ALIGN = 16  # channel-major v rows are padded to whole 16-byte vectors
# Hopper's FP8 p·v takes its register operand as four consecutive keys a register, where the q·kᵀ accumulator holds
# each thread's scores as key pairs 8 apart. The Hopper kernel relabels each 32-key slice of a score tile, viewed as
# (16s, 8s, 4s and 2s, 1s), in the order (16s, 4s and 2s, 8s, 1s): the relabelled tile's register layout is then
# the operand's, and the weights need no shuffling. The values' keys follow that order (quantize's operand_order).
OPERAND_KEY_SLICE = (2, 2, 4, 2)
OPERAND_KEY_ORDER = (0, 2, 1, 3)
SLICE_KEYS = tl.constexpr(math.prod(OPERAND_KEY_SLICE))
_TILE_SLICE = tl.constexpr(list(OPERAND_KEY_SLICE))
_TILE_DIMS = tl.constexpr([0, 1] + [d + 2 for d in OPERAND_KEY_ORDER])  # of a (rows, slices) + slice view
SCORE_OFFSET = tl.constexpr(12582912.0)  # 1.5 * 2^23, what offset_scores adds
LOG2_E4M3_MAX = tl.constexpr(math.log2(E4M3_MAX.value))  # FP8's p is scaled onto e4m3's range in its exponent


@triton.jit
def to_operand_order(x):
    """A (rows, keys) tile, keys a multiple of 32, with each 32-key slice's keys relabelled into OPERAND_KEY_ORDER:
    the Hopper kernel's scores before its p·v, the quantization pass's value rows."""
    ROWS: tl.constexpr = x.shape[0]
    KEYS: tl.constexpr = x.shape[1]
    x = tl.permute(tl.reshape(x, [ROWS, KEYS // SLICE_KEYS] + _TILE_SLICE), _TILE_DIMS.value)
    return tl.reshape(x, [ROWS, KEYS])


@triton.jit
def offset_scores(x):
    """int32 x, |x| < 2^22, as the float32 SCORE_OFFSET + x, exactly, with one integer add: x's bits added to those
    of 1.5 * 2^23 (q·kᵀ of INT8 q and k over 128 channels stays below 2^21). softmax_weights takes the offset out
    once a row instead of once a score."""
    return (x + 0x4B400000).to(tl.float32, bitcast=True)


@triton.jit
def softmax_weights(scores, m_i, scale, SHIFT: tl.constexpr, FP8: tl.constexpr):
    """Online-softmax step in base 2 for a (rows, keys) score tile: the weights 2^(scores * scale - m + SHIFT),
    the new row maxima m and the factor that rescales what was accumulated under the old ones, m_i. The scale is
    applied to the row maxima and folded into the exponent's argument: one fused multiply-add per score.
    FP8's scores carry SCORE_OFFSET (offset_scores), which goes into each row's subtrahend instead: the scale loses
    its last two mantissa bits (a relative change below 2^-22), so that the offset times it is exact, and m is
    what the rounded subtrahend stands for: the weights, their sums and m agree to float32's precision of m."""
    if FP8:
        scale = (scale.to(tl.int32, bitcast=True) & -4).to(tl.float32, bitcast=True)
        m_new = tl.maximum(m_i, (tl.max(scores, 1) - SCORE_OFFSET) * scale)
        offset = SCORE_OFFSET * scale
        subtrahend = (m_new - SHIFT) + offset
        m_new = (subtrahend - offset) + SHIFT
    else:
        m_new = tl.maximum(m_i, tl.max(scores, 1) * scale)
        subtrahend = m_new - SHIFT
    scales, scores = tl.broadcast(scale, scores)
    subtrahends, scores = tl.broadcast(tl.expand_dims(subtrahend, 1), scores)
    p = tl.math.exp2(tl.math.fma(scores, scales, -subtrahends))
    return p, m_new, tl.math.exp2(m_i - m_new)


@triton.jit
def key_tile_scale(qk_scale, k_scales, start_n, BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """The scores' scale for the key tile at `start_n`: with FP8, times that tile's key scale."""
    if FP8:
        return qk_scale * tl.load(k_scales + start_n // BLOCK_N)
    return qk_scale


@triton.jit
def _quantize_kernel(X, Out, Scale, Mean, Shift, x_strides, o_strides, o_channel, rows, out_rows, heads, kv_group,
                     HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, SMOOTH: tl.constexpr, SHIFT: tl.constexpr,
                     VALUES: tl.constexpr, REORDER: tl.constexpr):
    """One tile of BLOCK rows of one (batch, head) of Out (element strides o_strides, o_channel between channels)
    from rows [0, rows) of X (B, S, H, D): INT8 with the tile's scale stored into Scale (B, H, tiles), or with
    VALUES, e4m3 with the channels' scales Scale (B, H, D), Out's rows [0, out_rows) written whole (zeros past
    the rows). REORDER: each 32-row slice of Out holds X's rows in the Hopper kernel's operand order. SMOOTH: minus
    Mean (B, H, D) first. SHIFT: Shift (B, H, rows) gets each row's dot product with its key head's Mean
    (B, H / kv_group, D)."""
    tile = tl.program_id(0)
    bh = tl.program_id(1)
    batch = (bh // heads).to(tl.int64)
    h = bh % heads
    out_offs = tile * BLOCK + tl.arange(0, BLOCK)
    offs = out_offs
    if REORDER:  # the rows in the operand's order: the tile's row indices, relabelled
        offs = tile * BLOCK + tl.reshape(to_operand_order(tl.reshape(tl.arange(0, BLOCK), [1, BLOCK])), [BLOCK])
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs < rows
    x = tl.load(X + batch * x_strides.batch + h * x_strides.head + offs[:, None] * x_strides.seq + offs_d[None, :],
                mask=ok[:, None], other=0.0).to(tl.float32)
    if SMOOTH:  # rows past the tensor stay zeros: they must not widen the tile's range
        x = tl.where(ok[:, None], x - tl.load(Mean + bh.to(tl.int64) * HEAD_DIM + offs_d)[None, :], 0.0)
    if SHIFT:
        key_head = batch * (heads // kv_group) + h // kv_group
        mean = tl.load(Mean + key_head * HEAD_DIM + offs_d)
        tl.store(Shift + bh.to(tl.int64) * rows + offs, tl.sum(x * mean[None, :], 1), mask=ok)
    at = (batch * o_strides.batch + h * o_strides.head + out_offs[:, None] * o_strides.seq
          + offs_d[None, :] * o_channel)
    if VALUES:
        scale = tl.load(Scale + bh.to(tl.int64) * HEAD_DIM + offs_d)[None, :]
        tl.store(Out + at, to_e4m3(x / scale), mask=(out_offs < out_rows)[:, None])
    else:
        scale = tl.maximum(tl.max(tl.max(tl.abs(x), 1), 0), SMALLEST_RANGE) / INT8_MAX
        tl.store(Scale + bh.to(tl.int64) * tl.num_programs(0) + tile, scale)
        scaled = x / scale
        # to the nearest integer, halves away from zero (the conversion truncates)
        tl.store(Out + at, tl.where(scaled < 0, scaled - 0.5, scaled + 0.5).to(tl.int8), mask=ok[:, None])


def _heads_major(t: torch.Tensor, rows: int) -> torch.Tensor:
    """An INT8 (B, rows, H, D) view of new (B, H, rows, D) memory: each head's tiles contiguous."""
    batch, _, heads, head_dim = t.shape
    return torch.empty(batch, heads, rows, head_dim, device=t.device, dtype=torch.int8).transpose(1, 2)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int, block_m: int, block_n: int,
             operand_order: bool = False, warmup: bool = False) -> QuantizedOperands:
    """q (B, Sq, H, D), and keys [0, kv_len) of k and v (B, Skv, H_kv, D), as FP8 attention's operands for
    query tiles of `block_m` rows and key tiles of `block_n`. `operand_order`: each 32-key slice of the values in
    the Hopper kernel's operand order (OPERAND_KEY_ORDER; block_n a multiple of 32), else in key order. `warmup`
    only compiles the kernel for the active driver's target (the CPU tests compile for sm_90a without a GPU)."""
    if operand_order and block_n % SLICE_KEYS.value:
        raise ValueError(f"values in the operand's key order come in tiles of whole {SLICE_KEYS.value}-key slices, got "
                         f"{block_n}-key tiles")
    batch, q_len, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    keys, values = k[:, :kv_len], v[:, :kv_len]
    k_mean, v_mean = (torch.mean(t, dim=1, dtype=torch.float32) for t in (keys, values))  # (B, H_kv, D)
    low, high = torch.aminmax(values, dim=1)
    v_range = torch.maximum(v_mean - low.float(), high.float() - v_mean)  # each channel's largest |v - mean|
    v_scale = v_range.clamp_min(SMALLEST_RANGE.value) / E4M3_MAX.value
    q8, k8 = _heads_major(q, q_len), _heads_major(k, kv_len)
    # reordered, a slice's keys may land anywhere in it: whole slices
    align = SLICE_KEYS.value if operand_order else CHANNEL_ALIGN
    channel_rows = triton.cdiv(kv_len, align) * align
    # the padding keys are written as zeros (the Hopper kernel loads whole tiles: uninitialised bytes could be
    # e4m3's NaN, which a zero weight does not cancel)
    v8 = torch.empty(batch, kv_heads, head_dim, channel_rows, device=v.device, dtype=torch.float8_e4m3fn)
    q_scale = torch.empty(batch, heads, triton.cdiv(q_len, block_m), device=q.device, dtype=torch.float32)
    k_scale = torch.empty(batch, kv_heads, triton.cdiv(kv_len, block_n), device=q.device, dtype=torch.float32)
    q_shift = torch.empty(batch, heads, q_len, device=q.device, dtype=torch.float32)

    def launch(x: torch.Tensor, out: torch.Tensor, rows: int, x_heads: int, scale: torch.Tensor, mean: torch.Tensor,
               block: int, out_strides: Strides, o_channel: int, smooth: bool = False, shift: bool = False,
               values: bool = False) -> None:
        out_rows = out.shape[-1] if values else rows
        args = (x, out, scale, mean, q_shift, Strides.of(x), out_strides, o_channel, rows, out_rows, x_heads,
                heads // kv_heads)
        switches = dict(HEAD_DIM=head_dim, BLOCK=block, SMOOTH=smooth, SHIFT=shift, VALUES=values,
                        REORDER=values and operand_order, num_warps=4)
        grid = (triton.cdiv(out_rows, block), batch * x_heads)
        if warmup:
            _quantize_kernel.warmup(*args, grid=grid, **switches)
        else:
            _quantize_kernel[grid](*args, **switches)

    launch(q, q8, q_len, heads, q_scale, k_mean, block_m, Strides.of(q8), 1, shift=True)
    launch(keys, k8, kv_len, kv_heads, k_scale, k_mean, block_n, Strides.of(k8), 1, smooth=True)
    launch(values, v8, kv_len, kv_heads, v_scale, v_mean, block_n, Strides(v8.stride(0), 1, v8.stride(1)),
           v8.stride(2), smooth=True, values=True)
    return QuantizedOperands(q8, k8, v8, Strides.of(q8), Strides.of(k8),
                             Strides(v8.stride(0), v8.stride(2), v8.stride(1)), q_scale, k_scale, v_scale, v_mean,
                             q_shift, ValueOrder.OPERAND if operand_order else ValueOrder.KEYS)
