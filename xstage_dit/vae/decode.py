"""ParallelDecode: a VAE's decode split by rows across the ranks of a group, every rank returning the whole
result. The VAE's `_decode` (what `decode` calls per batch slice) gets this rank's latent rows and the split
layers run; its output rows are gathered. A call the split cannot take runs replicated, saying why once."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..logging_utils import warn_once
from ..hooks.module_forward import ReplacedForward
from .layers import HaloConv, SplitGroupNorm, SplitQueries, WholeRows, kernel_rows, splitting
from .rows import ROWS, RowSplit


@dataclass(frozen=True)
class DecoderLayers:
    """Which modules of a VAE's decoder get which split layer (a patch knows them for its VAE class)."""

    convs: list[nn.Module]  # stride-1, same-padded convolutions with kernels taller than one row
    norms: list[nn.GroupNorm]  # group norms over rows (their statistics are reduced across ranks)
    whole: list[nn.Module] = dataclasses.field(default_factory=list)  # must see every row; run whole on every rank
    split_queries: list[nn.Module] = dataclasses.field(default_factory=list)  # diffusers Attention over the image


class ParallelDecode:
    """`vae._decode` replaced by a row-split decode over `group`; `remove()` restores the VAE exactly."""

    def __init__(self, vae: nn.Module, layers: DecoderLayers, group: dist.ProcessGroup,
                 replicated_because: Callable[[nn.Module], str | None]) -> None:
        self.vae, self.group = vae, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.replicated_because = replicated_because
        self._layers = ([HaloConv(m) for m in layers.convs if kernel_rows(m) > 1]
                        + [SplitGroupNorm(m) for m in layers.norms] + [WholeRows(m) for m in layers.whole]
                        + [SplitQueries(m) for m in layers.split_queries])
        self._decode = ReplacedForward(vae, self._split_decode, attribute="_decode")

    def _split_decode(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        reason = self._why_replicated(z)
        if reason is not None:
            warn_once(f"xstage_dit: this {type(self.vae).__name__} decode runs whole on every rank: {reason}")
            return self._decode.inner(z, *args, **kwargs)
        split = RowSplit.balanced(z.shape[ROWS], self.size, self.rank, self.group)
        with splitting(split):
            out = self._decode.inner(split.own_rows(z).contiguous(), *args, **kwargs)
        return _map_sample(out, lambda rows: split.gather(rows, "the decoded rows"))

    def _why_replicated(self, z: torch.Tensor) -> str | None:
        if getattr(self.vae, "use_tiling", False):
            return "tiling is on (vae.enable_tiling()), and tiles are decided on the whole latent"
        if z.shape[ROWS] < self.size:
            return f"the latent has {z.shape[ROWS]} rows, fewer than the {self.size} ranks"
        return self.replicated_because(self.vae)

    def remove(self) -> None:
        self._decode.restore()
        for layer in reversed(self._layers):
            layer.remove()

    @staticmethod
    def splits(vae: nn.Module | None) -> bool:
        """Whether `vae`'s decode is split already (by the pipeline that shares it)."""
        decode = getattr(vae, "__dict__", {}).get("_decode")
        return isinstance(getattr(decode, "__self__", None), ParallelDecode)


def _map_sample(out: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`_decode`'s output, a tuple or a DecoderOutput, with its sample mapped by `fn`."""
    if isinstance(out, tuple):
        return (fn(out[0]), *out[1:])
    return dataclasses.replace(out, sample=fn(out.sample))


def modules_of(root: nn.Module, classes: Iterable[type]) -> list[nn.Module]:
    """Every module under `root` that is an instance of one of `classes`."""
    classes = tuple(classes)
    return [m for m in root.modules() if isinstance(m, classes)]
