"""RowSplit: one decode's rows across the ranks of a group, and the collectives that move rows between them."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime.distributed import all_gather_stacked

ROWS = -2  # images (B, C, H, W) and videos (B, C, T, H, W) keep their rows here


@dataclass(frozen=True)
class RowSplit:
    """Rank r decodes latent rows [starts[r], starts[r] + latent_rows[r]); every layer of the decoder scales them
    by the same whole factor (nearest x2 upsampling, depth-to-space), so a rank's rows at any resolution are
    contiguous and its neighbours' rows are next to them."""

    latent_rows: tuple[int, ...]
    rank: int
    group: dist.ProcessGroup

    @classmethod
    def balanced(cls, height: int, size: int, rank: int, group: dist.ProcessGroup) -> "RowSplit":
        """`height` rows over `size` ranks, the first height % size ranks taking one more."""
        return cls(tuple(height // size + (r < height % size) for r in range(size)), rank, group)

    @property
    def size(self) -> int:
        return len(self.latent_rows)

    def rows_at(self, local_rows: int) -> list[int]:
        """Every rank's rows at the resolution where this rank has `local_rows`."""
        factor, rest = divmod(local_rows, self.latent_rows[self.rank])
        if rest:
            raise RuntimeError(f"parallel VAE decode: {local_rows} rows on rank {self.rank} are not a whole multiple "
                               f"of its {self.latent_rows[self.rank]} latent rows; the decoder resamples rows in a "
                               f"way a row split cannot follow")
        return [rows * factor for rows in self.latent_rows]

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole tensor (at any resolution)."""
        factor = x.shape[ROWS] // sum(self.latent_rows)
        start = sum(self.latent_rows[: self.rank]) * factor
        return x.narrow(ROWS, start, self.latent_rows[self.rank] * factor)

    def gather(self, x: torch.Tensor, what: str) -> torch.Tensor:
        """The whole tensor from every rank's rows of it (uneven rows padded for the collective, then cut)."""
        rows = self.rows_at(x.shape[ROWS])
        gathered = self.gather_equal(F.pad(x, (0, 0, 0, max(rows) - x.shape[ROWS])), what)
        return torch.cat([part.narrow(ROWS, 0, n) for part, n in zip(gathered.unbind(0), rows)], dim=ROWS)

    def gather_equal(self, local: torch.Tensor, what: str) -> torch.Tensor:
        """Every rank's `local` (the same shape on every rank), stacked along a new first dimension."""
        return all_gather_stacked(local, self.size, self.group,
                                  f"{what} from the other ranks of the parallel VAE decode")

    def with_halo(self, tensors: list[torch.Tensor], halo: int, what: str) -> list[torch.Tensor]:
        """Each tensor with `halo` rows of the rank above prepended and of the rank below appended (none at the
        image's top and bottom edges, where the layer pads as it would in one process); one collective for all."""
        for t in tensors:
            if t.shape[ROWS] < halo:
                raise RuntimeError(f"parallel VAE decode: rank {self.rank} holds {t.shape[ROWS]} rows of a layer "
                                   f"that needs {halo} from each neighbour")
        edges = [torch.cat([t.narrow(ROWS, 0, halo), t.narrow(ROWS, t.shape[ROWS] - halo, halo)], ROWS)
                 for t in tensors]
        flat = torch.cat([e.reshape(-1) for e in edges])
        gathered = self.gather_equal(flat, what)
        out, offset = [], 0
        for t, e in zip(tensors, edges):
            edges_of_every_rank = gathered[:, offset: offset + e.numel()].reshape(self.size, *e.shape)
            offset += e.numel()
            parts = [t]
            if self.rank > 0:  # the last rows of the rank above
                parts.insert(0, edges_of_every_rank[self.rank - 1].narrow(ROWS, halo, halo))
            if self.rank < self.size - 1:  # the first rows of the rank below
                parts.append(edges_of_every_rank[self.rank + 1].narrow(ROWS, 0, halo))
            out.append(torch.cat(parts, ROWS))
        return out

    def without_halo(self, x: torch.Tensor, halo: int) -> torch.Tensor:
        """A layer's output rows of this rank: the rows computed for the neighbours' halo cut off."""
        top = halo if self.rank > 0 else 0
        bottom = halo if self.rank < self.size - 1 else 0
        return x.narrow(ROWS, top, x.shape[ROWS] - top - bottom)

