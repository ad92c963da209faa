"""The records of an attention call: its epilogue, one of Store, Scatter and Merge (what the call does with its
output), what it returns (Attended), and what it hands its kernels (the attention kernel, and the store kernel
before it): named on the host, and named inside the kernels too (Triton passes a NamedTuple argument as a tuple
whose fields the kernel reads by name)."""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch


SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)  # and float32 in Triton's interpreter
FP8_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the inputs FP8 attention quantizes
# an FP8 payload's values and its rows' scales (kernels/fp8.py)
PAYLOAD_DTYPE = torch.float8_e4m3fn
SCALE_DTYPE = torch.float32


class Strides(NamedTuple):
    """Element strides of a (B, S, H, D) tensor's first three axes (the head_dim axis is contiguous)."""

    batch: int
    seq: int
    head: int

    @classmethod
    def of(cls, t: torch.Tensor) -> "Strides":
        return cls(t.stride(0), t.stride(1), t.stride(2))


class PayloadScales(NamedTuple):
    """Where the row scales of an FP8 payload go (kernels/fp8.py): one float32 per (batch, row, head) of the
    payload's destination buffers, into scale buffers (B, rows, H) at `offsets` elements from `base` (this rank's
    own, whose strides all share), by destination in the payload's order."""

    base: torch.Tensor
    offsets: torch.Tensor
    strides: Strides

    @classmethod
    def of(cls, base: torch.Tensor, offsets: torch.Tensor) -> "PayloadScales":
        return cls(base, offsets, Strides.of(base))


class ScatterArgs(NamedTuple):
    """The scatter epilogue's scalars as the kernels read them: query row m < text_rows is text, stored at row
    text_row0 + m of every destination; image row r = m - text_rows goes to destination r // rows_per_rank at row
    image_row0 + r % rows_per_rank; this rank's head h is head head0 + h there. Programs start at query tile
    `tile_shift` and wrap around."""

    text_rows: int
    rows_per_rank: int
    n_dest: int
    text_row0: int
    image_row0: int
    head0: int
    tile_shift: int

    @classmethod
    def unused(cls) -> "ScatterArgs":
        """What a kernel that stores its output locally is given (its SCATTER switch is off)."""
        return cls(text_rows=0, rows_per_rank=1, n_dest=0, text_row0=0, image_row0=0, head0=0, tile_shift=0)


@dataclass(frozen=True)
class Store:
    """The epilogue that writes the output locally, into `out` ((B, Sq, H, D), allocated like the queries where
    None); with `lse`, also its natural-log log-sum-exp."""

    out: torch.Tensor | None = None
    lse: bool = False

    def __post_init__(self) -> None:
        if self.out is not None and self.out.dtype == PAYLOAD_DTYPE:
            raise ValueError(f"an {PAYLOAD_DTYPE} output is an FP8 payload, which only a Scatter with the scale "
                             f"buffers of its rows stores")

    def result_for(self, q: torch.Tensor) -> Attended:
        batch, rows, heads, _ = q.shape
        lse = torch.empty(batch, heads, rows, device=q.device, dtype=torch.float32) if self.lse else None
        return Attended(torch.empty_like(q) if self.out is None else self.out, lse)


@dataclass(frozen=True)
class Scatter:
    """The epilogue that sends output rows to other ranks (the X-Stage piggyback of the post-attention all-to-all):
    `out` is this rank's own destination buffer (B, rows, H, D), whose shape and strides every destination shares,
    and `destinations` holds every destination's buffer as an element offset from it (kernels/tables.py). Rows and
    heads map as ScatterArgs says; programs start at the query tile that holds `first_row`. `scales`: the rows
    travel as an FP8 payload (`out` is e4m3) whose row scales go there; None: in `out`'s dtype."""

    out: torch.Tensor
    destinations: torch.Tensor
    text_rows: int
    rows_per_rank: int
    text_row0: int
    image_row0: int
    head0: int
    first_row: int = 0
    scales: PayloadScales | None = None

    def __post_init__(self) -> None:
        if (self.out.dtype == PAYLOAD_DTYPE) != (self.scales is not None):
            raise ValueError(f"a Scatter into an {PAYLOAD_DTYPE} output sends an FP8 payload, with the scale buffers "
                             f"of its rows, and only it does; got a {self.out.dtype} output "
                             f"{'with' if self.scales is not None else 'without'} them")

    def args(self, block_m: int) -> ScatterArgs:
        """The kernels' view, for query tiles of `block_m` rows."""
        return ScatterArgs(text_rows=self.text_rows, rows_per_rank=self.rows_per_rank,
                           n_dest=self.destinations.numel(), text_row0=self.text_row0, image_row0=self.image_row0,
                           head0=self.head0, tile_shift=self.first_row // block_m)

    def result_for(self, q: torch.Tensor) -> Attended:
        # this rank's buffer holds every row meant for it once every rank's scatter has landed
        return Attended(self.out, None)


class KeyForward(NamedTuple):
    """Where the attention kernel forwards the keys and values it reads (the X-Stage ring): buffers with the shape
    and strides of its k and v at these addresses (another rank's, mapped into this address space). Every key row
    [0, kv_len) of every batch and key head is stored there once, by one of the programs that load it; other rows
    of the buffers may receive the source's rows too."""

    key: int
    value: int


class Running(NamedTuple):
    """A running attention result that a call merges its own into, in place, by their log-sum-exps (ring
    attention's steps over disjoint keys): `out`, the float32 output (B, Sq, H, D), and `lse`, its natural-log
    log-sum-exp (B, H, Sq), both contiguous; -inf where nothing was attended yet."""

    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def empty(cls, q: torch.Tensor) -> "Running":
        """Nothing attended yet by queries `q`: a zero output and a -inf log-sum-exp."""
        batch, rows, heads, _ = q.shape
        return cls(torch.zeros(q.shape, dtype=torch.float32, device=q.device),
                   torch.full((batch, heads, rows), float("-inf"), dtype=torch.float32, device=q.device))

    def check(self, q: torch.Tensor) -> None:
        batch, rows, heads, _ = q.shape
        if (self.out.shape != q.shape or self.lse.shape != (batch, heads, rows) or self.out.dtype != torch.float32
                or self.lse.dtype != torch.float32 or not (self.out.is_contiguous() and self.lse.is_contiguous())):
            raise ValueError(f"a running result for queries {tuple(q.shape)}: contiguous float32 output of their "
                             f"shape and log-sum-exp ({batch}, {heads}, {rows})")


class Merge(NamedTuple):
    """The epilogue that merges the call's result into `running`, in place (the X-Stage ring's steps)."""

    running: Running

    def result_for(self, q: torch.Tensor) -> Attended:
        self.running.check(q)
        return Attended(self.running.out, self.running.lse)


Epilogue = Store | Scatter | Merge  # what an attention call does with its output


@dataclass(frozen=True)
class Attended:
    """What an attention call wrote: `out`, its output (B, Sq, H, D), and `lse`, the output's natural-log
    log-sum-exp (B, H, Sq) float32 where the epilogue computes one (Store with `lse`, Merge), else None."""

    out: torch.Tensor
    lse: torch.Tensor | None


class DeviceAddress(NamedTuple):
    """An address the kernels take as a pointer argument (or TMA descriptor base) where no tensor of this process
    owns the memory: what Triton asks of a pointer argument."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


class ValueOrder(IntEnum):
    """The order of FP8 values' keys: each kernel reads one (an int, as the kernels take their records whole)."""

    KEYS = 0  # the Triton kernel's
    OPERAND = 1  # the Hopper kernel's: each 32-key slice as its p·v operand takes it (attention_fp8.OPERAND_KEY_ORDER)


class QuantizedOperands(NamedTuple):
    """q, k, v as the attention kernel's products read them with fp8=True (kernels/attention_fp8.py): q and k
    INT8, v e4m3, with `*_strides` as Strides says (v's `seq` is the stride between its channels, its keys
    contiguous), and their float32 scales: q_scale (B, H, query tiles), k_scale (B, H_kv, key tiles), v_scale
    (B, H_kv, D); what the smoothing took: v_mean (B, H_kv, D), the values' mean, and q_shift (B, H, Sq), each
    query's q · mean key; `v_order`, the order of v's keys."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_strides: Strides
    k_strides: Strides
    v_strides: Strides
    q_scale: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    v_mean: torch.Tensor
    q_shift: torch.Tensor
    v_order: ValueOrder


@dataclass(frozen=True)
class AttentionCall:
    """One flash_attention call, checked and defaulted, as either kernel's launcher takes it.

    k and v hold H / kv_group heads (grouped-query attention: query head h reads key head h // kv_group).
    key_mask: (B, M) int8, or None; result: the tensors the kernels write, `epilogue.result_for(q)`; forward: None
    forwards no keys."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float
    kv_len: int
    key_mask: torch.Tensor | None
    epilogue: Epilogue
    result: Attended
    forward: KeyForward | None = None

    @property
    def kv_group(self) -> int:
        return self.q.shape[2] // self.k.shape[2]

    @property
    def scatter(self) -> Scatter | None:
        return self.epilogue if isinstance(self.epilogue, Scatter) else None

    @property
    def merge(self) -> bool:
        return isinstance(self.epilogue, Merge)

    def scatter_args(self, block_m: int) -> ScatterArgs:
        return self.scatter.args(block_m) if self.scatter is not None else ScatterArgs.unused()

    @property
    def destinations(self) -> torch.Tensor:
        """The kernels' destination-table pointer (unread without a scatter)."""
        return self.scatter.destinations if self.scatter is not None else self.result.out

    @property
    def payload_scales(self) -> PayloadScales | None:
        """Where a scatter of an FP8 payload stores its row scales (None: the output is stored in its dtype)."""
        return self.scatter.scales if self.scatter is not None else None

    @property
    def key_mask_len(self) -> int:
        return self.key_mask.shape[1] if self.key_mask is not None else 0

    @property
    def key_mask_stride(self) -> int:
        return self.key_mask.stride(0) if self.key_mask is not None else 0


class StoreRows(NamedTuple):
    """Where the joined rows of a rank's q, k or v go: rows [text_start, text_start + text_rows) are replicated
    text, stored into this rank's own buffer at rows [0, text_rows); the others are this rank's sequence rows,
    stored in order from row `sequence_row0` of the head chunk's owner."""

    text_start: int
    text_rows: int
    sequence_row0: int


class Destinations(NamedTuple):
    """Where a store kernel sends head chunks: chunk j (`heads_per_rank` heads) to rank j's buffer, `offsets[j]`
    elements from `base` (this rank's own buffer, whose strides all share; kernels/tables.py); `rank` is this
    rank."""

    base: torch.Tensor
    offsets: torch.Tensor
    strides: Strides
    heads_per_rank: int
    rank: int
