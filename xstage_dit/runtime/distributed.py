"""torch.distributed set-up: start the default group from the launcher's environment when the user has not,
and lay the ranks out on the device mesh (cfg, ring, ulysses) for the requested degrees."""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _resolve_process_group

from ..launcher import launched
from ..logging_utils import logger, warn_once


@dataclass(frozen=True)
class Axis:
    """One axis of the sequence split: its degree, this rank's index on it, its group (None at degree 1)."""

    degree: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class ParallelGroups:
    """The ranks this process works with, laid out as the mesh (cfg, ring, ulysses), Ulysses innermost: world =
    cfg_degree x ring_degree x ulysses_degree; Ulysses groups of consecutive ranks (one node), ring groups of ranks
    ulysses_degree apart, and the sequence group (ring x ulysses flattened, within one CFG group) whose ranks split
    one sequence. Groups are None where their degree is 1 (and in a single process)."""

    world_size: int
    rank: int
    ulysses_degree: int
    ulysses_rank: int
    ulysses_group: dist.ProcessGroup | None
    cfg_degree: int
    cfg_rank: int
    cfg_group: dist.ProcessGroup | None
    device: torch.device
    ring_degree: int = 1
    ring_rank: int = 0
    ring_group: dist.ProcessGroup | None = None
    sequence_group: dist.ProcessGroup | None = None
    mesh: DeviceMesh | None = None  # the mesh the groups come from (None in a single process)

    @property
    def sequence_degree(self) -> int:
        return self.ring_degree * self.ulysses_degree

    @property
    def sequence_rank(self) -> int:
        """This rank's shard of the sequence: ring blocks in order, Ulysses shards inside each."""
        return self.ring_rank * self.ulysses_degree + self.ulysses_rank

    @property
    def ulysses_within_node(self) -> bool:
        return within_node(self.ulysses_group)

    @property
    def ring_within_node(self) -> bool:
        """Whether the ring's ranks share a node: the X-Stage paths (symmetric memory) span one node; across
        nodes the ring's blocks travel by NCCL point-to-point."""
        return within_node(self.ring_group)

    @property
    def ulysses(self) -> Axis:
        return Axis(self.ulysses_degree, self.ulysses_rank, self.ulysses_group)

    @property
    def ring(self) -> Axis:
        return Axis(self.ring_degree, self.ring_rank, self.ring_group)


def world_from_env() -> tuple[int, int]:
    """(world size, rank) of the running job: the live default group, else the launcher's variables, else (1, 0)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return launched()


def local_device() -> torch.device:
    """This rank's device: cuda:LOCAL_RANK when CUDA is present, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device("cpu")


def node_of(rank: int) -> int:
    """The node of global rank `rank`: torchrun gives each node LOCAL_WORLD_SIZE consecutive ranks; without it the
    job is taken for one node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world_from_env()[0]
    return rank // per_node


def within_node(group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of `group` (None: this rank alone) sits on one node."""
    return group is None or len({node_of(rank) for rank in dist.get_process_group_ranks(group)}) == 1


@dataclass(frozen=True)
class Placement:
    """Where this node's ranks run, from the launcher's facts: the job's ranks on this node (torchrun's
    LOCAL_WORLD_SIZE; 1 without it) and the GPUs this process sees."""

    local_ranks: int
    gpus: int

    @property
    def ranks_share_gpus(self) -> bool:
        """More ranks on this node than GPUs: NCCL refuses two ranks on one GPU, so the job runs over gloo,
        symmetric memory through its CUDA backend, and the planner reads the same-GPU calibration."""
        return 0 < self.gpus < self.local_ranks


_placement: Placement | None = None
# the default group this library started, with its timeout (its collectives are bounded by that, not another)
_started_world: tuple[dist.ProcessGroup, float] | None = None


def job_placement() -> Placement:
    """This job's placement, decided once per process (until `forget_groups`)."""
    global _placement
    if _placement is None:
        _placement = Placement(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    return _placement


def ranks_share_gpus() -> bool:
    """Whether this job's ranks share GPUs (its placement's word)."""
    return job_placement().ranks_share_gpus


def ensure_process_group(timeout_s: float) -> None:
    """Start the default process group from the launcher's environment unless one is running or the job has one
    process. NCCL on GPUs, gloo on CPU and where ranks share GPUs; every collective is bounded by `timeout_s`."""
    if dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) == 1:
        if not dist.is_initialized() and "WORLD_SIZE" not in os.environ and "ACCELERATE_USE_CPU" in os.environ:
            # accelerate's one-process launcher sets this; its multi-process one (torchrun's) sets WORLD_SIZE
            warn_once("xstage_dit: `accelerate launch` started one process, so the model runs unsplit; it starts "
                      "several only with --multi_gpu (`accelerate launch --multi_gpu --num_processes N`, on CPUs too)")
        return
    device = local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    placement = job_placement()
    backend = "nccl" if device.type == "cuda" and not placement.ranks_share_gpus else "gloo"
    if device.type == "cuda" and backend == "gloo":
        # NCCL refuses two ranks on one GPU; gloo stages through the host and symmetric memory's CUDA backend
        # maps the ranks' buffers into each other (torch's flag allows its devices to overlap): correct, and
        # useful for testing, but no measure of speed
        os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
        logger.warning("xstage_dit: %d ranks on this node share %d GPU(s): gloo process group (for testing: its "
                       "timings say nothing about multi-GPU speed)", placement.local_ranks, placement.gpus)
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    global _started_world
    _started_world = (dist.group.WORLD, timeout_s)
    logger.info("started process group: %s, world size %d", backend, dist.get_world_size())


def all_gather_into(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
    # torch >= 2.13 calls it all_gather_single; older torch (the device machines' image) all_gather_into_tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with torch.no_grad():  # inference only: collectives are not differentiable
        gather(output, local, group=group)


def all_gather_stacked(local: torch.Tensor, size: int, group: dist.ProcessGroup,
                       what: str | Callable[[], str]) -> torch.Tensor:
    """Every rank's `local` (the same shape on each of the group's `size` ranks), stacked along a new first
    dimension in rank order; a failure says this rank waited for `what` (as `waiting_for` takes it)."""
    whole = local.new_empty((size, *local.shape))
    with waiting_for(what):
        all_gather_into(whole.view(-1), local.contiguous().view(-1), group)
    return whole


def _check_process_group_alive() -> None:
    """A collective of an enabled model that failed because the job's process group was destroyed says so."""
    if not dist.is_initialized():
        raise RuntimeError("xstage_dit: the process group is gone (torch.distributed.destroy_process_group was "
                           "called after xstage_dit.enable); an enabled pipeline's calls need it: make them before "
                           "destroying it, and call xstage_dit.disable(pipe) to run the pipeline alone after")


def resolve_group(name: str) -> dist.ProcessGroup:
    """The process group registered under `name` (as custom ops take groups), or the error above where it is gone."""
    try:
        return _resolve_process_group(name)
    except (RuntimeError, ValueError):
        _check_process_group_alive()
        raise


@contextlib.contextmanager
def waiting_for(what: str | Callable[[], str]) -> Iterator[None]:
    """A collective in the block that fails (a peer dead, or past the group's timeout) re-raises naming this rank
    and what it waited for, instead of the backend's bare message. `what` may be a function, for callers on a
    hot path: it is called only on failure."""
    try:
        yield
    except (RuntimeError, dist.DistError) as error:
        _check_process_group_alive()
        described = what() if callable(what) else what
        raise RuntimeError(f"xstage_dit: rank {world_from_env()[1]} waited for {described} and gave up: {error}") \
            from error


@contextlib.contextmanager
def every_rank_joining(call: str, timeout_s: float) -> Iterator[None]:
    """Starting the process group and creating groups wait for every rank of the job to make the same call: where
    a rank never does (a call made on some ranks only), the store's bare timeout is said as that."""
    try:
        yield
    except dist.DistStoreError as error:
        world, rank = world_from_env()
        raise RuntimeError(f"xstage_dit: rank {rank} waited {timeout_s:g} s for all {world} ranks of the job to "
                           f"call {call} and gave up: every rank must call it ({type(error).__name__}: {error})") \
            from error


def free_port() -> int:
    """A free TCP port on this host, for the rendezvous of processes this library or its tests spawn."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# groups this module created, keyed by the default group they were made from: one started anew (after
# destroy_process_group) never finds the groups of the one before
_world_groups: dict[tuple[dist.ProcessGroup, float], dist.ProcessGroup] = {}


def world_group(timeout_s: float) -> dist.ProcessGroup | None:
    """Every rank of the job, in a group whose collectives give up after `timeout_s` (created collectively on
    first use); None in a single process. The default group where we started it with this timeout; one the caller
    started carries the caller's timeout, so it gets a group of its own."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    if _started_world == (world, timeout_s):
        return world
    key = (world, timeout_s)
    if key not in _world_groups:
        _world_groups[key] = dist.new_group(timeout=timedelta(seconds=timeout_s))
    return _world_groups[key]


# the mesh's dimensions, outermost first: CFG groups, then ring steps, Ulysses innermost (consecutive ranks)
MESH_DIMS = ("cfg", "ring", "ulysses")


@dataclass(frozen=True)
class JobMesh:
    """The job's mesh (cfg, ring, ulysses) and, where the ring and Ulysses degrees are both above 1, its (ring,
    ulysses) dimensions flattened: the sequence's ranks (else the one of the two above 1 is the sequence's)."""

    mesh: DeviceMesh
    sequence: DeviceMesh | None


_mesh_cache: dict[tuple, JobMesh] = {}  # keyed as _world_groups, then by shape, timeout and backend


def timed_mesh(shape: tuple[int, int, int], timeout_s: float) -> JobMesh:
    """The job's mesh of `shape` (cfg, ring, ulysses) from one `init_device_mesh`, created once per job
    (collectively). Every group's collectives give up after `timeout_s`: `init_device_mesh` takes no timeout of
    its own (torch 2.11 to 2.13) but creates each dimension's groups with the timeout of the process-group options
    it is given for that dimension (`backend_override`), so each dimension, and the flattened one, gets this job's
    backend with options carrying `timeout_s`. NCCL where the default group runs NCCL, else gloo (a CPU job, or
    ranks sharing a GPU), whose mesh is a CPU mesh."""
    backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
    key = (dist.group.WORLD, shape, timeout_s, backend)
    if key not in _mesh_cache:
        options = dist.ProcessGroupNCCL.Options() if backend == "nccl" else dist.ProcessGroupGloo._Options()
        options._timeout = timedelta(seconds=timeout_s)
        mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", shape, mesh_dim_names=MESH_DIMS,
                                backend_override={name: (backend, options) for name in MESH_DIMS})
        _, ring, ulysses = shape
        sequence = mesh["ring", "ulysses"]._flatten("sequence", backend_override=(backend, options)) \
            if ring > 1 and ulysses > 1 else None
        _mesh_cache[key] = JobMesh(mesh, sequence)
    return _mesh_cache[key]


def forget_groups() -> None:
    """Let go of the placement (`disable` calls it: the next `enable` decides it anew from the environment) and of
    the meshes and groups made on a default group that is gone. Those made on the live default group stay for the
    next `enable` of the same shape and timeout: torch.distributed keeps every group until its default group is
    destroyed (and destroying one that a captured CUDA graph's collectives use can hang), so groups made anew at
    every `enable` would pile up."""
    global _placement
    live = dist.group.WORLD if dist.is_initialized() else None
    for cache in (_mesh_cache, _world_groups):
        for key in [key for key in cache if key[0] is not live]:
            del cache[key]
    _placement = None


def build_groups(cfg_degree: int, ulysses_degree: int, timeout_s: float, ring_degree: int = 1) -> ParallelGroups:
    """This rank's groups on the mesh (cfg, ring, ulysses) (`timed_mesh`), their collectives bounded by
    `timeout_s`. Degrees were validated by the caller before any collective; every rank creates every group, in
    the same order, as torch.distributed requires."""
    world_size, rank = world_from_env()
    device = local_device()
    if world_size == 1:
        return ParallelGroups(1, 0, 1, 0, None, 1, 0, None, device)
    job = timed_mesh((cfg_degree, ring_degree, ulysses_degree), timeout_s)
    cfg_rank, ring_rank, ulysses_rank = (job.mesh.get_local_rank(name) for name in MESH_DIMS)

    def group(name: str) -> dist.ProcessGroup | None:
        """The dimension's group, None at degree 1."""
        return job.mesh.get_group(name) if job.mesh[name].size() > 1 else None

    ring, ulysses = group("ring"), group("ulysses")
    sequence = job.sequence.get_group() if job.sequence is not None else ring or ulysses
    return ParallelGroups(world_size=world_size, rank=rank, ulysses_degree=ulysses_degree, ulysses_rank=ulysses_rank,
                          ulysses_group=ulysses, cfg_degree=cfg_degree, cfg_rank=cfg_rank, cfg_group=group("cfg"),
                          device=device, ring_degree=ring_degree, ring_rank=ring_rank, ring_group=ring,
                          sequence_group=sequence, mesh=job.mesh)
