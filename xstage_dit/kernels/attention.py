"""Flash attention forward for (batch, seq, heads, head_dim) tensors, its output stored locally, scattered to other
ranks or merged into a running result: the call's epilogue (Store, Scatter, Merge in kernels/attention_args.py).

One program owns one tile of BLOCK_M query rows of one (batch, head) and streams the keys in BLOCK_N tiles with
an online softmax (base-2 exponentials). Keys at or past `kv_len` are masked (tail padding of a sharded
sequence), optionally also keys a per-batch mask rejects (padded prompt tokens).

The scatter epilogue is the X-Stage piggyback of the Ulysses post-attention all-to-all: instead of writing its
tile locally, the tile's owner stores each finished row straight into the buffer of the rank that owns that
token, in that rank's (B, T + L, H, D) layout (text rows go to every rank), then moves on to its next tile: the
stores drain while the next tile's Q loop computes. Destinations are a table of element offsets from Scatter.out
(this rank's own buffer; kernels/tables.py: symmetric-memory peers, or local buffers in loopback), all with the
strides of Scatter.out. A Scatter with `scales` sends an FP8 payload into e4m3 buffers: each row quantized in
registers before its store, its scale stored alike into the destination's scale buffer (kernels/fp8.py).

This Triton kernel is the portable one (any CUDA GPU, and Triton's CPU interpreter in the tests). On Hopper,
flash_attention runs kernels/attention_hopper.py instead (same interface and epilogue, warp-specialized in Gluon),
whenever TMA can load the inputs: contiguous (B, S, H, D) tensors, or (B, S, H, D) views of contiguous
(B, H, S, D) ones, as torch's SDPA layout gives."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..logging_utils import warn_once
from . import attention_hopper
from .attention_args import (FP8_DTYPES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, AttentionCall, Attended, Epilogue,
                             KeyForward, Merge, QuantizedOperands, Scatter, Store, Strides, ValueOrder)
from .attention_fp8 import LOG2_E4M3_MAX, key_tile_scale, offset_scores, quantize, softmax_weights
from .attention_hopper import HopperConfig, TmaRows, tma_rows
from .fp8 import E4M3_MAX, quantize_rows, to_e4m3
from .tables import ALIGN_ELEMENTS


@triton.jit
def _attend_tile(acc, l_i, m_i, q, k, v, qk_scale, key_ok, MASKED: tl.constexpr, FP8: tl.constexpr):
    """One key tile of the online softmax (attention_fp8.softmax_weights): k is (HEAD_DIM, BLOCK_N), v is
    (BLOCK_N, HEAD_DIM).

    Masked scores get a large finite negative, not -inf, so a tile whose keys are all masked cannot produce
    (-inf) - (-inf); its weights vanish once a real key raises the row maximum.
    FP8: q and k are INT8 and v e4m3 (qk_scale includes q's and k's scales); p, at most 1 once its row's maximum
    is subtracted, is scaled onto e4m3's range in its exponent (its row sums and the accumulator carry that
    factor, which the caller divides out), and the tile's p·v is added to the float32 accumulator here rather than
    summed across tiles in the tensor cores' narrower FP8 accumulator."""
    scores = tl.dot(q, k)
    if FP8:
        scores = offset_scores(scores)
    if MASKED:
        scores = tl.where(key_ok[None, :], scores, -1.0e30)
    SHIFT: tl.constexpr = LOG2_E4M3_MAX if FP8 else 0.0
    p, m_new, alpha = softmax_weights(scores, m_i, qk_scale, SHIFT, FP8)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if FP8:
        acc = acc + tl.dot(to_e4m3(p), v)
    else:
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def _load_keys(k_base, v_base, start_n, stride_ks, stride_vs, offs_n, offs_d, kv_len,
               k_desc, v_desc, kv_row0, head_col, USE_TMA: tl.constexpr, V_BY_CHANNEL: tl.constexpr):
    """Key tile (HEAD_DIM, BLOCK_N) and value tile (BLOCK_N, HEAD_DIM) at key `start_n`. Through TMA, rows past
    this batch's keys belong to the next batch (or are zero past the tensor): callers mask them as keys.
    V_BY_CHANNEL: the values are stored channel-major, `stride_vs` apart (FP8 operands)."""
    if USE_TMA:
        k = k_desc.load([kv_row0 + start_n, head_col]).T
        v = v_desc.load([kv_row0 + start_n, head_col])
    else:
        rows = start_n + offs_n
        ok = rows < kv_len
        k = tl.load(k_base + rows[None, :] * stride_ks + offs_d[:, None], mask=ok[None, :], other=0.0)
        if V_BY_CHANNEL:
            v = tl.load(v_base + rows[:, None] + offs_d[None, :] * stride_vs, mask=ok[:, None], other=0.0)
        else:
            v = tl.load(v_base + rows[:, None] * stride_vs + offs_d[None, :], mask=ok[:, None], other=0.0)
    return k, v


@triton.jit
def _forward_keys(k_base, v_base, k_to, v_to, first_tile, tile_step, kv_len, stride_ks, stride_vs, offs_n, offs_d,
                  BLOCK_N: tl.constexpr):
    """Store key tiles first_tile, first_tile + tile_step, ... of one (batch, key head) `k_to` and `v_to`
    elements further on (the same rows of another rank's buffers)."""
    for start_n in range(first_tile * BLOCK_N, kv_len, tile_step * BLOCK_N):
        rows = start_n + offs_n
        ok = (rows < kv_len)[:, None]
        k_at = rows[:, None] * stride_ks + offs_d[None, :]
        v_at = rows[:, None] * stride_vs + offs_d[None, :]
        tl.store(k_base + k_to + k_at, tl.load(k_base + k_at, mask=ok), mask=ok)
        tl.store(v_base + v_to + v_at, tl.load(v_base + v_at, mask=ok), mask=ok)


@triton.jit
def _attention_kernel(
    Q, K, V, Out, Lse, KeyMask, Dest, q_desc, k_desc, v_desc, fp8,
    sm_scale, q_len, kv_rows, kv_len, kv_full_end, key_mask_len, stride_mb,
    q_strides, k_strides, v_strides, o_strides, heads, kv_group, scatter, scales, k_to, v_to,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    WRITE_LSE: tl.constexpr, HAS_KEY_MASK: tl.constexpr, SCATTER: tl.constexpr, USE_TMA: tl.constexpr,
    WARP_SPECIALIZE: tl.constexpr, FORWARD: tl.constexpr, MERGE: tl.constexpr, ALIGN: tl.constexpr,
    FP8: tl.constexpr, PAYLOAD: tl.constexpr,
):
    """Strides are Strides records, `scatter` a ScatterArgs record (kernels/attention_args.py), `scales` a
    PayloadScales record where PAYLOAD (the scatter's rows travel as an FP8 payload; else None). With FORWARD, the
    program of query tile i also stores key tiles i, i + #query tiles, ... of its key head `k_to` and `v_to`
    elements further on (KeyForward), where its head is the first of its key head's group. With MERGE, Out and Lse
    hold a running float32 output and log-sum-exp that the tile's rows are merged into, in place. With FP8, the
    products read `fp8`, a QuantizedOperands record (kernels/attention_fp8.py; None without), and Q, K, V only as
    the keys and values to forward."""
    # the schedule knob: programs start at Q tile `tile_shift` and wrap around (see Scatter.first_row)
    pid_m = (tl.program_id(0) + scatter.tile_shift) % tl.num_programs(0)
    pid_bh = tl.program_id(1)
    batch = (pid_bh // heads).to(tl.int64)
    h = pid_bh % heads
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len

    # TMA views the (B, S, H, D) tensors as (B * S, H * D): this tile sits at row b * S + m, column h * D
    # (TMA coordinates are 32-bit)
    kv_row0 = (pid_bh // heads) * kv_rows
    kv_head = h // kv_group
    kv_bh = batch * (heads // kv_group) + kv_head
    head_col = kv_head * HEAD_DIM
    # what the products read: the inputs, or their FP8 operands
    if FP8:
        Qx, Kx, Vx = fp8.q, fp8.k, fp8.v
        qx_strides, kx_strides, vx_strides = fp8.q_strides, fp8.k_strides, fp8.v_strides
    else:
        Qx, Kx, Vx = Q, K, V
        qx_strides, kx_strides, vx_strides = q_strides, k_strides, v_strides
    if USE_TMA:
        q = q_desc.load([(pid_bh // heads) * q_len + pid_m * BLOCK_M, h * HEAD_DIM])
    else:
        q = tl.load(Qx + batch * qx_strides.batch + h * qx_strides.head + offs_m[:, None] * qx_strides.seq
                    + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    k_base = Kx + batch * kx_strides.batch + kv_head * kx_strides.head
    v_base = Vx + batch * vx_strides.batch + kv_head * vx_strides.head
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    scores_scale = qk_scale  # with FP8, times the query tile's scale (and in the loop each key tile's)
    k_scales = None
    if FP8:
        scores_scale = qk_scale * tl.load(fp8.q_scale + pid_bh.to(tl.int64) * tl.num_programs(0) + pid_m)
        k_scales = fp8.k_scale + kv_bh * tl.cdiv(kv_len, BLOCK_N)

    if HAS_KEY_MASK:
        # the mask may reject keys anywhere in its range: every tile is masked
        for start_n in range(0, kv_len, BLOCK_N):
            k, v = _load_keys(k_base, v_base, start_n, kx_strides.seq, vx_strides.seq, offs_n, offs_d, kv_len,
                              k_desc, v_desc, kv_row0, head_col, USE_TMA, FP8)
            keys = start_n + offs_n
            allowed = tl.load(KeyMask + batch * stride_mb + keys, mask=keys < key_mask_len, other=1)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v,
                                         key_tile_scale(scores_scale, k_scales, start_n, BLOCK_N, FP8),
                                         (keys < kv_len) & (allowed != 0), True, FP8)
    else:
        # full tiles unmasked, then the partial tail tile masked
        full_end = kv_full_end
        for start_n in tl.range(0, full_end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
            k, v = _load_keys(k_base, v_base, start_n, kx_strides.seq, vx_strides.seq, offs_n, offs_d, kv_len,
                              k_desc, v_desc, kv_row0, head_col, USE_TMA, FP8)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v,
                                         key_tile_scale(scores_scale, k_scales, start_n, BLOCK_N, FP8), offs_n,
                                         False, FP8)
        if full_end < kv_len:
            k, v = _load_keys(k_base, v_base, full_end, kx_strides.seq, vx_strides.seq, offs_n, offs_d, kv_len,
                              k_desc, v_desc, kv_row0, head_col, USE_TMA, FP8)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, k, v,
                                         key_tile_scale(scores_scale, k_scales, full_end, BLOCK_N, FP8),
                                         full_end + offs_n < kv_len, True, FP8)

    if FP8:
        # p's e4m3 range and v's channel scales out of the output, and what the smoothing took back in: the values'
        # mean (acc / l_i gains it) and each query's q · mean key (its log-sum-exp's, in base 2)
        at_channels = kv_bh * HEAD_DIM + offs_d
        l_i = l_i / E4M3_MAX
        acc = (acc * (tl.load(fp8.v_scale + at_channels) / E4M3_MAX)[None, :]
               + l_i[:, None] * tl.load(fp8.v_mean + at_channels)[None, :])
        m_i += tl.load(fp8.q_shift + pid_bh.to(tl.int64) * q_len + offs_m, mask=row_ok, other=0.0) * qk_scale

    if FORWARD:
        if h % kv_group == 0:
            # the keys and values as given (with FP8, not the operands the products read)
            _forward_keys(K + batch * k_strides.batch + kv_head * k_strides.head,
                          V + batch * v_strides.batch + kv_head * v_strides.head, k_to, v_to, tl.program_id(0),
                          tl.num_programs(0), kv_len, k_strides.seq, v_strides.seq, offs_n, offs_d, BLOCK_N)

    if MERGE:
        # base-2 statistics; Lse holds natural logs
        at_lse = Lse + pid_bh.to(tl.int64) * q_len + offs_m
        mine = m_i + tl.math.log2(l_i)
        before = tl.load(at_lse, mask=row_ok, other=float("-inf")) * 1.4426950408889634
        top = tl.maximum(before, mine)
        merged = top + tl.math.log2(tl.math.exp2(before - top) + tl.math.exp2(mine - top))
        tl.store(at_lse, merged * 0.6931471805599453, mask=row_ok)
        at = Out + batch * o_strides.batch + h * o_strides.head + offs_m[:, None] * o_strides.seq + offs_d[None, :]
        out = (tl.load(at, mask=row_ok[:, None], other=0.0) * tl.math.exp2(before - merged)[:, None]
               + acc * (tl.math.exp2(mine - merged) / l_i)[:, None])
        tl.store(at, out, mask=row_ok[:, None])
    else:
        out = acc / l_i[:, None]
        if PAYLOAD:
            out, row_scales = quantize_rows(out)
        out = out.to(Out.dtype.element_ty)
        if WRITE_LSE:
            tl.store(Lse + pid_bh.to(tl.int64) * q_len + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453,
                     mask=row_ok)
        if SCATTER:
            # rows and heads map to destinations as ScatterArgs says
            r = offs_m - scatter.text_rows
            is_image = (r >= 0) & row_ok
            dest = tl.where(is_image, r // scatter.rows_per_rank, 0)
            dest_row = tl.where(is_image, scatter.image_row0 + r % scatter.rows_per_rank, 0)
            column = batch * o_strides.batch + (scatter.head0 + h) * o_strides.head + offs_d[None, :]
            to_rank = tl.multiple_of(tl.load(Dest + dest), ALIGN)
            tl.store(Out + to_rank[:, None] + column + dest_row[:, None] * o_strides.seq, out, mask=is_image[:, None])
            if PAYLOAD:
                scale_column = batch * scales.strides.batch + (scatter.head0 + h) * scales.strides.head
                tl.store(scales.base + tl.load(scales.offsets + dest) + scale_column + dest_row * scales.strides.seq,
                         row_scales, mask=is_image)
            if pid_m * BLOCK_M < scatter.text_rows:
                # text rows: every rank needs every head of them
                is_text = offs_m < scatter.text_rows
                text_row = scatter.text_row0 + offs_m
                for j in range(scatter.n_dest):
                    to_j = tl.multiple_of(tl.load(Dest + j), ALIGN)
                    tl.store(Out + to_j + column + text_row[:, None] * o_strides.seq, out, mask=is_text[:, None])
                    if PAYLOAD:
                        tl.store(scales.base + tl.load(scales.offsets + j) + scale_column
                                 + text_row * scales.strides.seq, row_scales, mask=is_text)
        else:
            tl.store(Out + batch * o_strides.batch + h * o_strides.head + offs_m[:, None] * o_strides.seq
                     + offs_d[None, :], out, mask=row_ok[:, None])


@dataclass(frozen=True)
class TileConfig:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    tma: bool = False  # load through Hopper's tensor memory accelerator (contiguous inputs on CUDA only; not FP8)
    warp_specialize: bool = False


# FP8 operands load through pointers (their tiles are contiguous: attention_fp8.quantize lays them out)
FP8_CONFIG = TileConfig()


def _default_config(q: torch.Tensor, hopper_runs: bool, fp8: bool, forwards: bool) -> TileConfig | HopperConfig:
    if q.device.type == "cpu":  # Triton's interpreter
        return TileConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)
    if fp8:
        # the Hopper kernel loads its own operands' layouts; it does not forward the ring's keys
        return HopperConfig() if attention_hopper.is_available(q, fp8=True) and not forwards else FP8_CONFIG
    if hopper_runs:
        return HopperConfig()
    if attention_hopper.is_available(q):
        warn_once("attention inputs are neither contiguous (B, S, H, D) nor contiguous (B, H, S, D) tensors: the "
                  "Hopper kernel cannot load them through TMA, running the slower Triton kernel")
    # the fastest Triton configuration on an H200 (docs/benchmarks/kernels-h200.json); pointer loads where TMA
    # cannot view the tensors as rows
    return TileConfig(tma=True)


def _descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: TileConfig) -> tuple:
    """TMA descriptors of (B, S, H, D)-contiguous tensors viewed as (B * S, H * D) rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    def describe(t: torch.Tensor, rows: int) -> TensorDescriptor:
        flat = t.view(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
        return TensorDescriptor.from_tensor(flat, [rows, t.shape[3]])

    return describe(q, cfg.block_m), describe(k, cfg.block_n), describe(v, cfg.block_n)


def accepts(q: torch.Tensor, fp8: bool = False) -> bool:
    """Whether flash_attention takes inputs of q's head_dim and dtype on its device (with FP8 products: `fp8`)."""
    dtypes = FP8_DTYPES if fp8 else SUPPORTED_DTYPES + ((torch.float32,) if q.device.type == "cpu" else ())
    return q.shape[-1] in SUPPORTED_HEAD_DIMS and q.dtype in dtypes


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    kv_len: int | None = None,
    key_mask: torch.Tensor | None = None,
    epilogue: Epilogue = Store(),
    forward: KeyForward | None = None,
    fp8: bool = False,
    config: TileConfig | HopperConfig | None = None,
) -> Attended:
    """softmax(q k^T * scale) v over the first `kv_len` keys, for (B, S, H, D) tensors (last dim contiguous); k
    and v may hold fewer heads, a divisor of q's (grouped-query attention).

    key_mask: (B, M) bool/int, keys [0, M) it marks False are ignored (keys past M are kept).
    epilogue: what becomes of the output: stored locally (Store), scattered into other ranks' buffers (Scatter) or
    merged into a running result (Merge). forward: the kernel also stores the keys and values it reads there
    (KeyForward), whichever the epilogue. `fp8`: both products in FP8 (kernels/attention_fp8.py: 8-bit operands
    with float32 scales, float32 accumulation; the log-sum-exp in float32 as without it), through the Hopper
    kernel on sm_90 (the Triton kernel where the call forwards keys, or elsewhere). Returns what the epilogue wrote
    (Attended)."""
    batch, q_len, heads, head_dim = q.shape
    if not accepts(q, fp8):
        dtypes = "bf16/fp16/fp32" if fp8 else "bf16/fp16 (fp32 in Triton's interpreter)"
        raise ValueError(f"flash_attention{' with fp8' if fp8 else ''} supports head_dim {SUPPORTED_HEAD_DIMS} in "
                         f"{dtypes}, got {head_dim}, {q.dtype}")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("flash_attention needs the head_dim axis contiguous")
    if k.shape != v.shape or heads % k.shape[2]:
        raise ValueError(f"flash_attention: keys and values of one shape whose heads divide the queries' {heads}, "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if not isinstance(epilogue, (Store, Scatter, Merge)):
        raise TypeError(f"flash_attention's epilogue is a Store, Scatter or Merge, got {type(epilogue).__name__}")
    if forward is not None and not q_len:
        raise ValueError("flash_attention forwards its keys from its query tiles' programs: it needs queries")
    kv_len = k.shape[1] if kv_len is None else kv_len
    if not 0 < kv_len <= k.shape[1]:
        raise ValueError(f"kv_len must be in [1, {k.shape[1]}] (the keys given), got {kv_len}")
    call = AttentionCall(q, k, v, head_dim**-0.5 if scale is None else scale, kv_len,
                         key_mask.to(torch.int8) if key_mask is not None else None, epilogue,
                         epilogue.result_for(q), forward)
    # checked once per call: TMA loads (the Hopper kernel's, the Triton kernel's option) need row-viewable inputs
    rows = tma_rows(q, k, v)
    hopper_runs = rows is not None and attention_hopper.is_available(q)
    cfg = config or _default_config(q, hopper_runs, fp8, forward is not None)
    if fp8:
        hopper_kernel = isinstance(cfg, HopperConfig)
        if hopper_kernel and not attention_hopper.is_available(q, fp8=True):
            raise ValueError("HopperConfig needs an sm_90 GPU")
        if not hopper_kernel and cfg.tma:
            raise ValueError("the Triton kernel's FP8 attention loads its operands through pointers: give a "
                             "TileConfig with tma=False")
        operands = quantize(q, k, v, kv_len, cfg.block_m, cfg.block_n, operand_order=hopper_kernel)
        if hopper_kernel:
            attention_hopper.launch(call, cfg, TmaRows.HEADS, fp8=operands)
        else:
            launch_triton(call, cfg, use_tma=False, fp8=operands)
    elif isinstance(cfg, HopperConfig):
        if not hopper_runs:
            raise ValueError("HopperConfig needs an sm_90 GPU, bf16/fp16, head_dim 64/128 and contiguous "
                             "16-byte aligned (B, S, H, D) or (B, H, S, D) inputs")
        attention_hopper.launch(call, cfg, rows)
    else:
        launch_triton(call, cfg, use_tma=cfg.tma and rows is TmaRows.TOKENS)
    return call.result


def _forward_offsets(call: AttentionCall) -> tuple[int, int]:
    """KeyForward's buffers as element offsets from k and v (0, 0 without one)."""
    if call.forward is None:
        return 0, 0
    return tuple((to - t.data_ptr()) // t.element_size() for to, t in ((call.forward.key, call.k),
                                                                        (call.forward.value, call.v)))


def launch_triton(call: AttentionCall, cfg: TileConfig, use_tma: bool, fp8: QuantizedOperands | None = None,
                  warmup: bool = False) -> None:
    """Run the Triton kernel on a call flash_attention checked; `fp8`: its products read these operands
    (attention_fp8.quantize, for cfg's tiles, in key order). `warmup` only compiles it for the active driver's
    target (the CPU tests compile for sm_90a without a GPU)."""
    if fp8 is not None and fp8.v_order is not ValueOrder.KEYS:
        raise ValueError("the Triton kernel's FP8 attention reads values in key order: attention_fp8.quantize(..., "
                         "operand_order=False)")
    q, k = call.q, call.k
    out, lse = call.result.out, call.result.lse
    batch, q_len, heads, head_dim = q.shape
    descriptors = _descriptors(q, k, call.v, cfg) if use_tma else (None, None, None)
    args = (
        q, k, call.v, out, lse if lse is not None else out, call.key_mask if call.key_mask is not None else out,
        call.destinations, *descriptors,
        fp8,
        call.scale, q_len, k.shape[1], call.kv_len, call.kv_len // cfg.block_n * cfg.block_n, call.key_mask_len,
        call.key_mask_stride, Strides.of(q), Strides.of(k), Strides.of(call.v), Strides.of(out), heads,
        call.kv_group, call.scatter_args(cfg.block_m), call.payload_scales, *_forward_offsets(call))
    switches = dict(
        HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        WRITE_LSE=lse is not None, HAS_KEY_MASK=call.key_mask is not None, SCATTER=call.scatter is not None,
        USE_TMA=use_tma, WARP_SPECIALIZE=cfg.warp_specialize, FORWARD=call.forward is not None, MERGE=call.merge,
        ALIGN=ALIGN_ELEMENTS, FP8=fp8 is not None,
        PAYLOAD=call.payload_scales is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    grid = (triton.cdiv(q_len, cfg.block_m), batch * heads)
    if warmup:
        _attention_kernel.warmup(*args, grid=grid, **switches)
    else:
        _attention_kernel[grid](*args, **switches)
