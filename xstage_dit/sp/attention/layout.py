"""Where the tokens of one Ulysses attention call live, and what the fused kernels need to know of it.

A rank holds q, k, v as diffusers builds them for joint attention, (B, T + L, H, D): T replicated text tokens
and its L image/video tokens (padding included), text first or last. After the pre-attention all-to-all it holds
H/N heads of the whole sequence, (B, T + N*L, H/N, D): [text, rank 0's tokens, rank 1's, ...]. Models whose text
is only attended to, never attending (keys-only text), pass queries without the text rows: (B, L, H, D) in,
(B, N*L, H/N, D) gathered, and the output has the queries' shape.

Besides its own tokens, a call may attend keys every rank holds whole (`WholeKeys`). (Its other input kinds: q, k,
v as parts still to be normalised, joined and rotated are the kernels' record, `JointTokens` in
kernels/rotary_args.py; key-padding and pair-bias masks are masks.py's.)"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ...kernels.attention_args import PayloadScales, Scatter, StoreRows
from ...burst_gap.ulysses_plan import TileOrder


@dataclass(frozen=True)
class UlyssesLayout:
    """text_len: replicated text tokens of the keys (0 for models without joint attention), before the image tokens
    if `text_first`, else after them; of the queries too where `text_queries`. seq_len: true image/video tokens of
    the whole sequence; local_len: tokens per rank, padding included."""

    text_len: int
    seq_len: int
    local_len: int
    degree: int
    rank: int
    text_first: bool = True
    text_queries: bool = True
    ring_degree: int = 1
    ring_rank: int = 0

    @property
    def query_text_len(self) -> int:
        return self.text_len if self.text_queries else 0

    @property
    def padded_len(self) -> int:
        return self.local_len * self.degree

    @property
    def gathered_len(self) -> int:
        """Rows of the head-sharded keys and values: text, then every rank's image tokens."""
        return self.text_len + self.padded_len

    @property
    def query_gathered_len(self) -> int:
        return self.query_text_len + self.padded_len

    @property
    def key_len(self) -> int:
        """Keys attention sees: the padding at the tail of the gathered sequence is not one."""
        return self.text_len + self.seq_len

    def block_keys(self, block: int) -> int:
        """True tokens of ring block `block` (the padding sits at the tail of the whole sequence)."""
        return max(0, min(self.padded_len, self.seq_len - block * self.padded_len))

    def image_row0(self, text_rows: int) -> int:
        """This rank's first image row in a head-sharded tensor that starts with `text_rows` text rows."""
        return text_rows + self.rank * self.local_len

    def store_rows(self, text_rows: int) -> StoreRows:
        """Where the pre-all-to-all stores put the rows of a joint tensor with `text_rows` text rows (the keys'
        text_len, or the queries' query_text_len)."""
        return StoreRows(text_start=0 if self.text_first else self.local_len, text_rows=text_rows,
                         sequence_row0=self.image_row0(text_rows))

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(text, image) parts of a (B, T + L, ...) tensor, or of queries without text rows."""
        if self.text_first:
            text_rows = joint.shape[1] - self.local_len
            return joint[:, :text_rows], joint[:, text_rows:]
        return joint[:, self.local_len :], joint[:, : self.local_len]

    def join(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """The inverse of `split`."""
        return torch.cat([text, image] if self.text_first else [image, text], dim=1)

    def first_row(self, order: TileOrder) -> int:
        """The head-sharded row where this rank's attention programs start: rank-major at row 0, rotated at rank
        r + 1's image rows (so that ranks do not all store into one destination at once)."""
        if order is TileOrder.RANK_MAJOR:
            return 0
        return self.query_text_len + (self.rank + 1) % self.degree * self.local_len

    def output_scatter(self, out: torch.Tensor, destinations: torch.Tensor, heads_per_rank: int,
                       order: TileOrder, scales: PayloadScales | None = None) -> Scatter:
        """The attention epilogue's stores for this rank's heads: image row r of the head-sharded output to rank
        r // L at its row r % L, text rows to every rank, into buffers shaped like the queries: `out`, this rank's,
        and every rank's at `destinations` (element offsets from `out`); `scales`: an FP8 payload's (`out` e4m3)
        row scales go there."""
        return Scatter(
            out=out,
            destinations=destinations,
            text_rows=self.query_text_len,
            rows_per_rank=self.local_len,
            text_row0=0 if self.text_first else self.local_len,
            image_row0=self.query_text_len if self.text_first else 0,
            head0=self.rank * heads_per_rank,
            first_row=self.first_row(order),
            scales=scales,
        )


class WholeKeys(NamedTuple):
    """Keys and values every rank holds whole, (B, R, H, D): attended by every query, exchanged with nobody
    (FLUX.2's cached reference-image keys)."""

    key: torch.Tensor
    value: torch.Tensor

    def heads(self, rank: int, degree: int, chunk: slice | None = None) -> "WholeKeys":
        """This rank's heads of them, where a Ulysses group of `degree` ranks splits the heads; `chunk`: a chunk of
        that share (an exchange that moves the heads in chunks)."""
        share = self.key.shape[2] // degree
        start, stop = rank * share, (rank + 1) * share
        if chunk is not None:
            start, stop = start + chunk.start, start + chunk.stop
        return WholeKeys(*(t[:, :, start:stop] for t in self))
