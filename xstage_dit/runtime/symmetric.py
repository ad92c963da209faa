"""Symmetric memory for one process group: buffers every rank can store into, a pool that allocates them once,
and a cross-rank barrier on system-scope release/acquire atomics with a timeout.

Through PyTorch symmetric memory: the NVSHMEM backend when every rank has its own GPU, the CUDA backend when
ranks share one (tests); XSTAGE_SYMM_MEM_BACKEND=NVSHMEM|CUDA overrides the choice, which is logged once. The
barrier is our own kernel because torch 2.11's NVSHMEM-backend `barrier` is a no-op."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..logging_utils import logger, warn_once
from ..kernels.tables import offset_table
from .distributed import ranks_share_gpus

_POOLS: dict[str, "SymmetricPool"] = {}


def _choose_backend() -> str:
    import torch.distributed._symmetric_memory as symm_mem

    forced = os.environ.get("XSTAGE_SYMM_MEM_BACKEND")
    if forced:
        return forced
    shared_gpu = ranks_share_gpus()
    if not shared_gpu and symm_mem.is_nvshmem_available():
        return "NVSHMEM"
    if not shared_gpu:
        warn_once("xstage_dit: NVSHMEM is not available; symmetric memory falls back to its CUDA backend")
    return "CUDA"


@dataclass
class SymmetricBuffer:
    """This rank's tensor, the int64 tables of every rank's base address and of every rank's buffer as an element
    offset from this rank's (what the store kernels take: kernels/tables.py), on the device."""

    tensor: torch.Tensor
    table: torch.Tensor
    offsets: torch.Tensor
    handle: object


class SymmetricPool:
    """Symmetric buffers of one group, keyed by (name, shape, dtype): allocated and exchanged once, then reused
    by every layer and step, so no allocation or rendezvous happens inside the denoising loop after the first."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self.backend = backend = _choose_backend()
        if backend == "NVSHMEM":  # CUDA is torch's default allocation backend (and not selectable by name)
            symm_mem.set_backend(backend)
        logger.info("xstage_dit: symmetric memory backend %s for a group of %d ranks", backend, self.world_size)
        self._buffers: dict[tuple, SymmetricBuffer] = {}
        # barrier state: one int32 slot per peer on every rank, the epoch each peer last reached
        self._signals = self.buffer("barrier", (self.world_size,), torch.int32, zero=True)
        self._epoch = 0
        # a timed-out wait reports here (pinned host memory the kernel writes): peer + 1, 0 when fine
        self._error = torch.zeros(2, dtype=torch.int64, pin_memory=True)

    @classmethod
    def for_group(cls, group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> "SymmetricPool":
        """The group's pool, created (collectively: every rank of the group calls this) on first use."""
        if group.group_name not in _POOLS:
            _POOLS[group.group_name] = cls(group, device, timeout_s)
        return _POOLS[group.group_name]

    @classmethod
    def exists(cls, group_name: str) -> bool:
        return group_name in _POOLS

    @staticmethod
    def backends_in_use() -> list[str]:
        """The symmetric-memory backends of this process's pools (for benchmark records)."""
        return sorted({pool.backend for pool in _POOLS.values()})

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> "SymmetricPool":
        """The pool `enable` created for `group`."""
        return _POOLS[group.group_name]

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, zero: bool = False) -> SymmetricBuffer:
        import torch.distributed._symmetric_memory as symm_mem

        key = (name, tuple(shape), dtype)
        if key not in self._buffers:
            tensor = symm_mem.empty(*shape, dtype=dtype, device=self.device)
            if zero:
                tensor.zero_()
            handle = symm_mem.rendezvous(tensor, self.group)
            table = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
            self._buffers[key] = SymmetricBuffer(tensor, table, offset_table(handle.buffer_ptrs, tensor), handle)
        return self._buffers[key]

    def barrier(self, what: str) -> None:
        """Every rank's preceding stores (in stream order) are visible to every rank after this returns on the
        stream. A rank that waits longer than the timeout for a peer raises at its next barrier."""
        from ..kernels.signals import barrier_kernel_launch  # Triton: imported where a pool is in use

        self._raise_if_timed_out(what)
        self._epoch += 1
        barrier_kernel_launch(self._signals.table, self.rank, self.world_size, self._epoch,
                              int(self.timeout_s * 1e9), self._error)

    def _raise_if_timed_out(self, what: str) -> None:
        peer = int(self._error[0]) - 1
        if peer >= 0:
            raise TimeoutError(
                f"xstage_dit: rank {self.rank} waited more than {self.timeout_s:.0f}s for rank {peer} at a "
                f"symmetric-memory barrier (epoch {int(self._error[1])}) before {what}"
            )
