"""The records an attention call hands its kernels (the attention kernel, and the store kernel before it): named on
the host, and named inside the kernels too (Triton passes a NamedTuple argument as a tuple whose fields the kernel
reads by name)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


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
class Scatter:
    """Where the scatter epilogue sends output rows (the X-Stage piggyback of the post-attention all-to-all):
    `destinations` holds every destination's (B, rows, H, D) buffer as an element offset from the kernel's `out`
    (kernels/tables.py). Rows and heads map as ScatterArgs says; programs start at the query tile that holds
    `first_row`. `scales`: the rows travel as an FP8 payload (`out` is e4m3) whose row scales go there; None: in
    `out`'s dtype."""

    destinations: torch.Tensor
    text_rows: int
    rows_per_rank: int
    text_row0: int
    image_row0: int
    head0: int
    first_row: int = 0
    scales: PayloadScales | None = None

    def args(self, block_m: int) -> ScatterArgs:
        """The kernels' view, for query tiles of `block_m` rows."""
        return ScatterArgs(text_rows=self.text_rows, rows_per_rank=self.rows_per_rank,
                           n_dest=self.destinations.numel(), text_row0=self.text_row0, image_row0=self.image_row0,
                           head0=self.head0, tile_shift=self.first_row // block_m)


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


class DeviceAddress(NamedTuple):
    """An address the kernels take as a pointer argument (or TMA descriptor base) where no tensor of this process
    owns the memory: what Triton asks of a pointer argument."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


@dataclass(frozen=True)
class AttentionCall:
    """One flash_attention call, checked and defaulted, as either kernel's launcher takes it.

    k and v hold H / kv_group heads (grouped-query attention: query head h reads key head h // kv_group).
    key_mask: (B, M) int8, or None; lse: (B, H, Sq) float32, or None; scatter: None stores into `out` locally;
    forward: None forwards no keys; merge: `out` and `lse` hold a running result to merge into (Running)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    scale: float
    kv_len: int
    key_mask: torch.Tensor | None
    lse: torch.Tensor | None
    scatter: Scatter | None
    forward: KeyForward | None = None
    merge: bool = False

    @property
    def kv_group(self) -> int:
        return self.q.shape[2] // self.k.shape[2]

    def scatter_args(self, block_m: int) -> ScatterArgs:
        return self.scatter.args(block_m) if self.scatter is not None else ScatterArgs.unused()

    @property
    def destinations(self) -> torch.Tensor:
        """The kernels' destination-table pointer (unread without a scatter)."""
        return self.scatter.destinations if self.scatter is not None else self.out

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
