"""The decoder's layers under a row split, each installed on one module instance and undone by `remove()`.
Outside a split decode (and inside a layer that sees every row) they run the module unchanged."""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..hooks.module_forward import ReplacedForward
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
    """nn.GroupNorm over rows spread across ranks: each rank's count, sum and sum of squares per group (accumulated
    in float32, combined in float64), then torch's inference batch norm applies the group statistics per
    (sample, channel) in one pass, computing in float32 inside the kernel as GroupNorm does: no float32 copy of
    the activation."""

    def split_forward(self, split: RowSplit, x: torch.Tensor) -> torch.Tensor:
        norm: nn.GroupNorm = self.module
        batch, channels = x.shape[:2]
        grouped = x.reshape(batch, norm.num_groups, -1)
        count = torch.full((batch, norm.num_groups), float(grouped.shape[-1]), dtype=torch.float64, device=x.device)
        local = torch.stack([count, grouped.sum(-1, dtype=torch.float32).double(),
                             (grouped * grouped).sum(-1, dtype=torch.float32).double()], -1)
        count, total, squares = split.gather_equal(local, f"the statistics of a {type(norm).__name__}").sum(0) \
            .unbind(-1)
        mean = total / count
        var = (squares / count - mean * mean).clamp_min(0)
        per_channel = channels // norm.num_groups  # statistics of (sample, group) for each (sample, channel)
        mean, var = (t.repeat_interleave(per_channel, dim=1).reshape(-1).float() for t in (mean, var))
        # float32 parameters with a half-precision input: the kernel's mixed-precision path
        weight = None if norm.weight is None else norm.weight.float().repeat(batch)
        bias = None if norm.bias is None else norm.bias.float().repeat(batch)
        y = F.batch_norm(x.reshape(1, batch * channels, -1), mean, var, weight, bias, False, 0.0, norm.eps)
        return y.reshape(x.shape)


class WholeRows(_Layer):
    """A module that must see every row (attention over the image): run on the gathered rows, unsplit inside,
    and this rank's rows of its output kept. Every rank computes it whole; it sits at the latent resolution."""

    def split_forward(self, split: RowSplit, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        whole = split.gather(x, f"the rows of every rank for a {type(self.module).__name__}")
        with splitting(None):
            out = self.inner(whole, *args, **kwargs)
        return split.own_rows(out)


class SplitQueries(_Layer):
    """diffusers' `Attention` over the image with this rank's rows as the queries and every rank's rows as the keys
    and values: the attention's group norm (split) normalises this rank's rows, and the normalised rows of every
    rank, gathered, go in as the key/value input. Each rank computes only its own rows' share of the attention.
    Needs an attention whose keys are its normalised input (no spatial or cross norm)."""

    def __init__(self, module: nn.Module) -> None:
        if getattr(module, "spatial_norm", None) is not None or getattr(module, "norm_cross", None):
            raise ValueError(f"{type(module).__name__} normalises its keys on its own: its queries cannot be split")
        super().__init__(module)

    def split_forward(self, split: RowSplit, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        attention = self.module
        x = x.contiguous()
        normalised = x.flatten(2) if attention.group_norm is None else attention.group_norm(x.flatten(2))
        keys = split.gather(normalised.view_as(x), f"the key rows of every rank for a {type(attention).__name__}")
        return self.inner(x, *args, encoder_hidden_states=keys.flatten(2).transpose(1, 2), **kwargs)
