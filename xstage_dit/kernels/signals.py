"""Cross-rank signals on symmetric memory: a barrier of system-scope release stores and acquire loads.

Each rank owns one int32 slot per peer on every rank's signal pad, and keeps (locally, on the device) the epoch
it last reached with each peer. Arriving at a barrier, rank r advances its epoch e with each peer, stores e into
slot r of that peer's pad (release: its earlier stores are visible before the signal), then waits until slot
peer of its own pad holds at least e (acquire). Epochs live and advance on the device, so a barrier captured in
a CUDA graph waits anew on every replay; they only grow, so pads never need a reset. A wait that outlasts
`timeout_ns` (%globaltimer) gives up and records the missing peer and the epoch in `error` (pinned host memory)
for the host to raise."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _globaltimer():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _barrier_kernel(pads, epochs, rank, timeout_ns, error):
    peer = tl.program_id(0)
    epoch = tl.load(epochs + peer) + 1
    tl.store(epochs + peer, epoch)
    peer_pad = tl.load(pads + peer).to(tl.pointer_type(tl.int32))
    my_pad = tl.load(pads + rank).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(peer_pad + rank, epoch, sem="release", scope="sys")
    start = _globaltimer()
    seen = tl.atomic_add(my_pad + peer, 0, sem="acquire", scope="sys")
    waited = start - start  # an int64 zero: loop-carried types must not change
    while (seen < epoch) & (waited < timeout_ns):
        seen = tl.atomic_add(my_pad + peer, 0, sem="acquire", scope="sys")
        waited = _globaltimer() - start
    if seen < epoch:
        tl.store(error, peer + 1)
        tl.store(error + 1, epoch)


def barrier(pads: torch.Tensor, epochs: torch.Tensor, rank: int, timeout_ns: int, error: torch.Tensor) -> None:
    """One program per peer: signal it, then wait for its signal (see the module docstring). pads: int64 addresses
    of every rank's signal pad; epochs: this rank's int32 epoch per peer (zeros at first)."""
    _barrier_kernel[(epochs.numel(),)](pads, epochs, rank, timeout_ns, error, num_warps=1)
