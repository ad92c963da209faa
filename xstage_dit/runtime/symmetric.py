"""Symmetric memory of one process group: tensors that every rank of the group can address, allocated and
exchanged once (rendezvous is a collective).

Through PyTorch symmetric memory: the NVSHMEM backend when every rank has its own GPU, the CUDA backend when
ranks share one (tests); XSTAGE_SYMM_MEM_BACKEND=NVSHMEM|CUDA overrides the choice, which is logged once."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..logging_utils import logger, warn_once
from .distributed import ranks_share_gpus


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


@dataclass(frozen=True)
class SymmetricTensor:
    """This rank's tensor and the address of every rank's, by rank (mapped into this process)."""

    tensor: torch.Tensor
    peer_addresses: tuple[int, ...]
    handle: object  # keeps the mapping alive


class SymmetricHeap:
    """Allocates a group's symmetric tensors. Every rank of the group must allocate the same tensors in the same
    order."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = _choose_backend()
        if self.backend == "NVSHMEM":  # CUDA is torch's default allocation backend (and not selectable by name)
            symm_mem.set_backend(self.backend)
        logger.info("xstage_dit: symmetric memory backend %s for a group of %d ranks", self.backend, self.world_size)

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype, zero: bool = False) -> SymmetricTensor:
        import torch.distributed._symmetric_memory as symm_mem

        tensor = symm_mem.empty(*shape, dtype=dtype, device=self.device)
        if zero:
            tensor.zero_()
        handle = symm_mem.rendezvous(tensor, self.group)
        return SymmetricTensor(tensor, tuple(handle.buffer_ptrs), handle)
