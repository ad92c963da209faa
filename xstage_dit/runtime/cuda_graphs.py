"""A module's forward captured in CUDA graphs, one per input signature, replayed from then on: a step then
costs the host a few copies and one launch instead of thousands of kernel launches.

The signature of a call is the structure of its arguments, each tensor's shape, dtype and device, and the value
of every other argument. A signature's first calls run eagerly: the first warms up what is created lazily
(Triton kernels, compiled graphs, communicators, symmetric buffers), the second is watched for operations that
synchronise with the host, which a graph cannot hold (such a forward stays eager, with one warning naming the
operation's place; so does one whose caller names host decisions, e.g. a cache's). The third is captured, with
static copies of the tensor arguments, into a memory pool that every graph of the device shares, and replayed;
later calls copy their tensors into the static ones and replay. The outputs are cloned out of the graph's
buffers, so callers may keep them across calls (the CFG branches of one step do). At most `CAPTURED_SIGNATURES`
graphs are kept per forward, the least recently used dropped first.

Work that crosses ranks inside a replay (collectives, symmetric-memory barriers) is not watched by the host: a
replay with cross-rank work waits, after launching the next replay, for the previous one within the timeout,
and raises naming the rank and what it waited for."""
from __future__ import annotations

import contextlib
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
from ..module_forward import ReplacedForward

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


@dataclass
class GraphUse:
    """How a forward's calls ran: `replays` replayed a graph captured by an earlier call; `other_calls` did not
    (warm-up and watched calls, captures, calls that run eagerly)."""

    replays: int = 0
    other_calls: int = 0


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # the static tensor arguments, in argument order
    outputs: list[Any]  # the output's leaves (tensors in the graph's memory)
    output_spec: TreeSpec


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


def _signature(leaves: list[Any], spec: TreeSpec, device: torch.device) -> Hashable | str:
    """A hashable key of the call, or why it cannot be captured."""
    parts: list[Hashable] = [str(spec)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device != device:
                return f"an argument on {leaf.device}, not {device}"
            parts.append((tuple(leaf.shape), leaf.dtype))
        else:
            try:
                hash(leaf)
            except TypeError:
                leaf = repr(leaf)
            parts.append((type(leaf), leaf))
    return tuple(parts)


class GraphedForward:
    """`model.forward` captured per input signature; `remove()` restores the forward that was there."""

    def __init__(self, model: nn.Module, device: torch.device, cross_rank: CrossRankWork | None = None,
                 host_decisions: Callable[[], str | None] | None = None) -> None:
        """`host_decisions` names what in the model decides on the host from call to call (checked before each
        capture), which keeps it eager."""
        self.name = type(model).__name__
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.cross_rank = cross_rank
        self.host_decisions = host_decisions
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._seen: OrderedDict[Hashable, int] = OrderedDict()  # eager calls of signatures not captured yet
        self._eager_only = False  # set when the forward synchronises the host or its capture failed
        self._in_flight: torch.cuda.Event | None = None
        self.use = GraphUse()

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self(*args, **kwargs)

        self._replaced = ReplacedForward(model, forward)
        self._inner = self._replaced.inner
        functools.update_wrapper(forward, self._inner)  # its signature is the model's, for layers around it

    def remove(self) -> None:
        """Restores the forward and destroys the graphs now: a graph that holds NCCL collectives and outlives
        this (in a reference cycle, say) keeps `destroy_process_group` from returning (pytorch#115388)."""
        self._replaced.restore()
        for held in self._graphs.values():
            held.graph.reset()
        self._graphs.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._inner(*args, **kwargs)  # a compiler traces the model itself
        replays = self.use.replays
        output = self._call(args, kwargs)
        if self.use.replays == replays:
            self.use.other_calls += 1
        return output

    def _call(self, args: tuple, kwargs: dict) -> Any:
        if self._eager_only:
            return self._inner(*args, **kwargs)
        if torch.is_grad_enabled():
            warn_once(f"xstage_dit: {self.name} runs eagerly under autograd; CUDA graphs replay inference "
                      "(torch.no_grad) calls only")
            return self._inner(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        key = _signature(leaves, spec, self.device)
        if isinstance(key, str):
            warn_once(f"xstage_dit: {self.name} gets {key}; those calls run eagerly, without CUDA graphs")
            return self._inner(*args, **kwargs)
        graph = self._graphs.get(key)
        if graph is None and self._seen.get(key, 0) < EAGER_CALLS:
            return self._eager(key, args, kwargs)
        if graph is None:  # this call captures, then replays what it captured
            graph = self._capture(key, leaves, spec)
            return self._inner(*args, **kwargs) if graph is None else self._replay(graph, leaves)
        self._graphs.move_to_end(key)
        self.use.replays += 1
        return self._replay(graph, leaves)

    @property
    def captured(self) -> int:
        """Graphs held (one per signature)."""
        return len(self._graphs)

    def _eager(self, key: Hashable, args: tuple, kwargs: dict) -> Any:
        calls = self._seen.pop(key, 0) + 1
        self._seen[key] = calls
        if len(self._seen) > 4 * CAPTURED_SIGNATURES:
            self._seen.popitem(last=False)
        if calls < EAGER_CALLS:
            return self._inner(*args, **kwargs)
        with _host_syncs() as syncs:
            output = self._inner(*args, **kwargs)
        if syncs:
            self._eager_only = True
            warn_once(f"xstage_dit: {self.name}'s forward synchronises the host with the GPU (at {syncs[0]}), "
                      "which a CUDA graph cannot hold: it runs eagerly")
        return output

    def _capture(self, key: Hashable, leaves: list[Any], spec: TreeSpec) -> _Graph | None:
        deciding = self.host_decisions() if self.host_decisions is not None else None
        if deciding:
            self._eager_only = True
            warn_once(f"xstage_dit: {self.name} has {deciding}, which decide on the host from call to call: it runs "
                      "eagerly, without CUDA graphs")
            return None
        if len(self._graphs) == CAPTURED_SIGNATURES:
            self._graphs.popitem(last=False)
            logger.info("xstage_dit: %s holds %d CUDA graphs; dropped the least recently used",
                        self.name, CAPTURED_SIGNATURES)
        static = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        args, kwargs = tree_unflatten(static, spec)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=shared_pool(self.device).id, capture_error_mode="thread_local"):
                output = self._inner(*args, **kwargs)
        except RuntimeError as error:  # e.g. the model synchronises with the host
            self._eager_only = True
            cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            warn_once(f"xstage_dit: {self.name}'s forward cannot be captured in a CUDA graph ({cause}); it runs "
                      "eagerly")
            torch.cuda.synchronize(self.device)
            return None
        outputs, output_spec = tree_flatten(output)
        captured = _Graph(graph=graph, inputs=[t for t in static if isinstance(t, torch.Tensor)], outputs=outputs,
                          output_spec=output_spec)
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
