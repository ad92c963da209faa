"""Ulysses attention of N ranks simulated in one process on one device ("loopback"): every rank's buffers are
local tensors and the destination tables hold their offsets, so the fused kernels run exactly the stores
they would issue to peers. Used to test the fused path against the reference, and to time it."""
from __future__ import annotations

import torch

from .all_to_all import scatter_heads
from .attention import Scatter, flash_attention
from .tables import offset_table


class LoopbackUlysses:
    """Buffers of N simulated ranks for one (B, T + L, H, D) joint attention shape."""

    def __init__(self, n_ranks: int, batch: int, text_len: int, local_len: int, heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, text_first: bool = True) -> None:
        self.n_ranks, self.text_len, self.local_len, self.text_first = n_ranks, text_len, local_len, text_first
        self.share = heads // n_ranks
        gathered = (batch, text_len + n_ranks * local_len, self.share, head_dim)
        # per rank: gathered q, k, v (head-sharded) and the post-all-to-all output (sequence-sharded)
        self.qkv = [[torch.empty(gathered, dtype=dtype, device=device) for _ in range(3)] for _ in range(n_ranks)]
        self.out = [torch.empty(batch, text_len + local_len, heads, head_dim, dtype=dtype, device=device)
                    for _ in range(n_ranks)]
        # per rank: where its stores go, as offsets from its own buffers
        self.qkv_offsets = [[offset_table([self.qkv[r][i].data_ptr() for r in range(n_ranks)], self.qkv[rank][i])
                             for i in range(3)] for rank in range(n_ranks)]
        self.out_offsets = [offset_table([t.data_ptr() for t in self.out], self.out[rank]) for rank in range(n_ranks)]

    def pre_all_to_all(self, rank: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Rank `rank`'s joint (B, T + L, H, D) inputs into every rank's gathered buffers."""
        for i, t in enumerate((query, key, value)):
            text, image = self._split(t)
            scatter_heads(image, self.qkv_offsets[rank][i], self.qkv[rank][i],
                          row0=self.text_len + rank * self.local_len)
            # text is replicated: each rank takes its own heads of it locally
            self.qkv[rank][i][:, : self.text_len] = text[:, :, rank * self.share : (rank + 1) * self.share]

    def attention(self, rank: int, seq_len: int, scale: float | None = None,
                  key_mask: torch.Tensor | None = None, first_row: int = 0) -> None:
        """Rank `rank`'s heads over the whole sequence, each output row stored into its owner's buffer; the
        kernel's programs start at the tile of `first_row` (Scatter.first_row)."""
        q, k, v = self.qkv[rank]
        scatter = Scatter(self.out_offsets[rank], self.text_len, self.local_len, self.text_first, rank * self.share,
                          first_row)
        flash_attention(q, k, v, scale=scale, kv_len=self.text_len + seq_len, key_mask=key_mask,
                        out=self.out[rank], scatter=scatter)

    def _split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.text_first:
            return t[:, : self.text_len], t[:, self.text_len :]
        return t[:, self.local_len :], t[:, : self.local_len]
