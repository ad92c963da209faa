"""One registry of Ulysses attention backends, one function per backend.

A backend receives one rank's q, k, v as diffusers builds them for joint attention, (B, T + L, H, D) with the T
replicated text tokens first and this rank's L image/video tokens after, and returns the attention output in the
same layout and shape. How the image tokens travel between ranks is the backend's business."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class UlyssesLayout:
    """Where the tokens of one attention call live.

    text_len: replicated text tokens at the front of q/k/v (0 for models without joint attention).
    seq_len: true image/video tokens of the whole sequence; local_len: tokens per rank, padding included.
    """

    text_len: int
    seq_len: int
    local_len: int
    degree: int
    rank: int

    @property
    def padded_len(self) -> int:
        return self.local_len * self.degree


class UlyssesBackend(Protocol):
    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        layout: UlyssesLayout,
        group: dist.ProcessGroup,
        scale: float | None,
    ) -> torch.Tensor: ...


_BACKENDS: dict[str, UlyssesBackend] = {}


def register_backend(name: str) -> Callable[[UlyssesBackend], UlyssesBackend]:
    def decorator(fn: UlyssesBackend) -> UlyssesBackend:
        _BACKENDS[name] = fn
        return fn

    return decorator


def available_backends() -> list[str]:
    """Backend names `enable(backend=...)` accepts, "auto" included."""
    return ["auto", *sorted(_BACKENDS)]


def resolve_backend(name: str) -> str:
    """The concrete backend for a requested name; "auto" picks the best one available."""
    if name == "auto":
        return "reference"
    if name not in _BACKENDS:
        raise ValueError(f"unknown xstage_dit backend {name!r}; choose one of {available_backends()}")
    return name


def get_backend(name: str) -> UlyssesBackend:
    return _BACKENDS[name]
