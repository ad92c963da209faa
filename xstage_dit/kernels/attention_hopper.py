"""Flash attention forward for Hopper (sm_90), written in Gluon: the fast path behind kernels/attention.py.

Why a second kernel: Triton's compiler runs a key tile's q·kᵀ, softmax and p·v one after the other, so the tensor
cores idle while the exponentials run (at head_dim 128 an H200 spends about half as long on a tile's exp2 as on
its two GEMMs). Gluon lets the schedule be written out, FlashAttention-3 style. A work tile is 128 query rows of
one (batch, head); with `persistent` one program per SM walks the tiles (the next tile's Q and first K/V tiles
load while this one's output is stored), else one program per tile. A program has three partitions:
- a producer warp loads both halves of a tile's Q once the consumers released the last tile's, then streams K and
  V tiles through a ring of shared-memory stages with TMA, signalled by mbarriers (`ready` when a tile landed,
  `free` when both consumers are done with it);
- two consumer warpgroups, 64 query rows each, share those tiles. For key tile j a consumer issues tile j's q·kᵀ
  and tile j-1's p·v as asynchronous wgmmas, then runs tile j's softmax while p·v is still on the tensor cores;
  with PINGPONG the two take turns issuing (a `turn` mbarrier each), so one's softmax runs under the other's GEMMs.
Each consumer writes its own rows: a local store or the X-Stage scatter into the destination ranks' buffers.
Shapes, masking and the epilogue mean what they mean in kernels/attention.py, which chooses between the kernels."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS_PER_WARPGROUP = 64  # query rows per consumer warpgroup (the wgmma M of one warpgroup)
WARPGROUP_ROWS = gl.constexpr(ROWS_PER_WARPGROUP)  # the same, for the kernels


@dataclass(frozen=True)
class HopperConfig:
    block_n: int = 128  # keys per tile
    stages: int = 3  # K/V tiles in flight (3 of 128 keys fill the shared memory; 2 leave TMA latency exposed)
    pingpong: bool = True  # the consumers take turns issuing their GEMMs
    consumer_regs: int = 240  # registers per consumer thread (a producer thread keeps 24)
    persistent: bool = True  # one program per SM walking the work tiles (else one program per tile)

    @property
    def block_m(self) -> int:
        return 2 * ROWS_PER_WARPGROUP


@gluon.jit
def _work_tile(work, n_row_tiles, heads, tile_shift):
    """Work tile -> (batch, head, batch * heads + head, first query row). Consecutive tiles are consecutive row
    tiles of one head (they share its K and V in L2), starting at row tile `tile_shift` and wrapping around (the
    schedule knob, see Scatter.first_row)."""
    pid_bh = work // n_row_tiles
    pid_m = (work % n_row_tiles + tile_shift) % n_row_tiles
    return pid_bh // heads, pid_bh % heads, pid_bh, pid_m * (2 * WARPGROUP_ROWS)


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, free, q_len,
             kv_rows, heads, n_row_tiles, n_work, tile_shift, n_tiles, HEAD_DIM: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """Producer partition, per work tile: the two Q halves once their consumers released the last tile's, then K
    and V tiles into the ring, the c-th tile of the program into stage c % STAGES once both consumers freed it.
    Q and the stages are free on their first lap (waiting for the parity before a fresh barrier's first phase
    returns at once)."""
    for it in range(gl.cdiv(n_work - gl.program_id(0), gl.num_programs(0))):
        batch, h, pid_bh, row0 = _work_tile(gl.program_id(0) + it * gl.num_programs(0), n_row_tiles, heads,
                                            tile_shift)
        head_col = h * HEAD_DIM
        for half in gl.static_range(2):
            mbarrier.wait(q_free.index(half), (it & 1) ^ 1)
            mbarrier.expect(q_ready.index(half), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [batch * q_len + row0 + half * WARPGROUP_ROWS, head_col],
                                            q_ready.index(half), q_smem.index(half))
        for j in range(n_tiles):
            c = it * n_tiles + j
            stage = c % STAGES
            mbarrier.wait(free.index(stage), ((c // STAGES) & 1) ^ 1)
            row = batch * kv_rows + j * BLOCK_N
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, head_col], k_ready.index(stage), k_smem.index(stage))
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row, head_col], v_ready.index(stage), v_smem.index(stage))


@gluon.jit
def _mask_keys(s, start_n, kv_len, KeyMask, key_mask_len, HAS_KEY_MASK: gl.constexpr):
    """Scores of keys past kv_len (and keys the mask rejects) become a large finite negative: a tile whose keys
    are all masked then cannot produce (-inf) - (-inf), and its weights vanish once a real key raises the max."""
    keys = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
    ok = keys < kv_len
    if HAS_KEY_MASK:
        ok = ok & (gl.load(KeyMask + keys, mask=keys < key_mask_len, other=1) != 0)
    return gl.where(gl.expand_dims(ok, 0), s, -1.0e30)


@gluon.jit
def _softmax(s, m_i, qk_scale):
    """Online-softmax step in base 2 for a score tile: the weights p, the new row maximum and the factor that
    rescales what was accumulated under the old one."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_new, 1))
    return p, m_new, gl.exp2(m_i - m_new)


@gluon.jit
def _attend(q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, free, turn, it, n_tiles, qk_scale, kv_len,
            KeyMask, key_mask_len, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, HAS_KEY_MASK: gl.constexpr, PINGPONG: gl.constexpr):
    """One consumer warpgroup's 64 rows of the program's it-th work tile over every key tile: returns the row
    maxima, row sums and unnormalised output. Tile j's q·kᵀ and tile j-1's p·v are issued together; the wait for
    the first leaves the second on the tensor cores while tile j's softmax runs. The accumulator is rescaled only
    once its p·v retired. Key tile j is the program's c-th (c = it * n_tiles + j): every work tile has n_tiles."""
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    q = q_smem.index(WG)
    # only the last tile can hold keys past kv_len; with a key mask every tile is masked
    last_full = 0 if HAS_KEY_MASK else kv_len // BLOCK_N
    zero_s = gl.zeros([WARPGROUP_ROWS, BLOCK_N], gl.float32, S_LAYOUT)
    acc = gl.zeros([WARPGROUP_ROWS, HEAD_DIM], gl.float32, O_LAYOUT)
    m_i = gl.full([WARPGROUP_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    c0 = it * n_tiles
    mbarrier.wait(q_ready.index(WG), it & 1)

    mbarrier.wait(k_ready.index(c0 % STAGES), (c0 // STAGES) & 1)
    s = warpgroup_mma(q, k_smem.index(c0 % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=[s])
    if last_full == 0:
        s = _mask_keys(s, 0, kv_len, KeyMask, key_mask_len, HAS_KEY_MASK)
    p, m_i, alpha = _softmax(s, m_i, qk_scale)
    l_i = gl.sum(p, 1)
    p = gl.convert_layout(p.to(v_smem.dtype), P_LAYOUT, assert_trivial=True)

    for j in range(1, n_tiles):
        c = c0 + j
        stage = c % STAGES
        before = (c - 1) % STAGES
        mbarrier.wait(k_ready.index(stage), (c // STAGES) & 1)
        mbarrier.wait(v_ready.index(before), ((c - 1) // STAGES) & 1)
        if PINGPONG:
            # turns alternate over the program's loop iterations (n_tiles - 1 per work tile); warpgroup 0 goes
            # first: its first wait is on the parity before a fresh barrier's first phase
            mbarrier.wait(turn.index(WG), (it * (n_tiles - 1) + j - WG) & 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_smem.index(before), acc, is_async=True)
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - WG))
        s = warpgroup_mma_wait(1, deps=[s])
        if j >= last_full:
            s = _mask_keys(s, j * BLOCK_N, kv_len, KeyMask, key_mask_len, HAS_KEY_MASK)
        p_next, m_i, alpha = _softmax(s, m_i, qk_scale)
        l_i = l_i * alpha + gl.sum(p_next, 1)
        acc, p = warpgroup_mma_wait(0, deps=[acc, p])
        mbarrier.arrive(free.index(before))
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, O_ROWS, assert_trivial=True), 1)
        p = gl.convert_layout(p_next.to(v_smem.dtype), P_LAYOUT, assert_trivial=True)

    mbarrier.arrive(q_free.index(WG))  # every q·kᵀ retired: the producer may load the next tile's Q
    c = c0 + n_tiles - 1
    mbarrier.wait(v_ready.index(c % STAGES), (c // STAGES) & 1)
    acc = warpgroup_mma(p, v_smem.index(c % STAGES), acc, is_async=True)
    acc, p = warpgroup_mma_wait(0, deps=[acc, p])
    mbarrier.arrive(free.index(c % STAGES))
    return m_i, l_i, acc


@gluon.jit
def _consume(q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, free, turn, n_tiles, sm_scale, kv_len,
             KeyMask, stride_mb, key_mask_len, Out, Lse, Dest, q_len, heads, n_row_tiles, n_work, tile_shift,
             stride_ob, stride_os, stride_oh, text_len, local_len, n_dest, dest_text_row0, dest_image_row0,
             dest_head0, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             HAS_KEY_MASK: gl.constexpr, PINGPONG: gl.constexpr, WRITE_LSE: gl.constexpr, SCATTER: gl.constexpr,
             ALIGN: gl.constexpr):
    """Consumer partition WG: for each of the program's work tiles, attends its 64 rows (from row0 + 64 WG), then
    writes them."""
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    for it in range(gl.cdiv(n_work - gl.program_id(0), gl.num_programs(0))):
        batch, h, pid_bh, row0 = _work_tile(gl.program_id(0) + it * gl.num_programs(0), n_row_tiles, heads,
                                            tile_shift)
        m_i, l_i, acc = _attend(q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, free, turn, it, n_tiles,
                                qk_scale, kv_len, KeyMask + batch.to(gl.int64) * stride_mb, key_mask_len, WG,
                                HEAD_DIM, BLOCK_N, STAGES, HAS_KEY_MASK, PINGPONG)
        _write(m_i, l_i, acc, Out, Lse, Dest, row0 + WG * WARPGROUP_ROWS, q_len, batch, h, pid_bh, stride_ob,
               stride_os, stride_oh, text_len, local_len, n_dest, dest_text_row0, dest_image_row0, dest_head0,
               HEAD_DIM, WRITE_LSE, SCATTER, ALIGN)


@gluon.jit
def _write(m_i, l_i, acc, Out, Lse, Dest, first, q_len, batch, h, pid_bh, stride_ob, stride_os, stride_oh, text_len,
           local_len, n_dest, dest_text_row0, dest_image_row0, dest_head0, HEAD_DIM: gl.constexpr,
           WRITE_LSE: gl.constexpr, SCATTER: gl.constexpr, ALIGN: gl.constexpr):
    """Normalise a consumer's 64 rows (from `first`) and store them (and their LSE): locally, or scattered into
    the destination ranks' buffers."""
    ROWS: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    offs_m = first + gl.arange(0, WARPGROUP_ROWS, layout=ROWS)
    l_o = gl.convert_layout(l_i, ROWS, assert_trivial=True)
    out = (acc / gl.expand_dims(l_o, 1)).to(Out.dtype.element_ty)
    if WRITE_LSE:
        lse = (gl.convert_layout(m_i, ROWS, assert_trivial=True) + gl.log2(l_o)) * 0.6931471805599453
        gl.store(Lse + pid_bh.to(gl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)

    # stored straight from the wgmma layout (no shared-memory shuffle: that space goes to the K/V ring)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc.type.layout))
    row_ok = offs_m < q_len
    if SCATTER:
        # image row r = m - text_len belongs to rank r // local_len, at its row dest_image_row0 + r % local_len;
        # this rank's head h is head dest_head0 + h there
        column = gl.expand_dims(batch.to(gl.int64) * stride_ob + (dest_head0 + h) * stride_oh + offs_d, 0)
        r = offs_m - text_len
        is_image = (r >= 0) & row_ok
        dest = gl.where(is_image, r // local_len, 0)
        image_row = gl.where(is_image, dest_image_row0 + r % local_len, 0)
        to_rank = gl.multiple_of(gl.load(Dest + dest), ALIGN) + image_row.to(gl.int64) * stride_os
        gl.store(Out + gl.expand_dims(to_rank, 1) + column, out, mask=gl.expand_dims(is_image, 1))
        if first < text_len:
            # text rows: every rank needs every head of them
            is_text = gl.expand_dims(offs_m < text_len, 1)
            text_row = gl.expand_dims((dest_text_row0 + offs_m).to(gl.int64) * stride_os, 1)
            for j in range(n_dest):
                to_j = gl.multiple_of(gl.load(Dest + j), ALIGN)
                gl.store(Out + to_j + text_row + column, out, mask=is_text)
    else:
        rows = batch.to(gl.int64) * stride_ob + h * stride_oh + offs_m.to(gl.int64) * stride_os
        gl.store(Out + gl.expand_dims(rows, 1) + gl.expand_dims(offs_d, 0), out, mask=gl.expand_dims(row_ok, 1))


@gluon.jit
def _attention_kernel(
    q_desc, k_desc, v_desc, Out, Lse, KeyMask, Dest,
    sm_scale, q_len, kv_rows, kv_len, key_mask_len,
    stride_ob, stride_os, stride_oh, stride_mb, batches, heads,
    text_len, local_len, n_dest, dest_text_row0, dest_image_row0, dest_head0, tile_shift,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, WRITE_LSE: gl.constexpr, HAS_KEY_MASK: gl.constexpr, SCATTER: gl.constexpr,
    ALIGN: gl.constexpr,
):
    n_row_tiles = gl.cdiv(q_len, 2 * WARPGROUP_ROWS)
    n_work = n_row_tiles * batches * heads
    n_tiles = gl.cdiv(kv_len, BLOCK_N)

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, WARPGROUP_ROWS, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_free.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(free.index(i), count=2)  # one arrive per consumer
    fence_async_shared()

    # TMA views (B, S, H, D) as (B * S, H * D): a tile's Q rows start at row b * S + m, column h * D.
    # The two consumers' arguments differ only in their warpgroup index.
    gl.warp_specialize([
        (_consume, (q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, free, turn, n_tiles, sm_scale, kv_len,
                    KeyMask, stride_mb, key_mask_len, Out, Lse, Dest, q_len, heads, n_row_tiles, n_work, tile_shift,
                    stride_ob, stride_os, stride_oh, text_len, local_len, n_dest, dest_text_row0, dest_image_row0,
                    dest_head0, gl.constexpr(0), HEAD_DIM, BLOCK_N, STAGES, HAS_KEY_MASK, PINGPONG, WRITE_LSE,
                    SCATTER, ALIGN)),
        (_consume, (q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, free, turn, n_tiles, sm_scale, kv_len,
                    KeyMask, stride_mb, key_mask_len, Out, Lse, Dest, q_len, heads, n_row_tiles, n_work, tile_shift,
                    stride_ob, stride_os, stride_oh, text_len, local_len, n_dest, dest_text_row0, dest_image_row0,
                    dest_head0, gl.constexpr(1), HEAD_DIM, BLOCK_N, STAGES, HAS_KEY_MASK, PINGPONG, WRITE_LSE,
                    SCATTER, ALIGN)),
        (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_ready, q_free, k_ready, v_ready, free, q_len,
                    kv_rows, heads, n_row_tiles, n_work, tile_shift, n_tiles, HEAD_DIM, BLOCK_N, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)


def is_available(q: torch.Tensor) -> bool:
    """Whether this kernel runs for `q`'s device and dtype (head_dim and contiguity are flash_attention's
    checks, shared with the Triton kernel)."""
    return q.is_cuda and q.dtype in SUPPORTED_DTYPES and _properties(q.device).major == 9


# a launch's host time matters: at degree 8 a rank's attention call can be shorter than its launch, so what is
# fixed per device or per tile shape is computed once
@functools.cache
def _properties(device: torch.device):
    return torch.cuda.get_device_properties(device)


@functools.cache
def _tile_layout(rows: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16 if dtype == torch.bfloat16
                                                else gl.float16)


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """(B, S, H, D) viewed as (B * S, H * D), in tiles of `rows` rows of one head."""
    flat = t.view(t.shape[0] * t.shape[1], t.shape[2] * t.shape[3])
    return TensorDescriptor.from_tensor(flat, [rows, t.shape[3]], _tile_layout(rows, t.shape[3], t.dtype))


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
           mask: torch.Tensor, destinations: torch.Tensor, scale: float, kv_len: int, key_mask_len: int,
           scatter_args: tuple, write_lse: bool, has_key_mask: bool, scatter: bool, align: int,
           config: HopperConfig, warmup: bool = False) -> None:
    """Run the kernel; the arguments are flash_attention's, already checked and defaulted there. `warmup` only
    compiles it for the active driver's target (the CPU tests compile for sm_90a without a GPU)."""
    batch, q_len, heads, head_dim = q.shape
    n_work = triton.cdiv(q_len, config.block_m) * batch * heads
    grid = (min(n_work, _properties(q.device).multi_processor_count) if config.persistent and not warmup else n_work,)
    args = (_descriptor(q, ROWS_PER_WARPGROUP), _descriptor(k, config.block_n), _descriptor(v, config.block_n),
            out, lse, mask, destinations,
            scale, q_len, k.shape[1], kv_len, key_mask_len,
            out.stride(0), out.stride(1), out.stride(2), mask.stride(0) if has_key_mask else 0, batch, heads,
            *scatter_args)
    switches = dict(HEAD_DIM=head_dim, BLOCK_N=config.block_n, STAGES=config.stages, PINGPONG=config.pingpong,
                    CONSUMER_REGS=config.consumer_regs, WRITE_LSE=write_lse, HAS_KEY_MASK=has_key_mask,
                    SCATTER=scatter, ALIGN=align, num_warps=4)
    if warmup:
        _attention_kernel.warmup(*args, grid=grid, **switches)
    else:
        _attention_kernel[grid](*args, **switches)
