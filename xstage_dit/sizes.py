"""Sizes that modules on different floors must compute alike, defined once here, below all of them: how a length
splits into equal parts (a sequence's tokens per rank: sp/sharding.py splits tensors by it, the planner predicts
with it), the expert kernel's tiles (kernels/experts.py launches them, the planner models their stores), the
Hopper attention kernel's tiles (kernels/attention_hopper.py, whose key tiles the X-Stage ring forwards) and the
bytes of an FP8 payload (kernels/fp8.py stores them, the planner prices them)."""
from __future__ import annotations

from dataclasses import dataclass


def ceil_div(numerator: int, denominator: int) -> int:
    """ceil(numerator / denominator) in integers: the tokens each of `denominator` ranks holds of a sequence split
    along its length (the tail padded so that every rank holds as many), or the tiles that cover a length."""
    return -(-numerator // denominator)


@dataclass(frozen=True)
class ExpertTiles:
    """The expert kernel's tiles: `rows` of an expert's slots by `up_columns` of its SwiGLU activations or by
    `down_columns` of its output, each product summed `depth` inputs at a time."""

    rows: int
    up_columns: int
    down_columns: int
    depth: int

    def up_tiles(self, rows: int, width: int) -> int:
        """SwiGLU tiles of one expert: `rows` slots, `width` hidden columns."""
        return ceil_div(rows, self.rows) * ceil_div(width, self.up_columns)

    def down_tiles(self, rows: int, dim: int) -> int:
        """Down-projection (combine) tiles of one expert: `rows` slots, `dim` output columns."""
        return ceil_div(rows, self.rows) * ceil_div(dim, self.down_columns)


EXPERT_TILES = ExpertTiles(rows=128, up_columns=64, down_columns=128, depth=64)  # on a GPU


@dataclass(frozen=True)
class AttentionTiles:
    """The Hopper attention kernel's tiles: a work tile of `rows` query rows (of one batch and head) walks the keys
    `keys` at a time."""

    rows: int
    keys: int


ATTENTION_TILES = AttentionTiles(rows=128, keys=128)


def fp8_payload_bytes(head_dim: int) -> float:
    """Bytes per element of an FP8 payload (kernels/fp8.py): its e4m3 byte, and its share of the float32 scale of
    its row of `head_dim` elements."""
    return 1 + 4 / head_dim
