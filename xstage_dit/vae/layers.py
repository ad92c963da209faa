"""The decoder's layers under a row split, each installed on one module instance and undone by `remove()`.
Outside a split decode (and inside a layer that sees every row) they run the module unchanged."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..module_forward import ReplacedForward
from .rows import ROWS, RowSplit

_active: RowSplit | None = None


@contextlib.contextmanager
def splitting(split: RowSplit | None) -> Iterator[None]:
    """The layers run split by `split` (or, with None, unchanged) inside the block."""
    global _active
    outer, _active = _active, split
    try:
        yield
    finally:
        _active = outer


class _Layer:
    """A module's forward replaced while the split layer is installed."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self._replaced = ReplacedForward(module, self._forward)
        self.inner: Callable[..., Any] = self._replaced.inner

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        if _active is None:
            return self.inner(*args, **kwargs)
        return self.split_forward(_active, *args, **kwargs)

    def split_forward(self, split: RowSplit, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def remove(self) -> None:
        self._replaced.restore()


def kernel_rows(module: nn.Module) -> int:
    """Rows of a convolution's kernel: its own weight's, or that of the convolution it wraps as `.conv`."""
    weight = module.weight if isinstance(getattr(module, "weight", None), torch.Tensor) else module.conv.weight
    return weight.shape[ROWS]


class HaloConv(_Layer):
    """A stride-1 convolution that pads its rows by (k - 1) / 2 (zeros, replicate, whatever the module does), run
    on this rank's rows with that many rows of each neighbour added; the output rows computed for the neighbours
    are cut off. At the image's edges the module pads as in one process, so the result is exact for any padding
    mode. Tensor arguments with the input's rows (a causal convolution's cached frames) get the same halo."""

    def __init__(self, module: nn.Module) -> None:
        rows = kernel_rows(module)
        if rows % 2 == 0:
            raise ValueError(f"{type(module).__name__} has an even kernel height {rows}: no symmetric halo")
        self.halo = rows // 2
        super().__init__(module)

    def split_forward(self, split: RowSplit, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        def has_rows(value: Any) -> bool:
            return isinstance(value, torch.Tensor) and value.dim() == x.dim() and value.shape[ROWS] == x.shape[ROWS]

        args_at = [i for i, value in enumerate(args) if has_rows(value)]
        kwargs_at = [key for key, value in kwargs.items() if has_rows(value)]
        extended = split.with_halo([x, *(args[i] for i in args_at), *(kwargs[k] for k in kwargs_at)], self.halo,
                                   f"the halo rows of a {type(self.module).__name__}")
        args, kwargs = list(args), dict(kwargs)
        for i, value in zip(args_at + kwargs_at, extended[1:]):
            (args if isinstance(i, int) else kwargs)[i] = value
        out = self.inner(extended[0], *args, **kwargs)
        if out.shape[ROWS] != extended[0].shape[ROWS]:
            raise RuntimeError(f"parallel VAE decode: {type(self.module).__name__} turned {extended[0].shape[ROWS]} "
                               f"rows into {out.shape[ROWS]}; a row split needs stride-1, same-padded convolutions")
        return split.without_halo(out, self.halo)


class SplitGroupNorm(_Layer):
    """nn.GroupNorm over rows spread across ranks: each rank's count, mean and sum of squared deviations per
    group, combined exactly (Chan et al.), then the usual normalisation and affine map; statistics in float64."""

    def split_forward(self, split: RowSplit, x: torch.Tensor) -> torch.Tensor:
        norm: nn.GroupNorm = self.module
        batch, channels = x.shape[:2]
        compute = torch.promote_types(x.dtype, torch.float32)
        grouped = x.reshape(batch, norm.num_groups, -1).to(compute)
        var, mean = torch.var_mean(grouped, dim=-1, correction=0)
        count = torch.full_like(mean, grouped.shape[-1])
        stats = split.gather_stats(torch.stack([count, mean, var * count], -1).double(),
                                   f"the statistics of a {type(norm).__name__}")
        counts, means, squares = stats.unbind(-1)
        total = counts.sum(0)
        mean_all = (counts * means).sum(0) / total
        var_all = (squares + counts * (means - mean_all) ** 2).sum(0) / total
        scale = torch.rsqrt(var_all + norm.eps).to(compute)
        y = (grouped - mean_all.to(compute).unsqueeze(-1)) * scale.unsqueeze(-1)
        y = y.reshape(x.shape)
        if norm.affine:
            shape = (1, channels) + (1,) * (x.dim() - 2)
            y = y * norm.weight.to(compute).view(shape) + norm.bias.to(compute).view(shape)
        return y.to(x.dtype)


class WholeRows(_Layer):
    """A module that must see every row (attention over the image): run on the gathered rows, unsplit inside,
    and this rank's rows of its output kept. Every rank computes it whole; it sits at the latent resolution."""

    def split_forward(self, split: RowSplit, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        whole = split.gather(x, f"the rows of every rank for a {type(self.module).__name__}")
        with splitting(None):
            out = self.inner(whole, *args, **kwargs)
        return split.own_rows(out)
