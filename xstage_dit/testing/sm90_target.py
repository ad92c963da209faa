"""Compiling our kernels for sm_90a on a machine without a GPU: Triton pointed at a stand-in driver that reports an
sm_90 target (the CPU tests' compile checks and examples/kernel_sass.py)."""
from __future__ import annotations

from triton.backends.compiler import GPUTarget
from triton.runtime import driver


class Sm90Driver:
    """Just what JITFunction.warmup asks of a driver."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


def target_sm90() -> None:
    """Make the stand-in driver the active one: kernels' warmup() then compiles for sm_90a (ptxas included)."""
    driver.set_active(Sm90Driver())
