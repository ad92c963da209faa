"""One registry of attention strategies: one entry (`Strategy`) describes a whole strategy.

An entry says how a strategy moves one rank's q, k, v (B, T + L, H, D) between the ranks of a Ulysses group and
attends them (`ulysses`, and its exchange alone around another attention of the gathered heads: `exchange`), how
the key/value blocks of a ring travel under it (`ring`: none, point-to-point sends, or stores from our attention
kernel), what it runs at degree 1 (`local`), what calls it takes (`supports`: dtypes, head dims, devices, masks,
pair biases, CUDA graphs; a call it does not take runs FALLBACK's, said once) and its cost for the planner
(`cost`, and the ring transport the planner prices), and its call with FP8 payloads where it has one
(`fp8_payloads`: what `enable(fp8="payloads")` runs while the step runs payloads in FP8). The router
(ulysses.py), the custom op (ops.py), the ring (ring.py), the planner (burst_gap/planner.py, through `costs_of`)
and `enable` (which fabrics to open) read those fields; none of them compares a strategy's name.

What `enable(backend=...)` names is a *choice*: a strategy (which is its own choice), or a chooser such as "auto"
(sp/attention/auto.py) that picks a strategy per call among its candidates.

A choice may have an FP8 variant (`fp8`), what `enable(fp8="attention")` runs in its place: the same exchange,
attending with our FP8 attention kernel (kernels/attention.py with fp8=True) wherever the choice attends (its
`precision` says which the router, the op and the ring run). Variants are entries of the registry like any other
(the custom op finds them by name) but not names `enable(backend=...)` accepts: the knob has one home.

Adding a strategy is one module under sp/attention/ with its kernel and its entry as `CHOICE`, and one line in
config.BACKENDS: nothing else changes. The registry imports the modules the first time
it is asked."""
from __future__ import annotations

import dataclasses
import enum
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Protocol

import torch
import torch.distributed as dist

from ...kernels import triton_runs_on
from ...kernels.attention_args import FP8_DTYPES, SUPPORTED_HEAD_DIMS
from ...kernels.rotary_args import JointTokens
from ...logging_utils import warn_once
from ...burst_gap.planner import PlannedStrategy, Planner
from ...burst_gap.ring_plan import RingTransport
from ...burst_gap.ulysses_plan import AttentionShape, Cost
from ...config import BACKENDS
from .exchange import GatheredAttention
from .layout import UlyssesLayout
from .local import fp8_attention_bshd

FALLBACK = "reference"  # what runs where a chosen backend cannot: it runs everything


class Precision(enum.Enum):
    """What a strategy's attention computes its two products (q·kᵀ, p·v) in."""

    NATIVE = "native"  # the inputs' dtype (SDPA, or our kernel)
    FP8 = "fp8"  # our kernel's FP8 attention: INT8 q·kᵀ, e4m3 p·v, float32 sums (kernels/attention_fp8.py)


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
BACKEND_MODULES = tuple(BackendModule(name, package) for name, package in BACKENDS.items())

# what a strategy may say about its plan for a shape (`xstage-dit plan` prints it), or None
PlanDescription = Callable[[Planner, AttentionShape], str | None]


class UlyssesBackend(Protocol):
    """A strategy's whole Ulysses call: q, k, v exchanged, attended (by `attend`, where it runs a vendor kernel:
    SDPA, or the attention backend the user set on the model), the output exchanged back. `text_mask`, when given,
    masks text keys (padding of the prompt): (B, 1, 1, T), bool (True = attend) or additive (masks.py)."""

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


class UlyssesExchange(Protocol):
    """A strategy's Ulysses exchange alone, around `gathered`, any attention of this rank's gathered heads (a
    ring's, or one that also attends keys every rank holds whole): q, k, v (B, T + L, H, D) in, the output in the
    queries' layout and shape out."""

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layout: UlyssesLayout,
                 group: dist.ProcessGroup, gathered: GatheredAttention) -> torch.Tensor: ...


class JointUlyssesBackend(Protocol):
    """A strategy's Ulysses call that takes q, k, v as the caller holds them (JointTokens: parts to join, with a
    norm and rotation to apply on the way), and does that joining inside its own kernels."""

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


class RingBlocks(enum.Enum):
    """How a ring's key/value blocks travel between its steps under a strategy."""

    NONE = "none"  # it runs no ring: a ring call runs FALLBACK's
    POINT_TO_POINT = "point-to-point"  # sends over the ring group, the next block in flight while one attends
    STORED = "stored"  # our attention kernel stores each key/value tile it loads into the next rank's slot

    @property
    def planned(self) -> RingTransport | None:
        """The planner's model of this transport."""
        return {RingBlocks.NONE: None, RingBlocks.POINT_TO_POINT: RingTransport.OVERLAP,
                RingBlocks.STORED: RingTransport.FUSED}[self]


@dataclass(frozen=True)
class Call:
    """What a choice sees of one attention call before it picks: this rank's query; its `layout` (None: degree
    1); whether the Ulysses group has its symmetric-memory fabric (`fabric_ready`, also where there is no group)
    and the ring group its own (`ring_fabric_ready`); whether it carries a pair bias, a key-padding mask, keys
    every rank holds whole."""

    query: torch.Tensor
    layout: UlyssesLayout | None = None
    fabric_ready: bool = True
    ring_fabric_ready: bool = False
    pair_bias: bool = False
    masked: bool = False
    whole_keys: bool = False
    fp8_payloads: bool = False  # asked for: the model's step runs payloads in FP8 (XStageConfig.fp8 "payloads")

    @property
    def ring(self) -> bool:
        return self.layout is not None and self.layout.ring_degree > 1

    @property
    def own_call(self) -> bool:
        """Whether the strategy's own Ulysses call (`Strategy.ulysses`) runs it: a degree above 1, no ring, no
        pair bias and no whole keys (those run its exchange around another attention of the gathered heads)."""
        return self.layout is not None and not (self.ring or self.pair_bias or self.whole_keys)


@dataclass(frozen=True)
class Supports:
    """What calls a strategy takes. `dtypes` and `head_dims` (None: any), `cuda_only` and `triton` (its kernels
    are Triton's: they run on GPUs, and on the CPU in Triton's interpreter) are its kernels'; a pair bias (Chroma's
    query-key masks, masks.QueryKeyMasks.PAIR_BIAS), a key-padding mask, CUDA-graph capture.
    `exchange_refused`: why it has no exchange that can hold another attention (None: it has one); a ring then
    exchanges by FALLBACK's serial exchange around the ring, and a call over whole keys runs FALLBACK's."""

    dtypes: tuple[torch.dtype, ...] | None = None
    head_dims: tuple[int, ...] | None = None
    cuda_only: bool = False
    triton: bool = False
    pair_bias: bool = False
    key_padding_masks: bool = True
    cuda_graphs: bool = True
    exchange_refused: str | None = None

    def in_fp8(self) -> Supports:
        """What the strategy takes with our FP8 attention kernel in place of its attention: that kernel's dtypes,
        head dims, devices and masks besides its own."""
        dtypes = tuple(dtype for dtype in FP8_DTYPES if dtype in (self.dtypes or FP8_DTYPES))
        return dataclasses.replace(self, dtypes=dtypes, head_dims=SUPPORTED_HEAD_DIMS, triton=True, pair_bias=False)


@dataclass(frozen=True)
class Strategy:
    """One attention strategy, whole (the module's docstring). `name`: what `enable(backend=...)` accepts;
    `ulysses`: its Ulysses call; `exchange`: its exchange alone (None where `supports.exchange_refused` says
    why not); `joint`: its call for q, k, v as JointTokens (others get them joined first); `local`: its kernel
    at degree 1; `ring`: how a ring's blocks travel under it; `cost`: its predicted Ulysses call (its ring's is
    the planner's for `ring.planned`); `symmetric`: its exchange stores into the Ulysses group's fabric
    (`enable` opens it; the output is a fabric buffer, which the custom op copies out); `own_attention`: it
    attends with its own kernel, not the `attend` it is given (an attention backend set on the model cannot
    apply, said once); `fp8_payloads`: its own Ulysses call with its payloads in FP8 (q, k, v as JointTokens; the
    output a tensor of its own), None where its payloads travel in the model's dtype; `describe_plan`: what
    `xstage-dit plan` prints of its plan for a shape; `precision`: what its attention computes in (an FP8 strategy
    attends the gathered heads with its `local` kernel, and its ring with our FP8 kernel); `fp8`: its FP8 variant
    (`with_fp8`), or None."""

    name: str
    ulysses: UlyssesBackend
    local: LocalAttention
    cost: Cost
    exchange: UlyssesExchange | None = None
    ring: RingBlocks = RingBlocks.POINT_TO_POINT
    supports: Supports = field(default_factory=Supports)
    symmetric: bool = False
    own_attention: bool = False
    joint: JointUlyssesBackend | None = None
    fp8_payloads: JointUlyssesBackend | None = None
    describe_plan: PlanDescription | None = None
    precision: Precision = Precision.NATIVE
    fp8: Strategy | None = None

    def __post_init__(self) -> None:
        if (self.exchange is None) == (self.supports.exchange_refused is None):
            raise ValueError(f"strategy {self.name!r}: give its `exchange`, or say in `supports.exchange_refused` "
                             "why it has none")

    def refusal(self, call: Call) -> str | None:
        """Why this strategy does not take `call` here (None: it does)."""
        query, supports = call.query, self.supports
        if ((supports.cuda_only and not query.is_cuda) or (supports.triton and not triton_runs_on(query.device))
                or query.dtype not in (supports.dtypes or (query.dtype,))
                or query.shape[-1] not in (supports.head_dims or (query.shape[-1],))):
            return f"does not take head_dim {query.shape[-1]} {query.dtype} on {query.device.type}"
        if call.pair_bias and not supports.pair_bias:
            return "does not take pair-bias attention masks (Chroma's)"
        if call.masked and not supports.key_padding_masks:
            return "does not take key-padding masks"
        if call.ring and self.ring is RingBlocks.NONE:
            return "runs no ring"
        if call.ring and self.ring is RingBlocks.STORED and not call.ring_fabric_ready:
            return "stores its ring's blocks into symmetric memory, which this ring group has not"
        if call.whole_keys and not call.ring and self.exchange is None:
            return f"takes no keys every rank holds whole: {supports.exchange_refused}"
        uses_fabric = call.own_call or (call.layout is not None and self.exchange is not None)
        if self.symmetric and uses_fabric and not call.fabric_ready:
            return "stores into symmetric memory, which this Ulysses group has not"
        return None

    def with_fp8(self, **own: Any) -> Strategy:
        """This strategy with its FP8 variant, named "<name>+fp8": the same exchange, attending with our FP8 kernel
        at degree 1, over the gathered heads and in its ring; `own`: the variant's own functions where the
        strategy's call our kernel themselves (the fused strategy's Ulysses calls)."""
        variant = dataclasses.replace(self, name=f"{self.name}+fp8", local=fp8_attention_bshd,
                                      supports=self.supports.in_fp8(), own_attention=True, precision=Precision.FP8,
                                      **own)
        return dataclasses.replace(self, fp8=variant)

    def sends_fp8_payloads(self, call: Call) -> bool:
        """Whether `call` runs this strategy's call with FP8 payloads: asked for, and its own call at a degree above
        1 (a ring's exchanges and blocks, and an exchange around another attention, carry the model's dtype); where
        asked for and not run, said once."""
        if not call.fp8_payloads or call.layout is None:
            return False
        why = (f"backend {self.name!r} sends none" if self.fp8_payloads is None
               else "a ring's exchanges and key/value blocks carry the model's dtype" if call.ring
               else "a call with a pair bias or keys every rank holds whole exchanges around another attention, "
                    "in the model's dtype" if not call.own_call else None)
        if why is not None and not torch.compiler.is_compiling():
            warn_once(f"xstage_dit: fp8 payloads: {why}; such calls send {call.query.dtype}")
        return why is None

    def exchange_around(self) -> UlyssesExchange:
        """The exchange that runs around another attention of the gathered heads under this strategy: its own, or
        FALLBACK's (`supports.exchange_refused` says why)."""
        return self.exchange if self.exchange is not None else get_backend(FALLBACK).exchange

    def stores_ring(self, call: Call) -> bool:
        """Whether a ring call's blocks travel by our kernel's stores (else by point-to-point sends)."""
        return call.ring and self.ring is RingBlocks.STORED

    # a strategy is the choice that always picks itself
    def candidates(self) -> tuple[Strategy, ...]:
        return (self,)

    def pick(self, call: Call) -> Strategy:
        why = self.refusal(call)
        if why is None:
            return self
        if not torch.compiler.is_compiling():  # the compiler cannot trace logging
            warn_once(f"xstage_dit backend {self.name!r} {why}; running {FALLBACK!r}")
        return get_backend(FALLBACK)


class BackendChoice(Protocol):
    """What `enable(backend=name)` runs: per call, one strategy of its candidates (all of them of its
    `precision`); `fp8`: the choice `enable(backend=name, fp8="attention")` runs instead, or None."""

    name: str
    precision: Precision
    fp8: BackendChoice | None

    def candidates(self) -> tuple[Strategy, ...]: ...

    def pick(self, call: Call) -> Strategy:
        """The strategy for `call`."""
        ...


_CHOICES: dict[str, BackendChoice] = {}  # by name, in the order of the modules loaded
_UNAVAILABLE: dict[str, str] = {}  # a skipped module's name: why
_loaded = False


def load(modules: Iterable[BackendModule] = BACKEND_MODULES) -> None:
    """The registry built from `modules`, in order: the first lookup loads BACKEND_MODULES. A test that adds a
    strategy module loads its own list, and BACKEND_MODULES again when it is done."""
    global _loaded
    _CHOICES.clear()
    _UNAVAILABLE.clear()
    for module in modules:
        try:
            imported = importlib.import_module(f".{module.name}", __package__)
        except ImportError as error:
            if not module.lacks_dependency(error):
                raise
            _UNAVAILABLE[module.name] = f"needs {module.optional_dependency}: {error}"
            continue
        for choice in (imported.CHOICE, imported.CHOICE.fp8):
            if choice is not None:
                _CHOICES[choice.name] = choice
    _loaded = True


def _choices() -> dict[str, BackendChoice]:
    """Every choice by name."""
    if not _loaded:
        load()
    return _CHOICES


def backends(precision: Precision = Precision.NATIVE) -> list[Strategy]:
    """Every strategy of `precision` (choosers excluded), in BACKEND_MODULES' order."""
    return [choice for choice in _choices().values()
            if isinstance(choice, Strategy) and choice.precision is precision]


def costs_of(candidates: Iterable[Strategy]) -> dict[str, PlannedStrategy]:
    """What the planner reads of each strategy, by name (what Planner.predict, predict_ring and layer_splits
    take)."""
    return {strategy.name: PlannedStrategy(strategy.cost, strategy.ring.planned) for strategy in candidates}


def get_backend(name: str) -> Strategy:
    strategy = get_choice(name)
    assert isinstance(strategy, Strategy), name
    return strategy


def get_choice(name: str) -> BackendChoice:
    return _choices()[name]


def available_backends() -> list[str]:
    """The names `enable(backend=...)` accepts (FP8 variants are reached through `fp8`, not by name)."""
    return sorted(name for name, choice in _choices().items() if choice.precision is Precision.NATIVE)


def resolve_backend(name: str, device: torch.device, cuda_graphs: bool = False, fp8: bool = False) -> BackendChoice:
    """The choice `name` stands for (its FP8 variant with `fp8`), checked against `device` and CUDA-graph capture;
    raises before any collective."""
    if name in _UNAVAILABLE:
        raise ValueError(f"xstage_dit backend {name!r} {_UNAVAILABLE[name]}")
    if name not in available_backends():
        raise ValueError(f"unknown xstage_dit backend {name!r}; choose one of {available_backends()}")
    choice = _choices()[name]
    if fp8:
        if choice.fp8 is None:
            raise ValueError(f"xstage_dit backend {name!r} has no FP8 attention (fp8=\"attention\")")
        if not triton_runs_on(device):
            raise ValueError(f"fp8=\"attention\" runs our Triton attention kernel: it needs Triton and a GPU (or "
                             f"Triton's CPU interpreter, TRITON_INTERPRET=1); this rank runs on {device}")
        choice = choice.fp8
    if isinstance(choice, Strategy) and choice.supports.cuda_only and device.type != "cuda":
        raise ValueError(f"xstage_dit backend {name!r} needs CUDA GPUs (symmetric memory, Triton kernels); "
                         f"this rank runs on {device}")
    if cuda_graphs and not any(s.supports.cuda_graphs for s in choice.candidates()):
        raise ValueError(f"xstage_dit backend {name!r} cannot run inside a CUDA graph: enable it with "
                         "cuda_graphs=False")
    return choice


def _runs_on(strategy: Strategy, device: torch.device) -> bool:
    return device.type == "cuda" or not strategy.supports.cuda_only


def needs_fabric(choice: BackendChoice, device: torch.device, ring: bool = False) -> bool:
    """Whether `enable` must open the Ulysses group's symmetric-memory fabric for `choice` on `device`: some
    strategy it may pick there exchanges through one (inside a ring (`ring`), where its exchange runs there)."""
    return any(s.symmetric and _runs_on(s, device) and (not ring or s.exchange is not None)
               for s in choice.candidates())


def needs_ring_fabric(choice: BackendChoice, device: torch.device) -> bool:
    """Whether `enable` opens the ring group's fabric for `choice` on `device`: some strategy it may pick there
    stores its ring's blocks."""
    return any(s.ring is RingBlocks.STORED and _runs_on(s, device) for s in choice.candidates())


def may_take_joint_tokens(choice: BackendChoice, device: torch.device) -> bool:
    """Whether some strategy `choice` may pick on `device` takes q, k, v as JointTokens (`Strategy.joint`)."""
    return any(s.joint is not None and _runs_on(s, device) for s in choice.candidates())
