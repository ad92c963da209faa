"""One registry of Ulysses attention backends, one function per backend.

A backend receives one rank's q, k, v as diffusers builds them for joint attention, (B, T + L, H, D): T
replicated text tokens and this rank's L image/video tokens, in the order `UlyssesLayout` gives, and returns the
attention output in the same layout and shape. How the image tokens travel between ranks is the backend's business.
`text_mask`, when given, masks text keys (padding of the prompt): (B, 1, 1, T), bool (True = attend) or additive."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class UlyssesLayout:
    """Where the tokens of one attention call live.

    text_len: replicated text tokens in q/k/v (0 for models without joint attention), before the image tokens
        if `text_first`, else after them.
    seq_len: true image/video tokens of the whole sequence; local_len: tokens per rank, padding included.
    """

    text_len: int
    seq_len: int
    local_len: int
    degree: int
    rank: int
    text_first: bool = True

    @property
    def padded_len(self) -> int:
        return self.local_len * self.degree

    def split(self, joint: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(text, image) parts of a (B, T + L, ...) tensor."""
        if self.text_first:
            return joint[:, : self.text_len], joint[:, self.text_len :]
        return joint[:, self.local_len :], joint[:, : self.local_len]

    def join(self, text: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """The inverse of `split`."""
        return torch.cat([text, image] if self.text_first else [image, text], dim=1)


class UlyssesBackend(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layout: UlyssesLayout,
        group: dist.ProcessGroup,
        scale: float | None,
        text_mask: torch.Tensor | None,
    ) -> torch.Tensor: ...


def key_mask(text_mask: torch.Tensor | None, image_len: int) -> torch.Tensor | None:
    """The SDPA mask over [text, image] keys that applies `text_mask` to the text keys and lets every image key
    through; None without a text mask."""
    if text_mask is None:
        return None
    shape = (*text_mask.shape[:-1], image_len)
    if text_mask.dtype == torch.bool:
        image = torch.ones(shape, dtype=torch.bool, device=text_mask.device)
    else:
        image = torch.zeros(shape, dtype=text_mask.dtype, device=text_mask.device)
    return torch.cat([text_mask, image], dim=-1)


class LocalAttention(Protocol):
    """Attention on one rank's whole sequence (degree 1), (B, S, H, D) in and out."""

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Backend:
    ulysses: UlyssesBackend
    local: LocalAttention  # what the backend runs at degree 1
    needs_cuda: bool
    # runs on the group's symmetric-memory pool (`enable` creates it); its output is a pooled buffer, which the
    # custom op copies out
    symmetric: bool = False
    # whether its kernels take these inputs (dtype, head_dim); where not, the backend itself falls back
    accepts: Callable[[torch.Tensor], bool] | None = None


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, local: LocalAttention, needs_cuda: bool = False, symmetric: bool = False,
                     accepts: Callable[[torch.Tensor], bool] | None = None
                     ) -> Callable[[UlyssesBackend], UlyssesBackend]:
    def decorator(fn: UlyssesBackend) -> UlyssesBackend:
        _BACKENDS[name] = Backend(fn, local, needs_cuda, symmetric, accepts)
        return fn

    return decorator


def needs_symmetric_memory(name: str, device: torch.device) -> bool:
    """Whether `enable` must set up the group's symmetric pool for backend `name` on `device` ("auto": if any
    backend it may pick there needs one)."""
    names = list(_BACKENDS) if name == "auto" else [name]
    return any(_BACKENDS[n].symmetric and (device.type == "cuda" or not _BACKENDS[n].needs_cuda) for n in names)


def runnable(name: str, query: torch.Tensor, pool_ready: bool) -> bool:
    """Whether backend `name` runs these inputs as itself (not through a fallback); `pool_ready`: the group
    has a symmetric pool."""
    backend = _BACKENDS.get(name)
    return (backend is not None and (query.is_cuda or not backend.needs_cuda)
            and (pool_ready or not backend.symmetric) and (backend.accepts is None or backend.accepts(query)))


def available_backends() -> list[str]:
    """Backend names `enable(backend=...)` accepts, "auto" included."""
    return ["auto", *sorted(_BACKENDS)]


def resolve_backend(name: str, device: torch.device) -> str:
    """The backend a requested name runs on `device`; "auto" stays "auto" (sp/auto.py chooses per call where
    this GPU has a Burst-Gap calibration, else runs the reference). Raises before any collective."""
    if name == "auto":
        return name
    if name not in _BACKENDS:
        raise ValueError(f"unknown xstage_dit backend {name!r}; choose one of {available_backends()}")
    if _BACKENDS[name].needs_cuda and device.type != "cuda":
        raise ValueError(f"xstage_dit backend {name!r} needs CUDA GPUs (symmetric memory, Triton kernels); "
                         f"this rank runs on {device}")
    return name


def get_backend(name: str) -> Backend:
    return _BACKENDS[name]
