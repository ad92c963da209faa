"""Split a token sequence across the Ulysses group and put it back together.

Lengths that do not divide by the degree are padded at the tail of the sequence: every rank holds
ceil(S/N) tokens and the last ranks hold the padding. Lengths come from tensor shapes (Python ints), so
sharding never synchronises the host with the device."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..runtime.distributed import all_gather_stacked
from ..sizes import ceil_div


class SequenceShard:
    """The token split of the current forward pass, shared by every shard/gather point and every attention
    layer of one model. `seq_len` is set by the first tensor sharded in a forward; `text_len` by `shard_text`:
    the joint-attention text tokens split with the image tokens in this forward (0: the text is whole on every
    rank). `whole_prefix_len`: leading tokens that every rank holds whole and that attend only among themselves
    (a block-causal prefix): attention over no more keys than these is no split attention (0: none)."""

    def __init__(self, degree: int, rank: int, group: dist.ProcessGroup | None) -> None:
        self.degree = degree
        self.rank = rank
        self.group = group
        self.seq_len = 0
        self.text_len = 0
        self.whole_prefix_len = 0

    def split_key(self) -> tuple[int, int, int]:
        """The split of the current forward as code inside it reads it besides its tensors' shapes (a graph
        captured under one split replays only under the same)."""
        return self.seq_len, self.text_len, self.whole_prefix_len

    @property
    def local_len(self) -> int:
        """Tokens each rank holds, padding included."""
        return ceil_div(self.seq_len, self.degree)

    @property
    def padded_len(self) -> int:
        return self.local_len * self.degree

    def local_prefix_len(self, prefix: int) -> int:
        """How many of the sequence's first `prefix` tokens this rank holds: they lead its chunk."""
        return max(0, min(self.local_len, prefix - self.rank * self.local_len))

    def shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's contiguous chunk of `x` along `dim`, zero-padded at the sequence tail."""
        dim = dim % x.dim()
        self.seq_len = x.shape[dim]
        pad = self.padded_len - self.seq_len
        if pad:
            widths = [0, 0] * (x.dim() - dim - 1) + [0, pad]
            x = F.pad(x, widths)
        return _fresh(x.narrow(dim, self.rank * self.local_len, self.local_len))

    @property
    def local_text_len(self) -> int:
        """Split text tokens on each rank."""
        return self.text_len // self.degree

    def shard_text(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's share of joint-attention text tokens, split after the image tokens of this forward.

        A rank's [text, image] tokens then form one equal chunk of the sequence [text 0, image 0, text 1, ...],
        which attention may take in that order since RoPE has already placed every token. The text is split only
        where that chunk layout holds: equal text shares, and image padding on the last rank alone (padding
        anywhere but the tail would become a key); otherwise every rank keeps all of it."""
        dim = dim % x.dim()
        text_len = x.shape[dim]
        last_rank_tokens = self.seq_len - (self.degree - 1) * self.local_len
        if text_len % self.degree or last_rank_tokens < 0:
            self.text_len = 0
            return x
        self.text_len = text_len
        return _fresh(x.narrow(dim, self.rank * self.local_text_len, self.local_text_len))

    def gather(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole sequence along `dim` from every rank's chunk, padding removed."""
        dim = dim % local.dim()
        full = all_gather_stacked(local.movedim(dim, 0), self.degree, self.group,
                                  lambda: "the other ranks' chunks of the sequence").flatten(0, 1)
        return full[: self.seq_len].movedim(0, dim)

    def shard_after_text(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's share of a tensor indexed by [text, image] tokens along `dim` (a joint padding mask): every
        text entry, then its chunk of the image entries, the last `seq_len` (split after the image tokens)."""
        dim = dim % x.dim()
        text, image = x.split([x.shape[dim] - self.seq_len, self.seq_len], dim=dim)
        return torch.cat([text, self.shard(image, dim)], dim=dim)

    def gather_after_text(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of `shard_after_text`: the text entries kept, the image entries (the last ones) gathered."""
        dim = dim % local.dim()
        text, image = local.split([local.shape[dim] - self.local_len, self.local_len], dim=dim)
        return torch.cat([text, self.gather(image, dim)], dim=dim)

    def relative_l1(self, previous: torch.Tensor, current: torch.Tensor, token_threshold: float = 0.0,
                    batch_group: dist.ProcessGroup | None = None) -> float:
        """sum |current - previous| / sum |previous| over the whole sequence's tokens (rows along dim 1), the
        statistic caches decide on, the same on every rank of the group (a group of one: this rank's tensors), and
        over the whole batch where `batch_group`'s ranks hold the other parts of it. A rank holding its chunk counts
        its own rows (padding left out); a tensor every rank holds whole is counted once. With `token_threshold`,
        only the tokens whose own ratio (means over the last dim) exceeds it count, where the whole sequence has
        any."""
        counted = self._counted_rows(previous.shape[1])
        size = previous[:, counted].abs()
        change = (current - previous)[:, counted].abs()
        sums = [change.sum(dtype=torch.float64), size.sum(dtype=torch.float64)]
        if token_threshold > 0.0:
            chosen = (change.mean(dim=-1) / size.mean(dim=-1) > token_threshold).unsqueeze(-1)
            sums += [(change * chosen).sum(dtype=torch.float64), (size * chosen).sum(dtype=torch.float64),
                     chosen.sum(dtype=torch.float64)]
        sums = torch.stack(sums)
        with torch.no_grad():
            for group in (self.group if self.degree > 1 else None, batch_group):
                if group is not None:
                    dist.all_reduce(sums, group=group)
        if token_threshold > 0.0 and sums[4] > 0:
            return (sums[2] / sums[3]).item()
        return (sums[0] / sums[1]).item()

    def _counted_rows(self, rows: int) -> slice:
        """The rows of a (B, rows, ...) tensor this rank counts towards a statistic of the whole sequence."""
        if self.degree == 1:
            return slice(0, rows)
        if rows == self.local_len:
            return slice(0, self.local_prefix_len(self.seq_len))
        if rows == self.seq_len:
            return slice(0, rows if self.rank == 0 else 0)
        raise RuntimeError(f"xstage_dit: a cache's statistic over {rows} rows, neither this rank's {self.local_len} "
                           f"tokens nor the whole sequence's {self.seq_len}: which rows are whose is unknown")

    def gather_leading(self, local: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of sharding the first `seq_len` entries along `dim` of a tensor whose other entries (text
        tokens after the image tokens) every rank holds whole: the image tokens gathered, the rest kept."""
        dim = dim % local.dim()
        image, rest = local.split([self.local_len, local.shape[dim] - self.local_len], dim=dim)
        return torch.cat([self.gather(image, dim), rest], dim=dim)


def _fresh(chunk: torch.Tensor) -> torch.Tensor:
    """A copy with its own strides: a narrowed batch-1 view passes for contiguous with the whole sequence's
    strides, which a compiled block would guard on apart from its other inputs'."""
    return torch.empty(chunk.shape, dtype=chunk.dtype, device=chunk.device).copy_(chunk)
