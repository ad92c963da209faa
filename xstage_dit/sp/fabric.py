"""Where the fused backend's kernels store: a fabric gives a rank named buffers that every rank of its group can
store into, and a barrier after which every rank's earlier stores are visible to every rank.

A buffer is this rank's tensor plus a table of where the same buffer of every rank sits, as element offsets from
this rank's tensor (what the store kernels take, kernels/tables.py). Buffers are allocated on first use of a
(name, shape, dtype) and then reused at fixed addresses, so the kernels' pointers stay valid across calls (and
CUDA-graph replays).

Two fabrics:
- SymmetricFabric: a process group's symmetric memory (real peers, or processes that share a GPU), with a barrier
  kernel of release/acquire signals bounded by a timeout;
- LoopbackFabric: N ranks simulated in one process on one device (tests and kernel benchmarks). Its ranks'
  barriers wait for nothing: `run_in_lockstep` orders the simulated ranks' steps instead."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generator, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..kernels.tables import offset_table
from ..runtime.symmetric import SymmetricHeap, SymmetricTensor

T = TypeVar("T")


@dataclass(frozen=True)
class FabricBuffer:
    tensor: torch.Tensor  # this rank's buffer
    destinations: torch.Tensor  # int64 element offsets of every rank's buffer from `tensor`, by rank
    addresses: tuple[int, ...]  # every rank's buffer's address in this process, by rank (for TMA descriptors)


class Fabric(Protocol):
    rank: int
    world_size: int

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> FabricBuffer:
        """This rank's buffer `name` (allocated on first use, collectively where ranks are processes)."""
        ...

    def barrier(self, what: str) -> None:
        """Every rank's stores issued before this (in stream order) are visible to every rank after it; `what`
        names what is waited for, in the error a timed-out wait raises."""
        ...


class SymmetricFabric:
    """A process group's symmetric memory. Created collectively (`open_fabric`), once per group."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.heap = SymmetricHeap(group, device)
        self.rank, self.world_size = self.heap.rank, self.heap.world_size
        self.timeout_s = timeout_s
        self._buffers: dict[tuple, FabricBuffer] = {}
        self._allocations: list[SymmetricTensor] = []
        # barrier state: one int32 slot per peer on every rank's pad, this rank's epoch per peer, and where a
        # timed-out wait reports (pinned host memory the kernel writes: peer + 1 and the epoch, zeros when fine)
        pads = self.heap.allocate((self.world_size,), torch.int32, zero=True)
        self._allocations.append(pads)
        self._pads = torch.tensor(pads.peer_addresses, dtype=torch.int64, device=device)
        self._epochs = torch.zeros(self.world_size, dtype=torch.int32, device=device)
        self._error = torch.zeros(2, dtype=torch.int64, pin_memory=True)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> FabricBuffer:
        key = (name, tuple(shape), dtype)
        if key not in self._buffers:
            symmetric = self.heap.allocate(shape, dtype)
            self._allocations.append(symmetric)  # keeps the peers' mappings alive
            self._buffers[key] = FabricBuffer(symmetric.tensor, offset_table(symmetric.peer_addresses,
                                                                              symmetric.tensor),
                                              tuple(symmetric.peer_addresses))
        return self._buffers[key]

    def barrier(self, what: str) -> None:
        from ..kernels.signals import barrier  # Triton: imported where a fabric is in use

        self.raise_if_timed_out(what)
        barrier(self._pads, self._epochs, self.rank, int(self.timeout_s * 1e9), self._error)

    def raise_if_timed_out(self, what: str) -> None:
        """Raise if an earlier barrier's wait ran out (the kernel reports without a host sync; this reads what it
        wrote so far)."""
        peer = int(self._error[0]) - 1
        if peer >= 0:
            raise TimeoutError(
                f"xstage_dit: rank {self.rank} waited more than {self.timeout_s:.0f}s for rank {peer} at a "
                f"symmetric-memory barrier (its epoch {int(self._error[1])}) before {what}"
            )


_FABRICS: dict[str, SymmetricFabric] = {}


def open_fabric(group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> SymmetricFabric:
    """The group's fabric, created on first use (collectively: every rank of the group calls this)."""
    if group.group_name not in _FABRICS:
        _FABRICS[group.group_name] = SymmetricFabric(group, device, timeout_s)
    return _FABRICS[group.group_name]


def fabric_of(group_name: str) -> SymmetricFabric | None:
    """The fabric `open_fabric` made for the group, if any."""
    return _FABRICS.get(group_name)


def symmetric_backends_in_use() -> list[str]:
    """The symmetric-memory backends of this process's fabrics (for benchmark records)."""
    return sorted({fabric.heap.backend for fabric in _FABRICS.values()})


class LoopbackFabric:
    """N simulated ranks on one device: rank r's buffer `name` and every other rank's are local tensors, so the
    store kernels issue exactly the stores they would issue to peers. `initialise` is applied to every new buffer
    (tests fill NaN, so that unwritten rows show; benchmarks draw random values, as peers' rows would hold)."""

    def __init__(self, world_size: int, device: torch.device | str,
                 initialise: Callable[[torch.Tensor], object] | None = None) -> None:
        self.world_size = world_size
        self.device = torch.device(device)
        self.initialise = initialise
        self._tensors: dict[tuple, list[torch.Tensor]] = {}

    def rank(self, rank: int) -> "LoopbackRank":
        return LoopbackRank(self, rank)

    def tensors(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """Every simulated rank's buffer `name`, by rank."""
        key = (name, tuple(shape), dtype)
        if key not in self._tensors:
            self._tensors[key] = [torch.empty(shape, dtype=dtype, device=self.device)
                                  for _ in range(self.world_size)]
            if self.initialise is not None:
                for tensor in self._tensors[key]:
                    self.initialise(tensor)
        return self._tensors[key]


class LoopbackRank:
    """One simulated rank of a LoopbackFabric, as a Fabric."""

    def __init__(self, loopback: LoopbackFabric, rank: int) -> None:
        self.loopback, self.rank, self.world_size = loopback, rank, loopback.world_size
        self._buffers: dict[tuple, FabricBuffer] = {}

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> FabricBuffer:
        key = (name, tuple(shape), dtype)
        if key not in self._buffers:
            tensors = self.loopback.tensors(name, shape, dtype)
            mine, addresses = tensors[self.rank], tuple(t.data_ptr() for t in tensors)
            self._buffers[key] = FabricBuffer(mine, offset_table(addresses, mine), addresses)
        return self._buffers[key]

    def barrier(self, what: str) -> None:
        """Nothing to wait for in one stream: run_in_lockstep orders the simulated ranks' steps."""


# an algorithm of one rank, paused before each barrier: it yields what the barrier guards and returns its result
Steps = Generator[str, None, T]


def gather_steps(local: torch.Tensor, fabric: Fabric, name: str) -> Steps[torch.Tensor]:
    """Every rank's `local` (R, D) rows stacked rank-major, (N * R, D), on every rank: each rank stores its rows
    into every rank's buffer `name`. Returns a copy, taken before the second barrier, so that a rank storing the
    next gather into this buffer cannot overwrite rows a slower rank has not read yet."""
    from ..kernels.experts import store_rows  # Triton: imported where a fabric is in use

    rows, n = local.shape[0], fabric.world_size
    buffer = fabric.buffer(name, (n * rows, local.shape[1]), local.dtype)
    # this rank's rows go to rows [rank * R, (rank + 1) * R) of every buffer: with that slice of its own buffer as
    # the base, the buffers' offsets from each other still hold; slot s sends row s % R to rank s // R
    mine = buffer.tensor[fabric.rank * rows:(fabric.rank + 1) * rows]
    store_rows(local, torch.arange(n * rows, device=local.device, dtype=torch.int32) % rows, buffer.destinations,
               mine)
    yield f"every rank's {name}"
    gathered = buffer.tensor.clone()
    yield f"every rank to have read its {name}"
    return gathered


def run_in_lockstep(ranks: Sequence[Steps], barrier: Callable[[str], None]) -> list:
    """Run every rank's steps up to its next barrier, then pass that barrier, until every rank returned; the
    ranks' results in order. With one rank this is a rank's call; with N simulated ranks on one stream it orders
    their stores as the barriers would."""
    results: list = [None] * len(ranks)
    pending = dict(enumerate(ranks))
    while pending:
        guarded = None
        for index, steps in list(pending.items()):
            try:
                guarded = next(steps)
            except StopIteration as done:
                results[index] = done.value
                del pending[index]
        if pending:
            barrier(guarded)
    return results
