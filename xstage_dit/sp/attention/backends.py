"""One registry of Ulysses attention backends, one function per backend.

A backend receives one rank's q, k, v as diffusers builds them for joint attention, (B, T + L, H, D), in the
order `UlyssesLayout` describes, and returns the attention output in the same layout and shape. How the image
tokens travel between ranks is the backend's business. `text_mask`, when given, masks text keys (padding of the
prompt): (B, 1, 1, T), bool (True = attend) or additive (sp/attention/masks.py). `attend` is the attention of the
gathered heads for backends that run a vendor kernel there: SDPA, or the backend the user chose for the model.

Each entry also says what the backend runs at degree 1, which of the planner's predictions is its cost, and what
it needs (CUDA, the group's symmetric-memory fabric, inputs its kernels take). What `enable(backend=...)` names is
a *choice*: a backend (which is its own choice), or a chooser such as "auto" (sp/attention/auto.py) that picks a backend
per call.

The registry owns the list of modules that offer choices (`BACKEND_MODULES`) and imports them the first time it is
asked: adding a backend is one module (its record as `CHOICE`) and one entry there."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol

import torch
import torch.distributed as dist

from ...kernels.rotary_args import JointTokens
from ...logging_utils import warn_once
from ...burst_gap.planner import AttentionShape, Cost, Planner
from .layout import UlyssesLayout

FALLBACK = "reference"  # what runs where a chosen backend cannot: it runs everything


@dataclass(frozen=True)
class BackendModule:
    """A module of this package that offers one choice, as its `CHOICE`. One with an optional dependency offers
    the choice of its own name; without that dependency it is skipped, and asking for its choice says why."""

    name: str  # in sp/attention/
    optional_dependency: str | None = None  # the top-level package it imports that may be missing

    def lacks_dependency(self, error: ImportError) -> bool:
        """Whether `error` says that its optional dependency is missing (any other import error is a bug)."""
        return self.optional_dependency is not None and (error.name or "").split(".")[0] == self.optional_dependency


# in the order `backends()` lists their backends
BACKEND_MODULES = (
    BackendModule("reference"),
    BackendModule("overlap"),
    BackendModule("fused", optional_dependency="triton"),
    BackendModule("auto"),
)

# what a backend may say about its plan for a shape (`xstage-dit plan` prints it), or None
PlanDescription = Callable[[Planner, AttentionShape], str | None]


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
        attend: "LocalAttention",
    ) -> torch.Tensor: ...


class JointUlyssesBackend(Protocol):
    """A backend that takes q, k, v as the caller holds them (JointTokens: parts to join, with a norm and rotation
    to apply on the way), and does that joining inside its own kernels."""

    def __call__(
        self,
        query: JointTokens,
        key: JointTokens,
        value: JointTokens,
        layout: UlyssesLayout,
        group: dist.ProcessGroup,
        scale: float | None,
        text_mask: torch.Tensor | None,
    ) -> torch.Tensor: ...


class LocalAttention(Protocol):
    """Attention on one rank's whole sequence (degree 1), (B, S, H, D) in and out."""

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Backend:
    name: str
    ulysses: UlyssesBackend
    local: LocalAttention  # what the backend runs at degree 1
    cost: Cost  # its predicted time of one call (burst_gap/planner.py)
    needs_cuda: bool = False
    # runs on the group's symmetric-memory fabric (`enable` opens it); its output is a fabric buffer, which the
    # custom op copies out
    symmetric: bool = False
    # whether its kernels take these inputs (dtype, head_dim)
    accepts: Callable[[torch.Tensor], bool] | None = None
    # runs its own attention kernel, not the `attend` it is given (the user's choice cannot apply)
    own_attention: bool = False
    # its entry for q, k, v as JointTokens (others get them joined first)
    joint: JointUlyssesBackend | None = None
    describe_plan: PlanDescription | None = None

    def takes(self, query: torch.Tensor, fabric_ready: bool) -> bool:
        """Whether this backend runs these inputs here; `fabric_ready`: the group has its fabric (or there is no
        group: degree 1)."""
        return ((query.is_cuda or not self.needs_cuda) and (fabric_ready or not self.symmetric)
                and (self.accepts is None or self.accepts(query)))

    # a backend is the choice that always picks itself
    def candidates(self) -> tuple[Backend, ...]:
        return (self,)

    def pick(self, query: torch.Tensor, layout: UlyssesLayout | None, fabric_ready: bool) -> Backend:
        if self.takes(query, fabric_ready or layout is None):
            return self
        warn_once(f"xstage_dit backend {self.name!r} does not take head_dim {query.shape[-1]} {query.dtype} on "
                  f"{query.device.type}; running {FALLBACK!r}")
        return get_backend(FALLBACK)


class BackendChoice(Protocol):
    """What `enable(backend=name)` runs: per call, one backend of its candidates."""

    name: str

    def candidates(self) -> tuple[Backend, ...]: ...

    def pick(self, query: torch.Tensor, layout: UlyssesLayout | None, fabric_ready: bool) -> Backend:
        """The backend for a call with this rank's query (layout None: degree 1); `fabric_ready`: the group has
        its symmetric-memory fabric."""
        ...


_CHOICES: dict[str, BackendChoice] = {}  # by name, in BACKEND_MODULES' order
_UNAVAILABLE: dict[str, str] = {}  # a skipped module's name: why
_loaded = False


def _choices() -> dict[str, BackendChoice]:
    """Every choice by name; the first call imports the modules of BACKEND_MODULES."""
    global _loaded
    if not _loaded:
        for module in BACKEND_MODULES:
            try:
                imported = importlib.import_module(f".{module.name}", __package__)
            except ImportError as error:
                if not module.lacks_dependency(error):
                    raise
                _UNAVAILABLE[module.name] = f"needs {module.optional_dependency}: {error}"
                continue
            _CHOICES[imported.CHOICE.name] = imported.CHOICE
        _loaded = True
    return _CHOICES


def backends() -> list[Backend]:
    """Every backend (choosers excluded), in BACKEND_MODULES' order."""
    return [choice for choice in _choices().values() if isinstance(choice, Backend)]


def costs_of(candidates: Iterable[Backend]) -> dict[str, Cost]:
    """The planner's cost function of each backend, by name (what Planner.predict takes)."""
    return {backend.name: backend.cost for backend in candidates}


def get_backend(name: str) -> Backend:
    backend = get_choice(name)
    assert isinstance(backend, Backend), name
    return backend


def get_choice(name: str) -> BackendChoice:
    return _choices()[name]


def available_backends() -> list[str]:
    """The names `enable(backend=...)` accepts."""
    return sorted(_choices())


def resolve_backend(name: str, device: torch.device) -> BackendChoice:
    """The choice `name` stands for, checked against `device`; raises before any collective."""
    choices = _choices()
    if name in _UNAVAILABLE:
        raise ValueError(f"xstage_dit backend {name!r} {_UNAVAILABLE[name]}")
    if name not in choices:
        raise ValueError(f"unknown xstage_dit backend {name!r}; choose one of {available_backends()}")
    choice = choices[name]
    if isinstance(choice, Backend) and choice.needs_cuda and device.type != "cuda":
        raise ValueError(f"xstage_dit backend {name!r} needs CUDA GPUs (symmetric memory, Triton kernels); "
                         f"this rank runs on {device}")
    return choice


def _runs_on(backend: Backend, device: torch.device) -> bool:
    return device.type == "cuda" or not backend.needs_cuda


def needs_fabric(choice: BackendChoice, device: torch.device) -> bool:
    """Whether `enable` must open the group's symmetric-memory fabric for `choice` on `device`: some backend it
    may pick there runs on one."""
    return any(b.symmetric and _runs_on(b, device) for b in choice.candidates())


def may_take_joint_tokens(choice: BackendChoice, device: torch.device) -> bool:
    """Whether some backend `choice` may pick on `device` takes q, k, v as JointTokens (`Backend.joint`)."""
    return any(b.joint is not None and _runs_on(b, device) for b in choice.candidates())
