"""Split a token sequence across the Ulysses group and put it back together.

Lengths that do not divide by the degree are padded at the tail of the sequence: every rank holds
ceil(S/N) tokens and the last ranks hold the padding. Lengths come from tensor shapes (Python ints), so
sharding never synchronises the host with the device."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime.distributed import all_gather_into


class SequenceShard:
    """The token split of the current forward pass, shared by every shard/gather point and every attention
    layer of one model. `seq_len` is set by the first tensor sharded in a forward."""

    def __init__(self, degree: int, rank: int, group: dist.ProcessGroup | None) -> None:
        self.degree = degree
        self.rank = rank
        self.group = group
        self.seq_len = 0

    @property
    def local_len(self) -> int:
        """Tokens each rank holds, padding included."""
        return -(-self.seq_len // self.degree)

    @property
    def padded_len(self) -> int:
        return self.local_len * self.degree

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous chunk of `x` along `dim`, zero-padded at the sequence tail."""
        dim = dim % x.dim()
        self.seq_len = x.shape[dim]
        pad = self.padded_len - self.seq_len
        if pad:
            widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
            x = F.pad(x, widths)
        mine = x.narrow(dim, self.rank * self.local_len, self.local_len)
        # a fresh tensor with its own strides (a narrowed batch-1 view passes for contiguous with the whole
        # sequence's strides, which a compiled block would guard on apart from its other inputs')
        return torch.empty(mine.shape, dtype=mine.dtype, device=mine.device).copy_(mine)

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence along `dim` from every rank's chunk, padding removed."""
        dim = dim % local.dim()
        front = local.movedim(dim, 0).contiguous()
        full = front.new_empty((self.degree * front.shape[0], *front.shape[1:]))
        all_gather_into(full, front, self.group)
        return full[: self.seq_len].movedim(0, dim)
