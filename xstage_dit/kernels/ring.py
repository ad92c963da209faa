"""The ring's block forward: a persistent copy kernel that stores a contiguous block of elements into the
same-shaped buffer of another rank (an element offset from this rank's own buffer, kernels/tables.py). Its grid is
a few programs, so that it runs beside an attention kernel on the SMs that kernel leaves and its stores drain
under the attention's compute instead of in a burst of their own."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tables import ALIGN_ELEMENTS

# elements per program and iteration, and its warps: 64 KiB of bf16 in flight per program, so that a few programs
# drain a block at a large share of the memory's rate
BLOCK = 32768
WARPS = 16


@triton.jit
def _forward_kernel(src, base, offsets, to_rank, numel, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    dest = base + tl.multiple_of(tl.load(offsets + to_rank), ALIGN)
    first = tl.program_id(0).to(tl.int64) * BLOCK
    stride = tl.num_programs(0).to(tl.int64) * BLOCK
    for start in range(first, numel, stride):
        at = start + tl.arange(0, BLOCK)
        ok = at < numel
        tl.store(dest + at, tl.load(src + at, mask=ok), mask=ok)


def forward_block(src: torch.Tensor, base: torch.Tensor, offsets: torch.Tensor, to_rank: int,
                  programs: int) -> None:
    """Store the contiguous `src` into the first `src.numel()` elements of rank `to_rank`'s buffer, which sits
    `offsets[to_rank]` elements from `base` (this rank's buffer, at least as large), with `programs` programs."""
    if not src.is_contiguous() or src.dtype != base.dtype or src.numel() > base.numel():
        raise ValueError("forward_block: a contiguous block of the buffer's dtype that fits in it")
    if src.numel():
        _forward_kernel[(max(1, min(programs, triton.cdiv(src.numel(), BLOCK))),)](
            src, base, offsets, to_rank, src.numel(), BLOCK=BLOCK, ALIGN=ALIGN_ELEMENTS, num_warps=WARPS)
