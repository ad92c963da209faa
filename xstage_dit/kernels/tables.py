"""Where the store kernels send data: a table of every destination buffer's element offset from the kernel's own
buffer (its pointer argument), instead of raw addresses.

Adding an offset to an argument pointer keeps what Triton knows about that pointer (16-byte alignment), and the
offsets are declared multiples of ALIGN_ELEMENTS, so each destination row is stored with 16-byte vector stores;
a pointer loaded from a table would be stored through element by element. All buffers share one virtual
address space (peers' symmetric buffers are mapped into it), so the difference of two addresses is an offset."""
from __future__ import annotations

from typing import Sequence

import torch

ALIGN_ELEMENTS = 16  # every buffer starts at a multiple of 16 elements from every other (allocations are aligned)


def offset_table(addresses: Sequence[int], base: torch.Tensor) -> torch.Tensor:
    """int64 element offsets of the buffers at `addresses` from `base`, on base's device."""
    size = base.element_size()
    offsets = []
    for address in addresses:
        delta = address - base.data_ptr()
        if delta % (size * ALIGN_ELEMENTS):
            raise ValueError(f"store destination at {address:#x} is not {size * ALIGN_ELEMENTS}-byte aligned "
                             f"relative to {base.data_ptr():#x}")
        offsets.append(delta // size)
    return torch.tensor(offsets, dtype=torch.int64, device=base.device)
