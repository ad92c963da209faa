"""Flash attention forward for Hopper (sm_90), written in Gluon: the fast path behind kernels/attention.py.

Why a second kernel: Triton's compiler runs a key tile's q·kᵀ, softmax and p·v one after the other, so the tensor
cores idle while the exponentials run, and at head_dim 128 those take a large share of a tile's time next to its
two GEMMs. Gluon lets the schedule be written out, FlashAttention-3 style. A work tile is 128 query rows of
one (batch, head); with `persistent` one program per SM walks the tiles (the next tile's Q and first K/V tiles
load while this one's output is stored), else one program per tile. Tiles rarely fill the last round of SMs (Flux
at two ranks: 432 tiles on 132 SMs leave the fourth round 27 % full), so a persistent launch cuts the tiles of
that round into pieces over their keys (TailSplit): each piece stores its unnormalised partial result and takes a
ticket, and the tile's last piece merges the partials in piece order (the result does not depend on which piece
finished last) and writes the rows. No program waits for another. A program has three partitions:
- a producer warp loads both halves of a tile's Q once the consumers released the last tile's, then streams K and
  V tiles through a ring of shared-memory stages with TMA, signalled by mbarriers (`ready` when a tile landed,
  `free` when both consumers are done with it);
- two consumer warpgroups, 64 query rows each, share those tiles. For key tile j a consumer issues tile j's q·kᵀ
  and tile j-1's p·v as asynchronous wgmmas, then runs tile j's softmax while p·v is still on the tensor cores;
  with PINGPONG the two take turns issuing (a `turn` mbarrier each), so one's softmax runs under the other's GEMMs.
Each consumer writes its own rows: a local store or the X-Stage scatter into the destination ranks' buffers (as an
FP8 payload into e4m3 ones: kernels/fp8.py's quantization, compiled from its Triton source as Gluon). For
the X-Stage ring the producer also forwards each key and value tile, once, from shared memory into the next rank's
buffers (TMA stores, `_produce`), so that the next ring step's block drains under this one's attention.
With FP8 (flash_attention(fp8=True)) the products read kernels/attention_fp8.py's operands: INT8 q and k tiles
(their q·kᵀ in int32, scaled per query tile and key tile), e4m3 values stored channel-major (the layout e4m3 p·v
takes from shared memory), p scaled onto e4m3's range and converted in the registers that held its scores (each
32-key slice relabelled into the register operand's order, which the values' keys follow: no shuffles between
threads); each key tile's p·v is added to the float32 accumulator
(the tensor cores sum FP8 products with fewer bits), and the scales and smoothing come out before the epilogue
(`_restore_fp8`), which then runs as in bf16. A call that forwards its keys runs the Triton kernel instead.
Shapes, masking and the epilogue mean what they mean in kernels/attention.py, which chooses between the kernels.
Scalars arrive as named records (Schedule, Keys, Strides, ScatterArgs); the shared memory and its mbarriers
travel between the partitions as one Ring.

(No `from __future__ import annotations` here: Triton checks an aggregate's fields against its annotations.)"""
import functools
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from ..sizes import ATTENTION_TILES
from .attention_args import (FP8_DTYPES, SUPPORTED_DTYPES, AttentionCall, DeviceAddress, QuantizedOperands,
                             Strides, ValueOrder)
from .attention_fp8 import LOG2_E4M3_MAX, key_tile_scale, offset_scores, softmax_weights, to_operand_order
from .fp8 import E4M3_MAX, quantize_rows
from .tables import ALIGN_ELEMENTS

ROWS_PER_WARPGROUP = ATTENTION_TILES.rows // 2  # query rows per consumer warpgroup (64: one warpgroup's wgmma M)
WARPGROUP_ROWS = gl.constexpr(ROWS_PER_WARPGROUP)  # the same, for the kernels
# one implementation each: the Triton kernels' source, as Gluon
_quantize_rows = gluon.jit(quantize_rows.fn)
_offset_scores = gluon.jit(offset_scores.fn)
_softmax = gluon.jit(softmax_weights.fn)
_to_operand_order = gluon.jit(to_operand_order.fn)
_key_tile_scale = gluon.jit(key_tile_scale.fn)


@dataclass(frozen=True)
class HopperConfig:
    block_n: int = ATTENTION_TILES.keys  # keys per tile
    stages: int = 3  # K/V tiles in flight (3 of 128 keys fill the shared memory; 2 leave TMA latency exposed)
    pingpong: bool = True  # the consumers take turns issuing their GEMMs
    consumer_regs: int = 240  # registers per consumer thread (a producer thread keeps 24)
    persistent: bool = True  # one program per SM walking the work tiles (else one program per tile)
    split_tail: bool = True  # a persistent launch cuts its last round's tiles over their keys (TailSplit)

    @property
    def block_m(self) -> int:
        return 2 * ROWS_PER_WARPGROUP


class TmaRows(Enum):
    """How TMA views the (B, S, H, D)-indexed q, k, v as 2-D rows of 16-byte aligned, contiguous memory."""

    TOKENS = "tokens"  # (B, S, H, D) contiguous: (B * S, H * D) rows, head h at column h * D
    HEADS = "heads"  # (B, H, S, D) contiguous, seen through a transposed view: (B * H * S, D) rows


def _rows_of(t: torch.Tensor) -> TmaRows | None:
    b, s, h, d = t.shape
    if not t.is_cuda or t.data_ptr() % 16:
        return None
    if t.stride() == (s * h * d, h * d, d, 1):
        return TmaRows.TOKENS
    if t.stride() == (h * s * d, d, s * d, 1):
        return TmaRows.HEADS
    return None


def tma_rows(*tensors: torch.Tensor) -> TmaRows | None:
    """The row view every tensor shares, or None."""
    views = {_rows_of(t) for t in tensors}
    return views.pop() if len(views) == 1 else None


class Schedule(NamedTuple):
    """The kernel's work: work tile w is row tile w % row_tiles (shifted, see _work_tile) of (batch, head)
    w // row_tiles, over key_tiles key tiles. Programs walk items: work tiles [0, split_from) whole, then each
    later tile as `splits` pieces over its key tiles. kv_rows: rows of one batch (or one batch and head,
    heads-major) in K and V, whose head h // kv_group query head h reads."""

    q_len: int
    kv_rows: int
    heads: int
    kv_group: int
    row_tiles: int
    work_tiles: int
    key_tiles: int
    split_from: int
    splits: int


class TailSplit(NamedTuple):
    """Work tiles [split_from, work_tiles) run as `splits` pieces each (1: none is split)."""

    split_from: int
    splits: int

    def items(self, work_tiles: int) -> int:
        return self.split_from + (work_tiles - self.split_from) * self.splits


# the tail's cost model, in key tiles' time (fitted to timings on an H200, docs/benchmarks/kernels-h200-tail.md)
PIECE_COST = 6.0  # a piece's fixed cost: its Q load, the ring filling, its partial's store
MERGE_COST = 0.5  # the merge's cost per piece it reads
MAX_SPLITS = 8


@functools.cache
def split_tail(work_tiles: int, programs: int, key_tiles: int) -> TailSplit:
    """How a persistent launch of `programs` programs cuts its last, partly filled round of tiles: the number of
    pieces per tile that finishes that round soonest, in key tiles' time (rounds of pieces on the programs, each
    piece its share of the keys plus PIECE_COST, and the merge)."""
    tail = work_tiles % programs
    if tail == 0:
        return TailSplit(work_tiles, 1)

    def tail_time(splits: int) -> float:
        if splits == 1:
            return key_tiles
        rounds = triton.cdiv(tail * splits, programs)
        return rounds * (key_tiles / splits + PIECE_COST) + MERGE_COST * splits

    best = min(range(1, min(MAX_SPLITS, key_tiles) + 1), key=tail_time)  # every piece gets a key tile
    return TailSplit(work_tiles - tail if best > 1 else work_tiles, best)


class Keys(NamedTuple):
    """Keys at or past kv_len are masked; with a key mask also keys [0, mask_len) it rejects (mask_stride apart
    per batch)."""

    kv_len: int
    mask_len: int
    mask_stride: int


@aggregate
class Ring:
    """A program's shared memory: both Q halves, the K/V stages, and the mbarriers that hand them between the
    producer and the consumers (ready: a tile landed; free: both consumers are done with it; turn: ping-pong)."""

    q: gl.shared_memory_descriptor
    k: gl.shared_memory_descriptor
    v: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    q_free: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    free: gl.shared_memory_descriptor
    turn: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q, k, v, q_ready, q_free, k_ready, v_ready, free, turn):
        self.q = q
        self.k = k
        self.v = v
        self.q_ready = q_ready
        self.q_free = q_free
        self.k_ready = k_ready
        self.v_ready = v_ready
        self.free = free
        self.turn = turn


@gluon.jit
def _allocate_ring(q_desc, k_desc, v_desc, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    V_TILE: gl.constexpr = v_desc.block_type.shape  # (BLOCK_N, HEAD_DIM), or channel-major (HEAD_DIM, BLOCK_N)
    ring = Ring(gl.allocate_shared_memory(q_desc.dtype, [2, WARPGROUP_ROWS, HEAD_DIM], q_desc.layout),
                gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout),
                gl.allocate_shared_memory(v_desc.dtype, [STAGES, V_TILE[0], V_TILE[1]], v_desc.layout),
                gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout()),
                gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout()))
    for i in gl.static_range(2):
        mbarrier.init(ring.q_ready.index(i), count=1)
        mbarrier.init(ring.q_free.index(i), count=1)
        mbarrier.init(ring.turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ring.k_ready.index(i), count=1)
        mbarrier.init(ring.v_ready.index(i), count=1)
        mbarrier.init(ring.free.index(i), count=2)  # one arrive per consumer
    fence_async_shared()
    return ring


@gluon.jit
def _work_tile(work, schedule, tile_shift):
    """Work tile -> (batch, head, batch * heads + head, first query row). Consecutive tiles are consecutive row
    tiles of one head (they share its K and V in L2), starting at row tile `tile_shift` and wrapping around (the
    schedule knob, see Scatter.first_row)."""
    pid_bh = work // schedule.row_tiles
    pid_m = (work % schedule.row_tiles + tile_shift) % schedule.row_tiles
    return pid_bh // schedule.heads, pid_bh % schedule.heads, pid_bh, pid_m * (2 * WARPGROUP_ROWS)


@gluon.jit
def _tma_origin(batch, head, heads, rows, HEAD_DIM: gl.constexpr, HEADS_MAJOR: gl.constexpr):
    """TMA coordinates of row 0 of (batch, head) in a tensor of `heads` heads with `rows` rows per batch (or per
    batch and head)."""
    if HEADS_MAJOR:
        return (batch * heads + head) * rows, 0
    return batch * rows, head * HEAD_DIM


@gluon.jit
def _programs_items(schedule):
    """How many items this program walks (program p takes items p, p + programs, ...)."""
    items = schedule.split_from + (schedule.work_tiles - schedule.split_from) * schedule.splits
    return gl.cdiv(items - gl.program_id(0), gl.num_programs(0))


@gluon.jit
def _item(it, schedule):
    """This program's it-th item -> (work tile, its first key tile, its key tiles, piece): a whole tile is piece
    -1, a tile's pieces are `splits` consecutive items, each over its share of the key tiles."""
    item = gl.program_id(0) + it * gl.num_programs(0)
    piece = item - schedule.split_from
    split = piece >= 0
    part = gl.where(split, piece % schedule.splits, 0)
    first_key = gl.where(split, part * schedule.key_tiles // schedule.splits, 0)
    end_key = gl.where(split, (part + 1) * schedule.key_tiles // schedule.splits, schedule.key_tiles)
    tile = gl.where(split, schedule.split_from + piece // schedule.splits, item)
    return tile, first_key, end_key - first_key, gl.where(split, piece, -1)


@gluon.jit
def _first_forward(tile, h, first_key, schedule):
    """The first key tile from `first_key` on that the items of work tile `tile` (of query head h) forward: tiles j
    with j % row_tiles equal to the tile's row index, read by the first query head of each key head's group (-1:
    none)."""
    r = tile % schedule.row_tiles
    first = r + gl.cdiv(gl.maximum(first_key - r, 0), schedule.row_tiles) * schedule.row_tiles
    return gl.where(h % schedule.kv_group == 0, first, -1)


@gluon.jit
def _produce(q_desc, k_desc, v_desc, k_to, v_to, ring, schedule, tile_shift, HEAD_DIM: gl.constexpr,
             BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HEADS_MAJOR: gl.constexpr, FORWARD: gl.constexpr,
             FP8: gl.constexpr):
    """Producer partition, per item: the two Q halves once their consumers released the last item's, then its K
    and V tiles into the ring, the c-th tile of the program into stage c % STAGES once both consumers freed it.
    Q and the stages are free on their first lap (waiting for the parity before a fresh barrier's first phase
    returns at once). FP8: the values are channel-major (B * H_kv * HEAD_DIM rows of keys), a tile is a key
    head's HEAD_DIM channels over BLOCK_N keys.

    FORWARD (the X-Stage ring): each key tile of a key head is also stored from the ring, once it landed, into the
    same rows of `k_to` and `v_to` (another rank's buffers) by one item that loads it (`_first_forward`): TMA
    stores from shared memory, asynchronous, so the producer moves on at once; the stage a store reads is reloaded
    only after the store has read it (and a second store waits for the first's)."""
    c = 0  # the program's key tiles so far
    read_by = -1  # the program's key tile at which the last forward store's stage is reloaded
    kv_heads = schedule.heads // schedule.kv_group
    for it in range(_programs_items(schedule)):
        tile, first_key, n_keys, _ = _item(it, schedule)
        batch, h, pid_bh, row0 = _work_tile(tile, schedule, tile_shift)
        q_row, column = _tma_origin(batch, h, schedule.heads, schedule.q_len, HEAD_DIM, HEADS_MAJOR)
        kv_row, kv_column = _tma_origin(batch, h // schedule.kv_group, kv_heads, schedule.kv_rows, HEAD_DIM,
                                        HEADS_MAJOR)
        channel_row = (batch * kv_heads + h // schedule.kv_group) * HEAD_DIM  # FP8: the key head's first channel
        forward = _first_forward(tile, h, first_key, schedule)
        for half in gl.static_range(2):
            mbarrier.wait(ring.q_free.index(half), (it & 1) ^ 1)
            mbarrier.expect(ring.q_ready.index(half), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_row + row0 + half * WARPGROUP_ROWS, column],
                                            ring.q_ready.index(half), ring.q.index(half))
        for j in range(first_key, first_key + n_keys):
            stage = c % STAGES
            mbarrier.wait(ring.free.index(stage), ((c // STAGES) & 1) ^ 1)
            if FORWARD:
                if c == read_by:
                    tma.store_wait(0)
            row = kv_row + j * BLOCK_N
            mbarrier.expect(ring.k_ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [row, kv_column], ring.k_ready.index(stage),
                                            ring.k.index(stage))
            mbarrier.expect(ring.v_ready.index(stage), v_desc.block_type.nbytes)
            if FP8:
                tma.async_copy_global_to_shared(v_desc, [channel_row, j * BLOCK_N], ring.v_ready.index(stage),
                                                ring.v.index(stage))
            else:
                tma.async_copy_global_to_shared(v_desc, [row, kv_column], ring.v_ready.index(stage),
                                                ring.v.index(stage))
            if FORWARD:
                if j == forward:
                    if read_by > c:
                        tma.store_wait(0)
                    mbarrier.wait(ring.k_ready.index(stage), (c // STAGES) & 1)
                    tma.async_copy_shared_to_global(k_to, [row, kv_column], ring.k.index(stage))
                    mbarrier.wait(ring.v_ready.index(stage), (c // STAGES) & 1)
                    tma.async_copy_shared_to_global(v_to, [row, kv_column], ring.v.index(stage))
                    read_by = c + STAGES
                    forward += schedule.row_tiles
            c += 1
    if FORWARD:
        tma.store_wait(0)  # every forward store done before the program (and its shared memory) ends


@gluon.jit
def _mask_keys(s, start_n, keys, KeyMask, HAS_KEY_MASK: gl.constexpr):
    """Scores of keys past kv_len (and keys the mask rejects) become a large finite negative: a tile whose keys
    are all masked then cannot produce (-inf) - (-inf), and its weights vanish once a real key raises the max."""
    index = start_n + gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s.type.layout))
    ok = index < keys.kv_len
    if HAS_KEY_MASK:
        ok = ok & (gl.load(KeyMask + index, mask=index < keys.mask_len, other=1) != 0)
    return gl.where(gl.expand_dims(ok, 0), s, -1.0e30)


@gluon.jit
def _scores(s, FP8: gl.constexpr):
    """A q·kᵀ tile as float32 (FP8: from INT8 products' int32, offset: attention_fp8.offset_scores)."""
    if FP8:
        s = _offset_scores(s)
    return s


@gluon.jit
def _operand(p, dtype: gl.constexpr, layout: gl.constexpr, FP8: gl.constexpr):
    """A key tile's weights p (float32, in the score accumulator's registers) as p·v's register operand `layout`.
    FP8: as e4m3 bytes packed four to an int32 register (a loop-carried 8-bit tensor would be unpacked and repacked
    a byte at a time), the keys relabelled into the operand's order (attention_fp8.OPERAND_KEY_ORDER, which the
    values' rows follow), where every thread's registers already hold its operand's values: only their conversion
    remains."""
    if FP8:
        ROWS: gl.constexpr = p.shape[0]
        COLUMNS: gl.constexpr = p.shape[1]
        p = gl.convert_layout(_to_operand_order(p), layout, assert_trivial=True)
        # each register's four columns: k0 k1 k2 k3 = (even: k0, k2), (odd: k1, k3)
        even, odd = gl.split(gl.reshape(p, [ROWS, COLUMNS // 4, 2, 2]))
        k0, k2 = gl.split(even)
        k1, k3 = gl.split(odd)
        operand = gl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,r,r,r,r", [k0, k1, k2, k3], dtype=gl.int32, is_pure=True, pack=1)
    else:
        operand = gl.convert_layout(p.to(dtype), layout, assert_trivial=True)
    return operand


@gluon.jit
def _issue_pv(operand, v_tile, acc, zero_o, layout: gl.constexpr, FP8: gl.constexpr):
    """Issue a key tile's p·v: accumulated into acc, or with FP8 into a fresh float32 tile (the caller adds it to
    acc: FP8 products accumulate in the tensor cores with fewer bits than float32) from channel-major values."""
    if FP8:
        # the packed words as the 8-bit tensor wgmma takes: each word at its four bytes' places (copies in
        # registers), passed through whole, so that the operand's registers are the words' own
        words = gl.join(gl.join(operand, operand), gl.join(operand, operand))
        p = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,r,r,r", [words], dtype=gl.float8e4nv, is_pure=True,
                                      pack=4)
        p = gl.convert_layout(gl.reshape(p, [operand.shape[0], 4 * operand.shape[1]]), layout, assert_trivial=True)
        product = warpgroup_mma(p, v_tile.permute((1, 0)), zero_o, use_acc=False, is_async=True)
    else:
        product = warpgroup_mma(operand, v_tile, acc, is_async=True)
    return product


@gluon.jit
def _retire(product, operand):
    """Waits for the p·v _issue_pv issued last, holding its operand's registers until then (else the compiler could
    reuse them for the next tile's weights while the wgmma still reads them)."""
    product, operand = warpgroup_mma_wait(0, deps=[product, operand])
    return product


@gluon.jit
def _accumulate(acc, product, FP8: gl.constexpr):
    """What _issue_pv's retired product makes of the accumulator."""
    if FP8:
        product = acc + product
    return product


@gluon.jit
def _restore_fp8(m_i, l_i, acc, fp8, kv_bh, pid_bh, first, q_len, qk_scale, HEAD_DIM: gl.constexpr):
    """A consumer's statistics and accumulator over FP8 operands (kernels/attention_fp8.py) in the bf16 kernel's
    terms: p's e4m3 range and v's channel scales out, and what the smoothing took back in: the values' mean (each
    row's weights sum to l) and each query's q · mean key in its row maximum (base 2)."""
    ACC: gl.constexpr = acc.type.layout
    channels = kv_bh.to(gl.int64) * HEAD_DIM + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ACC))
    l_i = l_i / E4M3_MAX
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, ACC), assert_trivial=True)
    acc = (acc * gl.expand_dims(gl.load(fp8.v_scale + channels) / E4M3_MAX, 0)
           + gl.expand_dims(l_o, 1) * gl.expand_dims(gl.load(fp8.v_mean + channels), 0))
    rows = first + gl.arange(0, WARPGROUP_ROWS, layout=m_i.type.layout)
    m_i = m_i + gl.load(fp8.q_shift + pid_bh.to(gl.int64) * q_len + rows, mask=rows < q_len, other=0.0) * qk_scale
    return m_i, l_i, acc


@gluon.jit
def _attend(ring, it, c0, t0, first_key, n_tiles, scale, k_scales, keys, KeyMask, WG: gl.constexpr,
            HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_KEY_MASK: gl.constexpr,
            PINGPONG: gl.constexpr, FP8: gl.constexpr):
    """One consumer warpgroup's 64 rows of the program's it-th item over its n_tiles key tiles (from first_key):
    returns the row maxima, row sums and unnormalised output. Key tile j's q·kᵀ and tile j-1's p·v are issued
    together; the wait for the first leaves the second on the tensor cores while tile j's softmax runs. The
    accumulator is rescaled only once its p·v retired. The item's j-th key tile is the program's (c0 + j)-th, and
    its ping-pong turns follow the program's t0 earlier ones. The scores' scale is `scale`, with FP8 times each
    key tile's scale (k_scales, by key tile); FP8's p, at most 1, is scaled onto e4m3's range, so its row sums and
    accumulator are E4M3_MAX times the weights' (_restore_fp8 takes that out)."""
    K_STEP: gl.constexpr = 32 if FP8 else 16  # a wgmma's reduction depth: 32 bytes of each operand row
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, K_STEP])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, K_STEP])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=4 if FP8 else 2)
    P_SHIFT: gl.constexpr = LOG2_E4M3_MAX if FP8 else 0.0
    O_ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    q = ring.q.index(WG)
    # only the last key tile can hold keys past kv_len; with a key mask every tile is masked
    last_full = 0 if HAS_KEY_MASK else keys.kv_len // BLOCK_N
    zero_s = gl.zeros([WARPGROUP_ROWS, BLOCK_N], gl.int32 if FP8 else gl.float32, S_LAYOUT)
    zero_o = gl.zeros([WARPGROUP_ROWS, HEAD_DIM], gl.float32, O_LAYOUT)
    acc = zero_o
    m_i = gl.full([WARPGROUP_ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, S_LAYOUT))
    mbarrier.wait(ring.q_ready.index(WG), it & 1)

    mbarrier.wait(ring.k_ready.index(c0 % STAGES), (c0 // STAGES) & 1)
    s = warpgroup_mma(q, ring.k.index(c0 % STAGES).permute((1, 0)), zero_s, use_acc=False, is_async=True)
    s = _scores(warpgroup_mma_wait(0, deps=[s]), FP8)
    if first_key >= last_full:
        s = _mask_keys(s, first_key * BLOCK_N, keys, KeyMask, HAS_KEY_MASK)
    tile_scale = _key_tile_scale(scale, k_scales, first_key * BLOCK_N, BLOCK_N, FP8)
    p, m_i, alpha = _softmax(s, m_i, tile_scale, P_SHIFT, FP8)
    l_i = gl.sum(p, 1)
    p = _operand(p, ring.v.dtype, P_LAYOUT, FP8)

    for j in range(1, n_tiles):
        c = c0 + j
        stage = c % STAGES
        before = (c - 1) % STAGES
        mbarrier.wait(ring.k_ready.index(stage), (c // STAGES) & 1)
        mbarrier.wait(ring.v_ready.index(before), ((c - 1) // STAGES) & 1)
        if PINGPONG:
            # turns alternate over the program's loop iterations; warpgroup 0 goes first: its first wait is on
            # the parity before a fresh barrier's first phase
            mbarrier.wait(ring.turn.index(WG), (t0 + j - WG) & 1)
        s = warpgroup_mma(q, ring.k.index(stage).permute((1, 0)), zero_s, use_acc=False, is_async=True)
        product = _issue_pv(p, ring.v.index(before), acc, zero_o, P_LAYOUT, FP8)
        if PINGPONG:
            mbarrier.arrive(ring.turn.index(1 - WG))
        s = _scores(warpgroup_mma_wait(1, deps=[s]), FP8)
        if first_key + j >= last_full:
            s = _mask_keys(s, (first_key + j) * BLOCK_N, keys, KeyMask, HAS_KEY_MASK)
        tile_scale = _key_tile_scale(scale, k_scales, (first_key + j) * BLOCK_N, BLOCK_N, FP8)
        p_next, m_i, alpha = _softmax(s, m_i, tile_scale, P_SHIFT, FP8)
        l_i = l_i * alpha + gl.sum(p_next, 1)
        product = _retire(product, p)
        mbarrier.arrive(ring.free.index(before))
        acc = _accumulate(acc, product, FP8) * gl.expand_dims(gl.convert_layout(alpha, O_ROWS, assert_trivial=True),
                                                              1)
        p = _operand(p_next, ring.v.dtype, P_LAYOUT, FP8)

    mbarrier.arrive(ring.q_free.index(WG))  # every q·kᵀ retired: the producer may load the next item's Q
    c = c0 + n_tiles - 1
    mbarrier.wait(ring.v_ready.index(c % STAGES), (c // STAGES) & 1)
    product = _issue_pv(p, ring.v.index(c % STAGES), acc, zero_o, P_LAYOUT, FP8)
    product = _retire(product, p)
    mbarrier.arrive(ring.free.index(c % STAGES))
    return m_i, l_i, _accumulate(acc, product, FP8)


@gluon.jit
def _partial_at(Partials, slot, WG: gl.constexpr, acc_layout: gl.constexpr, stat_layout: gl.constexpr,
                HEAD_DIM: gl.constexpr):
    """Pointers to a warpgroup's 64 rows of a piece's partial result: workspace slot `slot` holds the
    accumulator's 128 x HEAD_DIM floats, then the tile's 128 row maxima, then its 128 row sums. Returns the
    accumulator's pointers (in acc_layout) and the row maxima's (in stat_layout)."""
    ROWS: gl.constexpr = 2 * WARPGROUP_ROWS
    base = Partials + slot.to(gl.int64) * (ROWS * (HEAD_DIM + 2))
    acc_rows = WG * WARPGROUP_ROWS + gl.arange(0, WARPGROUP_ROWS, layout=gl.SliceLayout(1, acc_layout))
    columns = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    stat_rows = WG * WARPGROUP_ROWS + gl.arange(0, WARPGROUP_ROWS, layout=stat_layout)
    acc_at = base + gl.expand_dims(acc_rows * HEAD_DIM, 1) + gl.expand_dims(columns, 0)
    return acc_at, base + ROWS * HEAD_DIM + stat_rows


@gluon.jit
def _merge_piece(m_i, l_i, acc, Partials, Tickets, piece, splits, WG: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A piece's partial result: stored in its slot, then a ticket; the tile's last piece reads every piece's
    partial in piece order and merges them (base-2 softmax statistics). Returns whether this piece merged, and
    the merged statistics and accumulator (its own where it did not)."""
    ROWS: gl.constexpr = 2 * WARPGROUP_ROWS
    SLOT: gl.constexpr = ROWS * (HEAD_DIM + 2)
    ACC_LAYOUT: gl.constexpr = acc.type.layout
    STAT_LAYOUT: gl.constexpr = m_i.type.layout
    ACC_ROWS: gl.constexpr = gl.SliceLayout(1, ACC_LAYOUT)
    acc_at, m_at = _partial_at(Partials, piece, WG, ACC_LAYOUT, STAT_LAYOUT, HEAD_DIM)
    gl.store(acc_at, acc)
    gl.store(m_at, m_i)
    gl.store(m_at + ROWS, l_i)
    gl.thread_barrier()  # the warpgroup's stores are issued before its ticket releases them
    ticket = gl.atomic_add(Tickets + (piece // splits) * 2 + WG, 1, sem="acq_rel", scope="gpu")
    merged = ticket == splits - 1
    if merged:
        acc_at, m_at = _partial_at(Partials, piece - piece % splits, WG, ACC_LAYOUT, STAT_LAYOUT, HEAD_DIM)
        m_i = gl.load(m_at, cache_modifier=".cg")
        l_i = gl.load(m_at + ROWS, cache_modifier=".cg")
        acc = gl.load(acc_at, cache_modifier=".cg")
        for k in range(1, splits):
            m_k = gl.load(m_at + k * SLOT, cache_modifier=".cg")
            m_new = gl.maximum(m_i, m_k)
            alpha = gl.exp2(m_i - m_new)
            beta = gl.exp2(m_k - m_new)
            l_i = l_i * alpha + gl.load(m_at + (k * SLOT + ROWS), cache_modifier=".cg") * beta
            acc = (acc * gl.expand_dims(gl.convert_layout(alpha, ACC_ROWS, assert_trivial=True), 1)
                   + gl.load(acc_at + k * SLOT, cache_modifier=".cg")
                   * gl.expand_dims(gl.convert_layout(beta, ACC_ROWS, assert_trivial=True), 1))
            m_i = m_new
    return merged, m_i, l_i, acc


@gluon.jit
def _consume(ring, schedule, keys, sm_scale, KeyMask, Out, Lse, Dest, Partials, Tickets, o_strides, scatter, scales,
             fp8, WG: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             HAS_KEY_MASK: gl.constexpr, PINGPONG: gl.constexpr, WRITE_LSE: gl.constexpr, SCATTER: gl.constexpr,
             MERGE: gl.constexpr, ALIGN: gl.constexpr, PAYLOAD: gl.constexpr, FP8: gl.constexpr):
    """Consumer partition WG: for each of the program's items, attends its 64 rows (from row0 + 64 WG), then
    writes them (a piece: once its tile's pieces are merged). FP8: the products read the operands of `fp8`, a
    QuantizedOperands record (else None), whose scales the scores and the result take."""
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    c = 0  # the program's key tiles so far
    t = 0  # its ping-pong turns so far
    for it in range(_programs_items(schedule)):
        tile, first_key, n_keys, piece = _item(it, schedule)
        batch, h, pid_bh, row0 = _work_tile(tile, schedule, scatter.tile_shift)
        first = row0 + WG * WARPGROUP_ROWS
        scale = qk_scale
        k_scales = KeyMask  # unread without FP8
        kv_bh = batch * (schedule.heads // schedule.kv_group) + h // schedule.kv_group
        if FP8:  # times the query tile's scale; each key tile's is k_scales[j]
            scale = qk_scale * gl.load(fp8.q_scale + pid_bh.to(gl.int64) * schedule.row_tiles
                                       + row0 // (2 * WARPGROUP_ROWS))
            k_scales = fp8.k_scale + kv_bh.to(gl.int64) * schedule.key_tiles
        m_i, l_i, acc = _attend(ring, it, c, t, first_key, n_keys, scale, k_scales, keys,
                                KeyMask + batch.to(gl.int64) * keys.mask_stride, WG, HEAD_DIM, BLOCK_N, STAGES,
                                HAS_KEY_MASK, PINGPONG, FP8)
        if FP8:
            m_i, l_i, acc = _restore_fp8(m_i, l_i, acc, fp8, kv_bh, pid_bh, first, schedule.q_len, qk_scale,
                                         HEAD_DIM)
        c += n_keys
        t += n_keys - 1
        done = True
        if piece >= 0:
            done, m_i, l_i, acc = _merge_piece(m_i, l_i, acc, Partials, Tickets, piece, schedule.splits, WG,
                                               HEAD_DIM)
        if done:
            _write(m_i, l_i, acc, Out, Lse, Dest, first, schedule.q_len, batch, h, pid_bh,
                   o_strides, scatter, scales, HEAD_DIM, WRITE_LSE, SCATTER, MERGE, ALIGN, PAYLOAD)


@gluon.jit
def _merge_rows(m_i, l_o, acc, Out, Lse, offs_m, q_len, batch, h, pid_bh, o_strides, HEAD_DIM: gl.constexpr):
    """Merge a consumer's rows into the running float32 output and log-sum-exp at Out and Lse, in place: each
    weighted by its share of the merged sum (base-2 statistics; Lse holds natural logs)."""
    ROWS: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    row_ok = offs_m < q_len
    at_lse = Lse + pid_bh.to(gl.int64) * q_len + offs_m
    mine = gl.convert_layout(m_i, ROWS, assert_trivial=True) + gl.log2(l_o)
    before = gl.load(at_lse, mask=row_ok, other=float("-inf")) * 1.4426950408889634
    top = gl.maximum(before, mine)
    merged = top + gl.log2(gl.exp2(before - top) + gl.exp2(mine - top))
    gl.store(at_lse, merged * 0.6931471805599453, mask=row_ok)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc.type.layout))
    rows = batch.to(gl.int64) * o_strides.batch + h * o_strides.head + offs_m.to(gl.int64) * o_strides.seq
    at = Out + gl.expand_dims(rows, 1) + gl.expand_dims(offs_d, 0)
    ok = gl.expand_dims(row_ok, 1)
    out = (gl.load(at, mask=ok, other=0.0) * gl.expand_dims(gl.exp2(before - merged), 1)
           + acc * gl.expand_dims(gl.exp2(mine - merged) / l_o, 1))
    gl.store(at, out, mask=ok)


@gluon.jit
def _write(m_i, l_i, acc, Out, Lse, Dest, first, q_len, batch, h, pid_bh, o_strides, scatter, scales,
           HEAD_DIM: gl.constexpr, WRITE_LSE: gl.constexpr, SCATTER: gl.constexpr, MERGE: gl.constexpr,
           ALIGN: gl.constexpr, PAYLOAD: gl.constexpr):
    """Normalise a consumer's 64 rows (from `first`) and store them (and their LSE): locally, or scattered into
    the destination ranks' buffers (where PAYLOAD, quantized, their scales into `scales`, a PayloadScales
    record); or (MERGE) merge them into the running output and LSE there."""
    ROWS: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
    offs_m = first + gl.arange(0, WARPGROUP_ROWS, layout=ROWS)
    l_o = gl.convert_layout(l_i, ROWS, assert_trivial=True)
    if MERGE:
        _merge_rows(m_i, l_o, acc, Out, Lse, offs_m, q_len, batch, h, pid_bh, o_strides, HEAD_DIM)
    else:
        out = acc / gl.expand_dims(l_o, 1)
        if PAYLOAD:
            out, row_scales = _quantize_rows(out)
        out = out.to(Out.dtype.element_ty)
        if WRITE_LSE:
            lse = (gl.convert_layout(m_i, ROWS, assert_trivial=True) + gl.log2(l_o)) * 0.6931471805599453
            gl.store(Lse + pid_bh.to(gl.int64) * q_len + offs_m, lse, mask=offs_m < q_len)

        # stored straight from the wgmma layout (no shared-memory shuffle: that space goes to the K/V ring)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc.type.layout))
        row_ok = offs_m < q_len
        if SCATTER:
            # rows and heads map to destinations as ScatterArgs says
            column = gl.expand_dims(batch.to(gl.int64) * o_strides.batch + (scatter.head0 + h) * o_strides.head
                                    + offs_d, 0)
            r = offs_m - scatter.text_rows
            is_image = (r >= 0) & row_ok
            dest = gl.where(is_image, r // scatter.rows_per_rank, 0)
            image_row = gl.where(is_image, scatter.image_row0 + r % scatter.rows_per_rank, 0)
            to_rank = gl.multiple_of(gl.load(Dest + dest), ALIGN) + image_row.to(gl.int64) * o_strides.seq
            gl.store(Out + gl.expand_dims(to_rank, 1) + column, out, mask=gl.expand_dims(is_image, 1))
            if PAYLOAD:
                scale_column = batch.to(gl.int64) * scales.strides.batch + (scatter.head0 + h) * scales.strides.head
                gl.store(scales.base + gl.load(scales.offsets + dest) + scale_column
                         + image_row.to(gl.int64) * scales.strides.seq, row_scales, mask=is_image)
            if first < scatter.text_rows:
                # text rows: every rank needs every head of them
                is_text = gl.expand_dims(offs_m < scatter.text_rows, 1)
                text_row = gl.expand_dims((scatter.text_row0 + offs_m).to(gl.int64) * o_strides.seq, 1)
                for j in range(scatter.n_dest):
                    to_j = gl.multiple_of(gl.load(Dest + j), ALIGN)
                    gl.store(Out + to_j + text_row + column, out, mask=is_text)
                    if PAYLOAD:
                        gl.store(scales.base + gl.load(scales.offsets + j) + scale_column
                                 + (scatter.text_row0 + offs_m).to(gl.int64) * scales.strides.seq, row_scales,
                                 mask=offs_m < scatter.text_rows)
        else:
            rows = batch.to(gl.int64) * o_strides.batch + h * o_strides.head + offs_m.to(gl.int64) * o_strides.seq
            gl.store(Out + gl.expand_dims(rows, 1) + gl.expand_dims(offs_d, 0), out, mask=gl.expand_dims(row_ok, 1))


@gluon.jit
def _attention_kernel(
    q_desc, k_desc, v_desc, k_to, v_to, Out, Lse, KeyMask, Dest, Partials, Tickets, sm_scale, schedule, keys,
    o_strides, scatter, scales, fp8,
    HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, PINGPONG: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, WRITE_LSE: gl.constexpr, HAS_KEY_MASK: gl.constexpr, SCATTER: gl.constexpr,
    MERGE: gl.constexpr, HEADS_MAJOR: gl.constexpr, FORWARD: gl.constexpr, ALIGN: gl.constexpr,
    PAYLOAD: gl.constexpr, FP8: gl.constexpr,
):
    ring = _allocate_ring(q_desc, k_desc, v_desc, HEAD_DIM, BLOCK_N, STAGES)
    # the two consumers' arguments differ only in their warpgroup index
    gl.warp_specialize([
        (_consume, (ring, schedule, keys, sm_scale, KeyMask, Out, Lse, Dest, Partials, Tickets, o_strides, scatter,
                    scales, fp8, gl.constexpr(0), HEAD_DIM, BLOCK_N, STAGES, HAS_KEY_MASK, PINGPONG, WRITE_LSE,
                    SCATTER, MERGE, ALIGN, PAYLOAD, FP8)),
        (_consume, (ring, schedule, keys, sm_scale, KeyMask, Out, Lse, Dest, Partials, Tickets, o_strides, scatter,
                    scales, fp8, gl.constexpr(1), HEAD_DIM, BLOCK_N, STAGES, HAS_KEY_MASK, PINGPONG, WRITE_LSE,
                    SCATTER, MERGE, ALIGN, PAYLOAD, FP8)),
        (_produce, (q_desc, k_desc, v_desc, k_to, v_to, ring, schedule, scatter.tile_shift, HEAD_DIM, BLOCK_N,
                    STAGES, HEADS_MAJOR, FORWARD, FP8)),
    ], [4, 1], [CONSUMER_REGS, 24])


def is_available(q: torch.Tensor, fp8: bool = False) -> bool:
    """Whether this kernel runs for `q`'s device and dtype (head_dim and the TMA row view are flash_attention's
    checks, shared with the Triton kernel); with `fp8`, FP8 attention, whose quantization takes float32 too."""
    return (q.is_cuda and q.dtype in (FP8_DTYPES if fp8 else SUPPORTED_DTYPES)
            and _properties(q.device).major == 9)


# a launch's host time matters: at degree 8 a rank's attention call can be shorter than its launch, so what is
# fixed per device or per tile shape is computed once
@functools.cache
def _properties(device: torch.device):
    return torch.cuda.get_device_properties(device)


@functools.cache
def _unused(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(1, device=device, dtype=dtype)


_GLUON_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.int8: gl.int8,
                 torch.float8_e4m3fn: gl.float8e4nv}


@functools.cache
def _tile_layout(rows: int, columns: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, columns], _GLUON_DTYPES[dtype])


def _descriptor(t: torch.Tensor, rows: int, view: TmaRows, address: int | None = None) -> TensorDescriptor:
    """t seen as 2-D rows (TmaRows), in tiles of `rows` rows of one head; with `address`, the memory of t's shape
    and strides there instead."""
    b, s, h, d = t.shape
    flat = t.view(b * s, h * d) if view is TmaRows.TOKENS else t.transpose(1, 2).view(b * h * s, d)
    base = flat if address is None else DeviceAddress(address, t.dtype)
    return TensorDescriptor(base, list(flat.shape), list(flat.stride()), [rows, d], _tile_layout(rows, d, t.dtype))


def _channel_descriptor(v: torch.Tensor, keys: int) -> TensorDescriptor:
    """FP8's channel-major values (B, H, D, padded keys) as (B * H * D) rows of keys, in tiles of one head's D
    channels over `keys` keys."""
    b, h, d, rows = v.shape
    flat = v.view(b * h * d, rows)
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), [d, keys], _tile_layout(d, keys, v.dtype))


def launch(call: AttentionCall, config: HopperConfig, view: TmaRows, warmup: bool = False,
           fp8: QuantizedOperands | None = None) -> None:
    """Run the kernel on a call flash_attention checked, its q, k, v seen as `view` rows; with `fp8`, its
    products read these operands instead (attention_fp8.quantize for config's tiles, in the operand's key order;
    they are heads-major: `view` is ignored), and the call forwards no keys. `warmup` only compiles it for the
    active driver's target (the CPU tests compile for sm_90a without a GPU)."""
    if fp8 is not None and call.forward is not None:
        raise ValueError("the Hopper kernel's FP8 attention forwards no keys (its ring reads 8-bit tiles): the "
                         "Triton kernel forwards them")
    if fp8 is not None and fp8.v_order is not ValueOrder.OPERAND:
        raise ValueError("the Hopper kernel's FP8 attention reads values in its operand's key order: "
                         "attention_fp8.quantize(..., operand_order=True)")
    q, k = (fp8.q, fp8.k) if fp8 is not None else (call.q, call.k)
    view = TmaRows.HEADS if fp8 is not None else view
    batch, q_len, heads, head_dim = q.shape
    row_tiles = triton.cdiv(q_len, config.block_m)
    work_tiles = row_tiles * batch * heads
    key_tiles = triton.cdiv(call.kv_len, config.block_n)
    persistent = config.persistent and not warmup
    programs = _properties(q.device).multi_processor_count if persistent else work_tiles
    split = (split_tail(work_tiles, programs, key_tiles) if persistent and config.split_tail
             else TailSplit(work_tiles, 1))
    grid = (min(split.items(work_tiles), programs),)
    schedule = Schedule(q_len=q_len, kv_rows=k.shape[1], heads=heads, kv_group=call.kv_group, row_tiles=row_tiles,
                        work_tiles=work_tiles, key_tiles=key_tiles, split_from=split.split_from,
                        splits=split.splits)
    split_tiles = work_tiles - split.split_from
    # a piece's partial result: 128 rows of accumulator, row maxima and row sums; a ticket per tile and half
    if split_tiles:
        partials = torch.empty(split_tiles * split.splits * config.block_m * (head_dim + 2), device=q.device,
                               dtype=torch.float32)
        tickets = torch.zeros(2 * split_tiles, device=q.device, dtype=torch.int32)
    else:  # unread, but typed as the kernel reads them
        partials, tickets = _unused(q.device, torch.float32), _unused(q.device, torch.int32)
    k_desc = _descriptor(k, config.block_n, view)
    v_desc = (_channel_descriptor(fp8.v, config.block_n) if fp8 is not None
              else _descriptor(call.v, config.block_n, view))
    if call.forward is not None:
        k_to = _descriptor(k, config.block_n, view, call.forward.key)
        v_to = _descriptor(call.v, config.block_n, view, call.forward.value)
    else:  # unread, but typed as the kernel reads them
        k_to, v_to = k_desc, v_desc
    out, lse = call.result.out, call.result.lse
    args = (_descriptor(q, ROWS_PER_WARPGROUP, view), k_desc, v_desc, k_to, v_to, out, lse if lse is not None else out,
            call.key_mask if call.key_mask is not None else out, call.destinations, partials, tickets,
            call.scale, schedule, Keys(kv_len=call.kv_len, mask_len=call.key_mask_len,
                                       mask_stride=call.key_mask_stride),
            Strides.of(out), call.scatter_args(config.block_m), call.payload_scales, fp8)
    switches = dict(HEAD_DIM=head_dim, BLOCK_N=config.block_n, STAGES=config.stages, PINGPONG=config.pingpong,
                    CONSUMER_REGS=config.consumer_regs, WRITE_LSE=lse is not None,
                    HAS_KEY_MASK=call.key_mask is not None, SCATTER=call.scatter is not None, MERGE=call.merge,
                    HEADS_MAJOR=view is TmaRows.HEADS, FORWARD=call.forward is not None, ALIGN=ALIGN_ELEMENTS,
                    PAYLOAD=call.payload_scales is not None, FP8=fp8 is not None, num_warps=4)
    if warmup:
        _attention_kernel.warmup(*args, grid=grid, **switches)
    else:
        _attention_kernel[grid](*args, **switches)
