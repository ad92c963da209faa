"""A module's forward captured in CUDA graphs, one per input signature, replayed from then on: a step then
costs the host a few copies and one launch instead of thousands of kernel launches.

The signature of a call is the structure of its arguments, each tensor's shape, dtype and device, the value
of every other argument, and the host state the forward reads besides them (whether the step runs FP8). A
signature's first calls run eagerly: the first warms up what is created lazily
(Triton kernels, compiled graphs, communicators, symmetric buffers), the second is watched for operations that
synchronise with the host, which a graph cannot hold (such a forward stays eager, with one warning naming the
operation's place; so does one whose caller names host decisions, e.g. a cache's). The third is captured, with
static copies of the tensor arguments, into a memory pool that every graph of the device shares, and replayed;
later calls copy their tensors into the static ones and replay. The outputs are cloned out of the graph's
buffers, so callers may keep them across calls (the CFG branches of one step do). At most `CAPTURED_SIGNATURES`
graphs are kept per forward, the least recently used dropped first. A call with an argument that is neither a
tensor nor a plain value (an object that may hold tensors or state) runs eagerly.

Where a model's forward synchronises the host (most do it before their blocks: a mask or an index built on the
host) or cannot be captured, each of its repeated blocks is captured and replayed the same way instead, its
whole call (hooks, compiled code, forward); the forward runs eagerly around them. A block's signature includes
the host state it reads besides its arguments (the token split, the step's precision). The blocks of one class
run one after another, so their graphs of one signature share one set of static inputs and outputs (each graph
copies its outputs into the shared ones and leaves its own to the pool): the memory they hold does not grow with
the depth.

A graph replays the model as it was at its capture: the adapters' scales and which adapters run are baked into
it, and parameters given other storage are not read. Before each forward the model's state is read
(runtime/model_changes.py); when it changed (adapters loaded, set, disabled, fused or unloaded, parameters
replaced), the forward's graphs and its blocks' are dropped and captured again as new signatures are.

Work that crosses ranks inside a replay (collectives, symmetric-memory barriers) is not watched by the host: a
replay with cross-rank work waits, after launching the next replay, for the previous one within the timeout,
and raises naming the rank and what it waited for. A graph whose kernels address symmetric memory that was given
back since its capture (a fabric's workspace grew, sp/fabric.py) is dropped and its signature captured again."""
from __future__ import annotations

import contextlib
import enum
import functools
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator

import torch
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from ..logging_utils import logger, warn_once
from ..hooks.module_forward import ReplacedForward, SwappedClasses, named_as
from .model_changes import ModelChanges

CAPTURED_SIGNATURES = 8
EAGER_CALLS = 2  # per signature before its capture: a warm-up, then a watch for host synchronisation
_POOLS: dict[torch.device, torch.cuda.MemPool] = {}  # one memory pool per device, shared by every graph


def shared_pool(device: torch.device) -> torch.cuda.MemPool:
    """The device's graph memory pool: graphs replay one at a time in stream order, so their temporaries may
    share memory (outputs stay owned by their graph). Held here, it outlives the graphs dropped from it."""
    if device not in _POOLS:
        with torch.cuda.device(device):
            _POOLS[device] = torch.cuda.MemPool()
    return _POOLS[device]


@dataclass(frozen=True)
class CrossRankWork:
    """What a replay waits for across ranks, for the error a stalled replay raises."""

    rank: int
    peers: str  # e.g. "the other ranks of its Ulysses group (ranks 0-3)"
    timeout_s: float
    check: Callable[[], None] | None = None  # raises for a wait that timed out inside a kernel of the replay
    # changes when memory that a graph's kernels address across ranks was given back (a symmetric-memory workspace
    # grew): a graph captured at another value is dropped, not replayed
    memory_epoch: Callable[[], int] | None = None


@dataclass
class GraphUse:
    """How a forward's calls ran: `replays` replayed a graph captured by an earlier call; `other_calls` did not
    (warm-up and watched calls, captures, calls that run eagerly)."""

    replays: int = 0
    other_calls: int = 0
    # where the whole forward could not be captured, the same of its blocks' calls
    block_replays: int = 0
    block_other_calls: int = 0


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # the static tensor arguments, in argument order
    outputs: list[Any]  # the output's leaves (tensors in the graph's memory)
    output_spec: TreeSpec
    memory_epoch: int | None  # CrossRankWork.memory_epoch at the capture


@dataclass
class SharedBuffers:
    """The static tensors that graphs of one signature share: the tensor arguments they read and the outputs
    they leave. Forwards that run one after another (the blocks of one class) can share them: each replay's
    outputs are cloned out before the next replay."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


@contextlib.contextmanager
def _host_syncs() -> Iterator[list[str]]:
    """Where the code run inside synchronises the host with the GPU (torch's sync debug mode warns there); other
    warnings pass through."""
    found: list[str] = []
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield found
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    for warning in caught:
        if "synchroniz" in str(warning.message):
            found.append(f"{warning.filename}:{warning.lineno}")
        else:
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)


# argument values a signature holds as they are; an argument of any other type may hold tensors or state that a
# graph would freeze, so a call with one runs eagerly
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout, enum.Enum)


def _signature(leaves: list[Any], spec: TreeSpec, device: torch.device, state: Hashable) -> Hashable | str:
    """A hashable key of the call (with `state`, the host state the forward reads besides its arguments), or why
    it cannot be captured."""
    parts: list[Hashable] = [str(spec), state]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device != device:
                return f"an argument on {leaf.device}, not {device}"
            parts.append((tuple(leaf.shape), leaf.dtype))
        elif isinstance(leaf, slice):
            parts.append((slice, leaf.start, leaf.stop, leaf.step))
        elif isinstance(leaf, _PLAIN):
            parts.append((type(leaf), leaf))
        else:
            return f"an argument of type {type(leaf).__name__}, whose contents a graph could not follow"
    return tuple(parts)


class SignatureGraphs:
    """`inner` captured per input signature and replayed (the module docstring's scheme), for a forward named
    `name`. `state` gives the host state `inner` reads besides its arguments (part of the signature);
    `host_decisions` names what in it decides on the host from call to call (checked before each capture), which
    keeps it eager; `instead`, called once where `inner` synchronises the host or cannot be captured, does
    something else about it and says what ("it runs eagerly" without it)."""

    def __init__(self, name: str, inner: Callable[..., Any], device: torch.device,
                 cross_rank: CrossRankWork | None = None, host_decisions: Callable[[], str | None] | None = None,
                 state: Callable[[], Hashable] | None = None, instead: Callable[[], str] | None = None,
                 shared: OrderedDict[Hashable, SharedBuffers] | None = None) -> None:
        """`shared`: static buffers by signature, shared with other forwards (their graphs copy their outputs
        into them and leave their own to the pool), instead of a set per graph."""
        self.name = name
        self.inner = inner
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.cross_rank = cross_rank
        self.host_decisions = host_decisions
        self.state = state
        self.instead = instead
        self.shared = shared
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()  # eager calls of signatures not captured yet
        self._eager_only = False  # set when the forward synchronises the host or its capture failed
        self._in_flight: torch.cuda.Event | None = None
        self.use = GraphUse()

    def reset(self) -> None:
        """Destroys the graphs now: a graph that holds NCCL collectives and outlives its forward (in a reference
        cycle, say) keeps `destroy_process_group` from returning (pytorch#115388); or one that the model's changes
        made stale."""
        for held in self._graphs.values():
            held.graph.reset()
        self._graphs.clear()
        self._seen.clear()  # a signature captured again warms up again (compiled code may recompile)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return self.inner(*args, **kwargs)  # a compiler traces the model itself; a capture holds this call
        replays = self.use.replays
        output = self._call(args, kwargs)
        if self.use.replays == replays:
            self.use.other_calls += 1
        return output

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self._eager_only:
            return self.inner(*args, **kwargs)
        if torch.is_grad_enabled():
            warn_once(f"xstage_dit: {self.name} runs eagerly under autograd; CUDA graphs replay inference "
                      "(torch.no_grad) calls only")
            return self.inner(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        key = _signature(leaves, spec, self.device, self.state() if self.state is not None else None)
        if isinstance(key, str):
            warn_once(f"xstage_dit: {self.name} gets {key}; those calls run eagerly, without CUDA graphs")
            return self.inner(*args, **kwargs)
        graph = self._graphs.get(key)
        if graph is not None and graph.memory_epoch != self._memory_epoch():
            # its kernels address cross-rank memory given back since its capture
            self._graphs.pop(key).graph.reset()
            graph = None
        if graph is None and self._seen.get(key, 0) < EAGER_CALLS:
            return self._eager(key, leaves, args, kwargs)
        if graph is None:  # this call captures, then replays what it captured
            graph = self._capture(key, leaves, spec)
            return self.inner(*args, **kwargs) if graph is None else self._replay(graph, leaves)
        self._graphs.move_to_end(key)
        self.use.replays += 1
        return self._replay(graph, leaves)

    def _memory_epoch(self) -> int | None:
        work = self.cross_rank
        return work.memory_epoch() if work is not None and work.memory_epoch is not None else None

    @property
    def captured(self) -> int:
        """Graphs held (one per signature)."""
        return len(self._graphs)

    def _decides_on_host(self) -> bool:
        """Whether something in the forward decides on the host from call to call (then it stays eager, said
        once)."""
        deciding = self.host_decisions() if self.host_decisions is not None else None
        if deciding:
            self._eager_only = True
            warn_once(f"xstage_dit: {self.name} has {deciding}, which decide on the host from call to call: it runs "
                      "eagerly, without CUDA graphs")
        return bool(deciding)

    def _give_up(self, why: str) -> None:
        self._eager_only = True
        what_now = self.instead() if self.instead is not None else "it runs eagerly"
        warn_once(f"xstage_dit: {self.name}'s forward {why}: {what_now}")

    def _eager(self, key: Hashable, leaves: list[Any], args: tuple, kwargs: dict) -> Any:
        calls = self._seen.pop(key, 0) + 1
        self._seen[key] = calls
        if len(self._seen) > 4 * CAPTURED_SIGNATURES:
            self._seen.popitem(last=False)
        if calls == 1 and self._decides_on_host():  # said at a signature's first call, whether or not it recurs
            return self.inner(*args, **kwargs)
        if calls < EAGER_CALLS:
            return self.inner(*args, **kwargs)
        with _host_syncs() as syncs:
            output = self.inner(*args, **kwargs)
        if syncs:
            self._give_up(f"synchronises the host with the GPU (at {syncs[0]}), which a CUDA graph cannot hold")
        elif self.shared is not None and key not in self.shared:  # shaped like this call's tensors
            self.shared[key] = SharedBuffers([leaf.clone() for leaf in leaves if isinstance(leaf, torch.Tensor)],
                                             [torch.empty_like(t) for t in tree_flatten(output)[0]
                                              if isinstance(t, torch.Tensor)])
            if len(self.shared) > CAPTURED_SIGNATURES:
                self.shared.popitem(last=False)  # graphs keep theirs
        return output

    def _capture(self, key: Hashable, leaves: list[Any], spec: TreeSpec) -> _Graph | None:
        if self._decides_on_host():
            return None
        if len(self._graphs) == CAPTURED_SIGNATURES:
            self._graphs.popitem(last=False)
            logger.info("xstage_dit: %s holds %d CUDA graphs; dropped the least recently used",
                        self.name, CAPTURED_SIGNATURES)
        buffers = self.shared.get(key) if self.shared is not None else None
        if buffers is not None:
            inputs = buffers.inputs
        else:
            inputs = [leaf.clone() for leaf in leaves if isinstance(leaf, torch.Tensor)]
        tensors = iter(inputs)
        args, kwargs = tree_unflatten([next(tensors) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves],
                                      spec)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=shared_pool(self.device).id, capture_error_mode="thread_local"):
                outputs, output_spec = tree_flatten(self.inner(*args, **kwargs))
                if buffers is not None:
                    copies = iter(buffers.outputs)
                    outputs = [next(copies).copy_(leaf) if isinstance(leaf, torch.Tensor) else leaf
                               for leaf in outputs]
        except RuntimeError as error:  # e.g. the model synchronises with the host
            torch.cuda.synchronize(self.device)
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            self._give_up(f"cannot be captured in a CUDA graph ({cause})")
            return None
        captured = _Graph(graph=graph, inputs=inputs, outputs=outputs, output_spec=output_spec,
                          memory_epoch=self._memory_epoch())
        self._seen.pop(key, None)
        self._graphs[key] = captured
        logger.info("xstage_dit: captured %s's forward in a CUDA graph (%d held)", self.name, len(self._graphs))
        return captured

    def _replay(self, graph: _Graph, leaves: list[Any]) -> Any:
        for static, given in zip(graph.inputs, (leaf for leaf in leaves if isinstance(leaf, torch.Tensor))):
            static.copy_(given)
        graph.graph.replay()
        outputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in graph.outputs]
        if self.cross_rank is not None:
            self._bound_previous_replay()
        return tree_unflatten(outputs, graph.output_spec)

    def _bound_previous_replay(self) -> None:
        """Wait (bounded) for the previous replay while this one is queued behind it: at most two replays are
        in flight, and one that never finishes raises instead of hanging the next host sync."""
        previous, self._in_flight = self._in_flight, torch.cuda.Event()
        self._in_flight.record()
        work = self.cross_rank
        if previous is not None:
            deadline = time.monotonic() + work.timeout_s
            while not previous.query():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"xstage_dit: rank {work.rank} waited more than {work.timeout_s:.0f}s for a CUDA-graph "
                        f"replay of {self.name}'s forward, which waits for {work.peers}")
                time.sleep(1e-4)
        if work.check is not None:
            work.check()


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks: instances of the classes diffusers names in `_repeated_blocks` (what
    `compile_repeated_blocks` compiles) that occur more than once, outermost only."""
    names = set(getattr(model, "_repeated_blocks", None) or ())
    found: dict[str, list[nn.Module]] = {}
    inside: set[int] = set()  # modules within a block already found
    for module in model.modules():
        if id(module) in inside or type(module).__name__ not in names:
            continue
        found.setdefault(type(module).__name__, []).append(module)
        inside.update(id(m) for m in module.modules())
    return [block for blocks in found.values() if len(blocks) > 1 for block in blocks]


_BLOCK_GRAPHS = "_xstage_dit_block_graphs"


@functools.cache
def _graph_calling(cls: type) -> type:
    """A subclass of `cls` whose calls (hooks, compiled code and forward alike) go through the instance's graphs."""

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__[_BLOCK_GRAPHS](*args, **kwargs)

    return named_as(cls)(type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__}))


class GraphedBlocks:
    """Each of `blocks`' calls captured per signature (SignatureGraphs over the block's whole call), from
    `install()` until `remove()`; the graphs of one class and signature share their static buffers."""

    def __init__(self, blocks: list[nn.Module], device: torch.device, cross_rank: CrossRankWork | None,
                 host_decisions: Callable[[nn.Module], str | None] | None,
                 state: Callable[[], Hashable] | None) -> None:
        self.blocks, self.device, self.cross_rank, self.state = blocks, device, cross_rank, state
        self.host_decisions = host_decisions
        self._swaps: list[SwappedClasses] = []

    @property
    def use(self) -> GraphUse:
        """The blocks' calls, summed."""
        uses = [block.__dict__[_BLOCK_GRAPHS].use for block in self.blocks if _BLOCK_GRAPHS in block.__dict__]
        return GraphUse(sum(use.replays for use in uses), sum(use.other_calls for use in uses))

    def install(self) -> None:
        by_class: dict[type, list[nn.Module]] = {}
        for block in self.blocks:
            by_class.setdefault(type(block), []).append(block)
        for cls, blocks in by_class.items():
            shared: OrderedDict[Hashable, SharedBuffers] = OrderedDict()  # the blocks of a class run one by one
            for block in blocks:
                decisions = functools.partial(self.host_decisions, block) if self.host_decisions else None
                block.__dict__[_BLOCK_GRAPHS] = SignatureGraphs(
                    cls.__name__, functools.partial(cls.__call__, block), self.device, self.cross_rank, decisions,
                    self.state, shared=shared)
            self._swaps.append(SwappedClasses(blocks, _graph_calling(cls)))

    def reset(self) -> None:
        """Destroys the blocks' graphs; they are captured again as their signatures come."""
        for block in self.blocks:
            graphs = block.__dict__.get(_BLOCK_GRAPHS)
            if graphs is not None:
                graphs.reset()

    def remove(self) -> None:
        for swap in reversed(self._swaps):
            swap.remove()
        self._swaps = []
        for block in self.blocks:
            graphs = block.__dict__.pop(_BLOCK_GRAPHS, None)
            if graphs is not None:
                graphs.reset()


class GraphedForward:
    """`model.forward` captured per input signature, its calls keyed with `state` (the host state it reads besides
    its arguments); where it synchronises the host or cannot be captured, `blocks` (its repeated blocks) are
    captured one by one instead, their calls keyed with `block_state`. `remove()` restores the forward that was
    there."""

    def __init__(self, model: nn.Module, device: torch.device, cross_rank: CrossRankWork | None = None,
                 host_decisions: Callable[[nn.Module], str | None] | None = None,
                 blocks: list[nn.Module] | None = None, block_state: Callable[[], Hashable] | None = None,
                 state: Callable[[], Hashable] | None = None) -> None:
        """`host_decisions(module)` names what in a module decides on the host from call to call (checked before
        each capture of the model and of a block), which keeps it eager."""
        self._blocks = GraphedBlocks(blocks or [], device, cross_rank, host_decisions, block_state)
        self._model_changes = ModelChanges(model, writes=False, storage=True)
        self._replaced = ReplacedForward(model, lambda *args, **kwargs: self._call(*args, **kwargs))
        self._graphs = SignatureGraphs(type(model).__name__, self._replaced.inner, device, cross_rank,
                                       functools.partial(host_decisions, model) if host_decisions else None,
                                       state, instead=self._capture_blocks)
        functools.update_wrapper(model.forward, self._replaced.inner)  # the model's signature, for layers around it

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if not (torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing()) \
                and self._model_changes.moved():
            self.reset()
        return self._graphs(*args, **kwargs)

    def reset(self) -> None:
        """Destroys the forward's and its blocks' graphs: the model changed since they were captured."""
        if self._graphs.captured or self._blocks.use.replays:
            logger.info("xstage_dit: %s changed (adapters or parameters); its CUDA graphs are captured again",
                        self._graphs.name)
        self._graphs.reset()
        self._blocks.reset()

    def _capture_blocks(self) -> str:
        blocks = self._blocks.blocks
        if not blocks:
            return "it runs eagerly"
        self._blocks.install()
        return f"it runs eagerly, and its {len(blocks)} blocks ({type(blocks[0]).__name__}, ...) replay CUDA graphs"

    @property
    def captured(self) -> int:
        """Graphs of the whole forward held (one per signature)."""
        return self._graphs.captured

    @property
    def use(self) -> GraphUse:
        whole, blocks = self._graphs.use, self._blocks.use
        return GraphUse(whole.replays, whole.other_calls, blocks.replays, blocks.other_calls)

    def remove(self) -> None:
        """Restores the forward and the blocks' classes, and destroys the graphs now (SignatureGraphs.reset)."""
        self._blocks.remove()
        self._replaced.restore()
        self._graphs.reset()
        self._model_changes.remove()
