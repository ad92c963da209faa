"""The X-Stage expert-parallel MoE kernels: the dispatch as a store kernel, the SwiGLU experts as one kernel whose
down-projection tiles store their rows straight into each token owner's buffer (the combine), and the owner's sum
of the contributions in a fixed expert order.

Slots: with expert choice every expert takes exactly C tokens per sample, so the E * B * C selections have a
static layout, slot s = (expert * B + sample) * C + choice, the same on every rank:
- dispatch: expert e's owner (rank e // E_r, E_r = E / N experts each) receives slot s at row s - owner * E_r * B * C
  of its (E_r * B * C, D) receive buffer;
- combine: slot s's output lands at row s of the (E * B * C, D) combine buffer of the rank holding its token.
Destinations are element offsets from the kernel's own buffer (kernels/tables.py).

The expert kernel runs a list of tiles of two kinds: SwiGLU tiles (x @ gate_up, then silu(gate) * up, stored
locally) of some experts and down-projection tiles (the combine stores) of others. Interleaving the two kinds in
one launch puts compute between the store bursts of the down projection (the paper's interleaved MegaMoE
schedule); the host code in sp/moe/exchange.py decides which experts each launch takes. Its scalars arrive as
named records (ExpertDims, LaunchTiles, WeightStrides), read by name inside the kernel; its tile sizes are
sizes.EXPERT_TILES, which the planner's model of its stores reads too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..sizes import EXPERT_TILES, ExpertTiles
from .tables import ALIGN_ELEMENTS


@dataclass(frozen=True)
class RowBlock:
    """The rows and columns one program of the row kernels (the dispatch stores, the ordered sum) moves."""

    rows: int
    columns: int

    @classmethod
    def on(cls, device: torch.device) -> "RowBlock":
        return cls(16, 32) if device.type == "cpu" else cls(32, 256)  # small in Triton's CPU interpreter


@triton.jit
def _store_rows_kernel(Src, SrcRows, Offsets, Base, slots, rows_per_rank, dim,
                       BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, ALIGN: tl.constexpr):
    offs_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_range = offs_s < slots
    src = tl.load(SrcRows + offs_s, mask=in_range, other=-1).to(tl.int64)
    ok = (src >= 0)[:, None] & (offs_d < dim)[None, :]
    x = tl.load(Src + src[:, None] * dim + offs_d[None, :], mask=ok)
    to = tl.multiple_of(tl.load(Offsets + offs_s // rows_per_rank, mask=in_range, other=0), ALIGN)
    row = (offs_s % rows_per_rank).to(tl.int64)
    tl.store(Base + to[:, None] + row[:, None] * dim + offs_d[None, :], x, mask=ok)


def store_rows(src: torch.Tensor, src_rows: torch.Tensor, destinations: torch.Tensor, base: torch.Tensor) -> None:
    """Slot s of `src_rows` (int32, -1: not this rank's) sends row src_rows[s] of `src` (rows, D) to row
    s % R of rank s // R's buffer (R = base.shape[0]; `destinations`: element offsets of every rank's buffer from
    `base`, this rank's (R, D) one)."""
    dim = src.shape[-1]
    if src.stride(-1) != 1 or base.stride(-1) != 1 or src.stride(0) != dim or base.stride(0) != dim:
        raise ValueError("store_rows: rows of D contiguous elements")
    block = RowBlock.on(src.device)
    grid = (triton.cdiv(src_rows.numel(), block.rows), triton.cdiv(dim, block.columns))
    _store_rows_kernel[grid](src, src_rows, destinations, base, src_rows.numel(), base.shape[0], dim,
                             BLOCK_S=block.rows, BLOCK_D=block.columns, ALIGN=ALIGN_ELEMENTS)


class ExpertDims(NamedTuple):
    """The sizes the expert kernel reads: `rows` slots per expert, the model's `dim`, the experts' hidden
    `width`."""

    rows: int
    dim: int
    width: int


class WeightStrides(NamedTuple):
    """Element strides of an (E, K, N) stack of expert weights."""

    expert: int
    k: int
    n: int

    @classmethod
    def of(cls, weights: torch.Tensor) -> "WeightStrides":
        return cls(*weights.stride())


class LaunchTiles(NamedTuple):
    """One launch's tiles as the kernel walks them: SwiGLU tiles of the experts from `up_expert0`, `down_tiles`
    down-projection tiles of the experts from `down_expert0`; its first 2 * `pairs` programs alternate the two
    kinds."""

    up_expert0: int
    down_expert0: int
    down_tiles: int
    pairs: int


@triton.jit
def _tile(expert, tile, rows, columns, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tile `tile` of an expert's (rows, columns) output, row-major over tiles: its row and column offsets, which
    of them exist, and its rows' slots (expert * rows + row)."""
    tiles_n = tl.cdiv(columns, BLOCK_N)
    offs_m = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, offs_m < rows, offs_n < columns, (expert * rows + offs_m).to(tl.int64)


@triton.jit
def _swiglu_tile(X, W1, Act, expert, tile, dims, strides,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rows [m, m + BLOCK_M) of `expert`, columns [n, n + BLOCK_N) of its hidden width: silu(x @ gate) * (x @ up),
    the projections rounded to the activation dtype first (as diffusers' separate matmul returns them)."""
    offs_m, offs_n, row_ok, col_ok, slot = _tile(expert, tile, dims.rows, dims.width, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptr = X + slot[:, None] * dims.dim + offs_k[None, :]
    w_ptr = W1 + expert.to(tl.int64) * strides.expert + offs_k[:, None] * strides.k + offs_n[None, :] * strides.n
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, dims.dim, BLOCK_K):
        k_ok = (k + offs_k) < dims.dim
        a = tl.load(x_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        gate = tl.dot(a, tl.load(w_ptr, mask=w_ok, other=0.0), gate)
        up = tl.dot(a, tl.load(w_ptr + dims.width * strides.n, mask=w_ok, other=0.0), up)
        x_ptr += BLOCK_K
        w_ptr += BLOCK_K * strides.k
    dtype = Act.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    act = gate * tl.sigmoid(gate) * up.to(dtype).to(tl.float32)
    tl.store(Act + slot[:, None] * dims.width + offs_n[None, :], act.to(dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_tile(Act, W2, Scale, Owner, Offsets, Base, expert, tile, dims, slot0, strides,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ALIGN: tl.constexpr):
    """Rows [m, m + BLOCK_M) of `expert`, output columns [n, n + BLOCK_N): (act @ down) times each slot's gate
    weight, each row stored into the combine buffer of the rank holding its token."""
    offs_m, offs_n, row_ok, col_ok, slot = _tile(expert, tile, dims.rows, dims.dim, BLOCK_M, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = Act + slot[:, None] * dims.width + offs_k[None, :]
    w_ptr = W2 + expert.to(tl.int64) * strides.expert + offs_k[:, None] * strides.k + offs_n[None, :] * strides.n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, dims.width, BLOCK_K):
        k_ok = (k + offs_k) < dims.width
        a = tl.load(a_ptr, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_ptr, mask=k_ok[:, None] & col_ok[None, :], other=0.0), acc)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K * strides.k
    dtype = Base.dtype.element_ty
    scale = tl.load(Scale + slot, mask=row_ok, other=0.0).to(tl.float32)
    out = (acc.to(dtype).to(tl.float32) * scale[:, None]).to(dtype)
    owner = tl.load(Owner + slot, mask=row_ok, other=0)
    to = tl.multiple_of(tl.load(Offsets + owner, mask=row_ok, other=0), ALIGN)
    tl.store(Base + to[:, None] + (slot0 + slot)[:, None] * dims.dim + offs_n[None, :], out,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _experts_kernel(X, W1, Act, W2, Scale, Owner, Offsets, Base, dims, slot0, work, up_strides, down_strides,
                    BLOCK_M: tl.constexpr, BLOCK_N_UP: tl.constexpr, BLOCK_N_DOWN: tl.constexpr,
                    BLOCK_K: tl.constexpr, ALIGN: tl.constexpr):
    """`dims` an ExpertDims, `work` a LaunchTiles, the strides WeightStrides records. Programs [0, 2 * pairs)
    alternate a down-projection tile and a SwiGLU tile; the rest run the remaining down-projection tiles, then
    the remaining SwiGLU tiles."""
    pid = tl.program_id(0)
    if pid < 2 * work.pairs:
        down = pid % 2 == 0
        index = pid // 2
    else:
        rest = pid - 2 * work.pairs
        down = rest < work.down_tiles - work.pairs
        index = work.pairs + tl.where(down, rest, rest - (work.down_tiles - work.pairs))
    tiles_m = tl.cdiv(dims.rows, BLOCK_M)
    if down:
        per_expert = tiles_m * tl.cdiv(dims.dim, BLOCK_N_DOWN)
        _down_tile(Act, W2, Scale, Owner, Offsets, Base, work.down_expert0 + index // per_expert, index % per_expert,
                   dims, slot0, down_strides, BLOCK_M, BLOCK_N_DOWN, BLOCK_K, ALIGN)
    else:
        per_expert = tiles_m * tl.cdiv(dims.width, BLOCK_N_UP)
        _swiglu_tile(X, W1, Act, work.up_expert0 + index // per_expert, index % per_expert, dims, up_strides,
                     BLOCK_M, BLOCK_N_UP, BLOCK_K)


@dataclass(frozen=True)
class Combine:
    """Where the down-projection tiles store their rows: slot s of this rank's E_r * R, weighed by `scale[s]`, at
    row slot0 + s of the combine buffer of rank `owner[s]`; `destinations` holds every rank's combine buffer as
    an element offset from `buffer`, this rank's (E * R, D) one (kernels/tables.py)."""

    buffer: torch.Tensor
    destinations: torch.Tensor
    scale: torch.Tensor
    owner: torch.Tensor
    slot0: int

    @classmethod
    def local(cls, buffer: torch.Tensor) -> "Combine":
        """One rank: every slot of `buffer` (E_r * R rows) at its own row, at weight 1 (what the calibration
        times)."""
        slots, device = buffer.shape[0], buffer.device
        return cls(buffer, destinations=torch.zeros(1, dtype=torch.int64, device=device),
                   scale=torch.ones(slots, dtype=buffer.dtype, device=device),
                   owner=torch.zeros(slots, dtype=torch.int32, device=device), slot0=0)


@dataclass(frozen=True)
class ExpertOperands:
    """One rank's expert work: `received` (E_r * R, D) rows, R per expert; `gate_up` (E_r, D, 2F) and `down`
    (E_r, F, D) weights; `act` (E_r * R, F) scratch; `combine` where the outputs go."""

    received: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    act: torch.Tensor
    combine: Combine

    @property
    def dims(self) -> ExpertDims:
        return ExpertDims(rows=self.received.shape[0] // self.gate_up.shape[0], dim=self.received.shape[1],
                          width=self.act.shape[1])


INTERPRETED_TILES = ExpertTiles(rows=16, up_columns=16, down_columns=16, depth=16)  # in Triton's CPU interpreter


def run_experts(ops: ExpertOperands, up: range, down: range, interleave: bool, warmup: bool = False) -> None:
    """One launch: the SwiGLU tiles of experts `up` and the down-projection (combine) tiles of experts `down`
    (contiguous ranges of this rank's experts), alternating while both last if `interleave`. `warmup`: compile
    for the current target without launching (tests without a GPU)."""
    on_gpu = warmup or ops.received.device.type == "cuda"
    tiles = EXPERT_TILES if on_gpu else INTERPRETED_TILES
    dims = ops.dims
    up_tiles = len(up) * tiles.up_tiles(dims.rows, dims.width)
    down_tiles = len(down) * tiles.down_tiles(dims.rows, dims.dim)
    if up_tiles + down_tiles == 0:
        return
    combine = ops.combine
    arguments = dict(
        X=ops.received, W1=ops.gate_up, Act=ops.act, W2=ops.down, Scale=combine.scale, Owner=combine.owner,
        Offsets=combine.destinations, Base=combine.buffer, dims=dims, slot0=combine.slot0,
        work=LaunchTiles(up_expert0=up.start, down_expert0=down.start, down_tiles=down_tiles,
                         pairs=min(up_tiles, down_tiles) if interleave else 0),
        up_strides=WeightStrides.of(ops.gate_up), down_strides=WeightStrides.of(ops.down),
        BLOCK_M=tiles.rows, BLOCK_N_UP=tiles.up_columns, BLOCK_N_DOWN=tiles.down_columns, BLOCK_K=tiles.depth,
        ALIGN=ALIGN_ELEMENTS)
    if on_gpu:
        arguments.update(num_warps=8, num_stages=3)
    grid = (up_tiles + down_tiles,)
    if warmup:
        _experts_kernel.warmup(grid=grid, **arguments)
    else:
        _experts_kernel[grid](**arguments)


@triton.jit
def _sum_kernel(Base, Contributions, SlotOf, Out, tokens, dim, experts,
                BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok, d_ok = offs_t < tokens, offs_d < dim
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for e in range(experts):
        slot = tl.load(SlotOf + offs_t.to(tl.int64) * experts + e, mask=t_ok, other=-1).to(tl.int64)
        ok = (slot >= 0)[:, None] & d_ok[None, :]
        acc += tl.load(Contributions + slot[:, None] * dim + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    mask = t_ok[:, None] & d_ok[None, :]
    where = offs_t.to(tl.int64)[:, None] * dim + offs_d[None, :]
    base = tl.load(Base + where, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + where, (base + acc).to(Out.dtype.element_ty), mask=mask)


def sum_contributions(base: torch.Tensor, combine: torch.Tensor, slot_of: torch.Tensor) -> torch.Tensor:
    """base + the sum over experts, in expert order, of each token's rows of `combine`: token t's contribution
    of expert e is row slot_of[t, e] (int32, -1: none). base: (T, D); returns (T, D) in base's dtype."""
    tokens, dim = base.shape
    out = torch.empty_like(base)
    block = RowBlock.on(base.device)
    grid = (triton.cdiv(tokens, block.rows), triton.cdiv(dim, block.columns))
    _sum_kernel[grid](base.contiguous(), combine, slot_of, out, tokens, dim, slot_of.shape[1],
                      BLOCK_T=block.rows, BLOCK_D=block.columns)
    return out
