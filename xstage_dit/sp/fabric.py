"""Where the fused backend's kernels store: a fabric gives a rank named buffers that every rank of its group can
store into, and a barrier after which every rank's earlier stores are visible to every rank.

A buffer is this rank's tensor plus a table of where the same buffer of every rank sits, as element offsets from
this rank's tensor (what the store kernels take, kernels/tables.py).

Memory: each fabric owns one workspace, a single allocation per rank (symmetric across the group), grown to the
largest need any call has had and never shrunk; every call carves it anew into the views it names (`carve`, one
call per algorithm call, with every view the call uses). A growth allocates the new size (collectively, on every
rank at the same call: the carve of a call is the same on every rank), after the device finished with the old
memory, which is then given back; so the memory held is the largest call's need, not the sum over the sizes seen.
A buffer handed out before a growth must not be used after it: callers take their buffers from `carve` at each
call and keep none across calls, and a CUDA graph, which holds the addresses of its capture, is replayed only at
the `memory_epoch` of its capture (runtime/cuda_graphs.py). A growth cannot happen while a CUDA graph is being
captured (the new memory's rendezvous is a collective of the host): it raises, asking for a call at the largest
size before the capture (the graphs of this library capture a signature's third call, after two eager ones).

Two regions keep a call's views from stepping on the previous call's: views read only before the call's last
barrier (every rank's earlier reads are done once a peer passes that barrier) share the front region; a view
`kept` past the call (its result, read after the last barrier, until this rank's next call on the fabric) lies
in the back region, which peers store into only after a call's first barrier. Both regions grow to their own
largest need.

Two fabrics:
- SymmetricFabric: a process group's symmetric memory (real peers, or processes that share a GPU), with a barrier
  kernel of release/acquire signals bounded by a timeout (GPU only);
- LoopbackFabric: N ranks simulated in one process on one device (tests and kernel benchmarks). Its ranks'
  barriers wait for nothing: `run_in_lockstep` orders the simulated ranks' steps instead.

`open_fabric` keeps one SymmetricFabric per group while something holds it (`enable` holds it for its models;
`disable` releases it): the last release closes it and gives its memory back, as does `close_fabrics`."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Generator, Hashable, Protocol, Sequence, TypeVar

import torch
import torch.distributed as dist

from ..kernels.tables import offset_table
from ..runtime.symmetric import SymmetricHeap

T = TypeVar("T")

# every view starts this many bytes apart from the workspace's start: a multiple of the store kernels' 16-element
# alignment for every dtype (kernels/tables.py) and of TMA's 16-byte bases
ALIGNMENT_BYTES = 512
_CARVES_HELD = 32  # carves (their views' tensors) remembered per rank, the least recently used dropped first


@dataclass(frozen=True)
class FabricBuffer:
    tensor: torch.Tensor  # this rank's buffer
    destinations: torch.Tensor  # int64 element offsets of every rank's buffer from `tensor`, by rank
    addresses: tuple[int, ...]  # every rank's buffer's address in this process, by rank (for TMA descriptors)


@dataclass(frozen=True)
class View:
    """A buffer one call needs: its name, shape and dtype. `kept`: read after the call's last barrier (the call's
    result, valid until this rank's next call on the fabric); peers store into it only after the call's first
    barrier."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    kept: bool = False

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT_BYTES) * ALIGNMENT_BYTES


@dataclass(frozen=True)
class Need:
    """Bytes of a workspace's two regions: views read within their call (front), views kept past it (back)."""

    within: int = 0
    kept: int = 0

    @classmethod
    def of(cls, views: Sequence[View]) -> "Need":
        return cls(sum(_aligned(v.nbytes) for v in views if not v.kept), sum(_aligned(v.nbytes) for v in views
                                                                          if v.kept))

    @property
    def total(self) -> int:
        return self.within + self.kept

    def covers(self, other: "Need") -> bool:
        return self.within >= other.within and self.kept >= other.kept

    def union(self, other: "Need") -> "Need":
        return Need(max(self.within, other.within), max(self.kept, other.kept))


@dataclass(frozen=True)
class Carve:
    """Where one call's views sit in a workspace of `capacity`: each view's byte offset from its start, front views
    from 0, kept views from the end of the front region."""

    offsets: tuple[tuple[View, int], ...]
    capacity: Need

    @classmethod
    def of(cls, views: Sequence[View], capacity: Need) -> "Carve":
        names = [view.name for view in views]
        if len(set(names)) != len(names):
            raise ValueError(f"xstage_dit: a call's fabric views need distinct names, not {names}")
        offsets, front, back = [], 0, capacity.within
        for view in views:
            if view.kept:
                offsets.append((view, back))
                back += _aligned(view.nbytes)
            else:
                offsets.append((view, front))
                front += _aligned(view.nbytes)
        return cls(tuple(offsets), capacity)


@dataclass(frozen=True)
class Allocation:
    """One workspace allocation as this process sees it: the byte tensors it holds, by rank (a process its own;
    a loopback fabric every simulated rank's), every rank's base address by rank, and what keeps the peers'
    mappings alive."""

    tensors: dict[int, torch.Tensor]
    addresses: tuple[int, ...]
    handle: object = None


def capturing() -> bool:
    """Whether this thread's current CUDA stream is capturing a graph (never without CUDA)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


_epoch = 0  # growths of any workspace in this process: a CUDA graph replays only at the epoch of its capture


def memory_epoch() -> int:
    """Changes whenever a fabric's workspace grows (its earlier addresses are given back)."""
    return _epoch


class Workspace:
    """A fabric's grow-only memory (the module docstring): `allocate(nbytes)` makes an allocation on every rank
    (collectively where ranks are processes); `what` names it in errors."""

    def __init__(self, allocate: Callable[[int], Allocation], what: str) -> None:
        self._allocate, self.what = allocate, what
        self.capacity = Need()
        self.generation = 0  # growths so far
        self.allocation: Allocation | None = None
        self._carves: OrderedDict[tuple, dict[str, FabricBuffer]] = OrderedDict()
        self._destinations: dict[tuple[int, torch.dtype], torch.Tensor] = {}  # by (rank, dtype)
        self._dtypes: set[torch.dtype] = set()  # of every view carved so far

    @property
    def nbytes(self) -> int:
        """Bytes this rank holds."""
        return self.capacity.total

    def reserve(self, views: Sequence[View]) -> None:
        """Grow now to fit a call of `views` (before a CUDA-graph capture, say)."""
        need = Need.of(views)
        if not self.capacity.covers(need):
            self._grow(self.capacity.union(need), views)

    def carve(self, views: Sequence[View], rank: int) -> dict[str, FabricBuffer]:
        """Rank `rank`'s buffers for one call of `views`, by name, valid until the workspace grows (a later call
        with a larger need)."""
        key = (rank, tuple(views))
        carved = self._carves.get(key)
        if carved is not None:
            self._carves.move_to_end(key)
            return carved
        self.reserve(views)
        dtypes = {view.dtype for view in views}
        if not dtypes <= self._dtypes:
            self._tabulate(dtypes)
        base = self.allocation.tensors[rank]
        carved = {}
        for view, offset in Carve.of(views, self.capacity).offsets:
            tensor = base[offset:offset + view.nbytes].view(view.dtype).view(view.shape)
            carved[view.name] = FabricBuffer(tensor, self._destinations[rank, view.dtype],
                                             tuple(address + offset for address in self.allocation.addresses))
        self._carves[key] = carved
        if len(self._carves) > _CARVES_HELD:
            self._carves.popitem(last=False)
        return carved

    def _tabulate(self, dtypes: set[torch.dtype]) -> None:
        """The destination tables of `dtypes` for every rank this process holds. A view lies at the same offset in
        every rank's allocation, so one table per dtype serves every view; each is kept as long as the allocation
        (a captured graph reads it), and made outside any capture (it is copied from the host)."""
        for rank, base in self.allocation.tensors.items():
            for dtype in dtypes - {key[1] for key in self._destinations if key[0] == rank}:
                self._destinations[rank, dtype] = offset_table(self.allocation.addresses, base.view(dtype))
        self._dtypes |= dtypes

    def _grow(self, capacity: Need, views: Sequence[View]) -> None:
        if capturing():
            largest = max(views, key=lambda view: view.nbytes)
            raise RuntimeError(
                f"xstage_dit: {self.what} cannot grow while a CUDA graph is being captured: a call of "
                f"{', '.join(view.name for view in views)} needs {Need.of(views).total} bytes ({largest.name!r} "
                f"{largest.nbytes} of them), it holds {self.capacity.total}. Run one call at the largest size "
                "before capturing (xstage_dit's CUDA graphs capture a signature's third call), or reserve the "
                "largest call's views first (Workspace.reserve)")
        global _epoch
        self.give_back()
        self.allocation = self._allocate(capacity.total)
        self.capacity = capacity
        # every dtype carved so far, now: a call carved first inside a capture (a signature warmed up before this
        # growth) finds its tables
        self._tabulate(self._dtypes)
        self.generation += 1
        _epoch += 1

    def give_back(self) -> None:
        """Drop the allocation (after the device is done with it: peers' stores into it are done once this rank's
        last barrier passed, which the device finished) and every buffer carved from it."""
        if self.allocation is not None:
            devices = {t.device for t in self.allocation.tensors.values() if t.is_cuda}
            for device in devices:  # GPU only
                torch.cuda.synchronize(device)
        self._carves.clear()
        self._destinations.clear()
        self.allocation = None
        self.capacity = Need()


class Fabric(Protocol):
    rank: int
    world_size: int

    def carve(self, views: Sequence[View]) -> dict[str, FabricBuffer]:
        """This rank's buffers for one call of `views`, by name (the workspace grown first where the call needs
        more, collectively where ranks are processes). Call it once per call, with every view the call uses."""
        ...

    def barrier(self, what: str) -> None:
        """Every rank's stores issued before this (in stream order) are visible to every rank after it; `what`
        names what is waited for, in the error a timed-out wait raises."""
        ...


class SymmetricFabric:
    """A process group's symmetric memory (GPU only). Created collectively (`open_fabric`), once per group."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        self.heap = SymmetricHeap(group, device)
        self.rank, self.world_size = self.heap.rank, self.heap.world_size
        self.timeout_s = timeout_s
        self.holders: set[Hashable] = set()
        self.workspace = Workspace(self._allocate, f"the symmetric memory of process group {group.group_name!r}")
        # barrier state: one int32 slot per peer on every rank's pad, this rank's epoch per peer, and where a
        # timed-out wait reports (pinned host memory the kernel writes: peer + 1 and the epoch, zeros when fine)
        self._pads_memory = self.heap.allocate((self.world_size,), torch.int32, zero=True)
        self._pads = torch.tensor(self._pads_memory.peer_addresses, dtype=torch.int64, device=device)
        self._epochs = torch.zeros(self.world_size, dtype=torch.int32, device=device)
        self._error = torch.zeros(2, dtype=torch.int64, pin_memory=True)

    def _allocate(self, nbytes: int) -> Allocation:
        symmetric = self.heap.allocate((nbytes,), torch.uint8)
        return Allocation({self.rank: symmetric.tensor}, symmetric.peer_addresses, symmetric.handle)

    def carve(self, views: Sequence[View]) -> dict[str, FabricBuffer]:
        return self.workspace.carve(views, self.rank)

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

    def close(self) -> None:
        """Give every byte back: the workspace and the barrier's pads (the fabric is unusable after)."""
        torch.cuda.synchronize(self.heap.device)  # a barrier kernel in flight still signals the pads
        self.workspace.give_back()
        self._pads_memory = self._pads = None


_FABRICS: dict[str, SymmetricFabric] = {}
_UNTIL_CLOSED = "until close_fabrics"  # the holder of a fabric opened without holders (benchmarks, tests)


def _group_alive(group: dist.ProcessGroup) -> bool:
    """Whether `group` is still registered (not destroyed by destroy_process_group)."""
    try:
        dist.get_process_group_ranks(group)
        return True
    except (KeyError, ValueError, RuntimeError):
        return False


def open_fabric(group: dist.ProcessGroup, device: torch.device, timeout_s: float,
                holders: Sequence[Hashable] = ()) -> SymmetricFabric:
    """The group's fabric, created on first use (collectively: every rank of the group calls this). Each of
    `holders` holds it until `release_fabrics(holder)`; a fabric opened without holders stays until
    `close_fabrics`. A fabric of a group that has since been destroyed (a later group may reuse its name) is closed
    and a fresh one opened."""
    fabric = _FABRICS.get(group.group_name)
    if fabric is not None and fabric.heap.group is not group and not _group_alive(fabric.heap.group):
        _close(group.group_name)
        fabric = None
    if fabric is None:
        fabric = _FABRICS[group.group_name] = SymmetricFabric(group, device, timeout_s)
    fabric.holders.update(holders or (_UNTIL_CLOSED,))
    return fabric


def release_fabrics(holder: Hashable) -> None:
    """`holder` lets go of its fabrics; a fabric no one holds is closed and its memory given back."""
    for name, fabric in list(_FABRICS.items()):
        if holder in fabric.holders:
            fabric.holders.discard(holder)
            if not fabric.holders:
                _close(name)


def close_fabrics() -> None:
    """Every fabric of this process closed and its memory given back (before the process group's teardown)."""
    for name in list(_FABRICS):
        _close(name)


def _close(name: str) -> None:
    _FABRICS.pop(name).close()


def fabric_of(group_name: str) -> SymmetricFabric | None:
    """The fabric `open_fabric` made for the group, if any."""
    return _FABRICS.get(group_name)


def symmetric_backends_in_use() -> list[str]:
    """The symmetric-memory backends of this process's fabrics (for benchmark records)."""
    return sorted({fabric.heap.backend for fabric in _FABRICS.values()})


def symmetric_bytes_held() -> int:
    """Bytes of symmetric memory this rank's fabrics' workspaces hold."""
    return sum(fabric.workspace.nbytes for fabric in _FABRICS.values())


class LoopbackFabric:
    """N simulated ranks on one device: rank r's buffers and every other rank's are local tensors (one workspace
    of N allocations), so the store kernels issue exactly the stores they would issue to peers. `initialise` is
    applied to every simulated rank's views of a call that grew the workspace (tests fill NaN, so that unwritten
    rows show; benchmarks draw random values, as peers' rows would hold)."""

    def __init__(self, world_size: int, device: torch.device | str,
                 initialise: Callable[[torch.Tensor], object] | None = None) -> None:
        self.world_size = world_size
        self.device = torch.device(device)
        self.initialise = initialise
        self.workspace = Workspace(self._allocate, "a loopback fabric")

    def _allocate(self, nbytes: int) -> Allocation:
        tensors = [torch.empty(nbytes, dtype=torch.uint8, device=self.device) for _ in range(self.world_size)]
        return Allocation(dict(enumerate(tensors)), tuple(t.data_ptr() for t in tensors))

    def rank(self, rank: int) -> "LoopbackRank":
        return LoopbackRank(self, rank)

    def tensors(self, views: Sequence[View], name: str) -> list[torch.Tensor]:
        """Every simulated rank's buffer `name` of a call of `views`, by rank."""
        return [self.workspace.carve(views, rank)[name].tensor for rank in range(self.world_size)]


class LoopbackRank:
    """One simulated rank of a LoopbackFabric, as a Fabric."""

    def __init__(self, loopback: LoopbackFabric, rank: int) -> None:
        self.loopback, self.rank, self.world_size = loopback, rank, loopback.world_size

    def carve(self, views: Sequence[View]) -> dict[str, FabricBuffer]:
        workspace = self.loopback.workspace
        generation = workspace.generation
        carved = workspace.carve(views, self.rank)
        if workspace.generation != generation and self.loopback.initialise is not None:
            for rank in range(self.world_size):
                for buffer in workspace.carve(views, rank).values():
                    self.loopback.initialise(buffer.tensor)
        return carved

    def barrier(self, what: str) -> None:
        """Nothing to wait for in one stream: run_in_lockstep orders the simulated ranks' steps."""


# an algorithm of one rank, paused before each barrier: it yields what the barrier guards and returns its result
Steps = Generator[str, None, T]


def gather_steps(local: torch.Tensor, fabric: Fabric, name: str) -> Steps[torch.Tensor]:
    """Every rank's `local` (R, D) rows stacked rank-major, (N * R, D), on every rank: each rank stores its rows
    into every rank's buffer `name`. Returns a copy, taken before the second barrier, so that a rank storing its
    next call's views into the fabric cannot overwrite rows a slower rank has not read yet."""
    from ..kernels.experts import store_rows  # Triton: imported where a fabric is in use

    rows, n = local.shape[0], fabric.world_size
    buffer = fabric.carve([View(name, (n * rows, local.shape[1]), local.dtype)])[name]
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
