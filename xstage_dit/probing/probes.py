"""Python side of the Burst-Gap probes in csrc/burst_probe.cu (the `xstage_dit._C` extension).

`BurstProbe.train` runs one train of store bursts from K producer CTAs into a destination tensor and returns,
per burst, the issuer-visible issue time and the gap the producers actually spent before it (the requested
spin plus the wait for the other producers), both in seconds."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from types import ModuleType

import torch


def extension() -> ModuleType:
    """The compiled probes; a clear error where they were not built."""
    try:
        from .. import _C
    except ImportError as error:
        raise RuntimeError(
            "xstage_dit's CUDA probes (csrc/) are not built: install xstage_dit with CUDA and nvcc present, "
            "`pip install --no-build-isolation .` (setup.py compiles csrc/*.cu into xstage_dit._C)"
        ) from error
    return _C


@dataclass(frozen=True)
class Train:
    producers: int
    volume: int  # bytes per burst, all producers together
    requested_gap: float
    issue_times: list[float]  # per burst: the slowest producer's issue time
    gaps: list[float]  # per burst: mean over producers of the time since their previous burst ended

    def steady_issue_time(self) -> float:
        """Median issue time over the second half of the train (the first bursts fill the queue)."""
        return statistics.median(self.issue_times[len(self.issue_times) // 2 :])

    def steady_gap(self) -> float:
        gaps = self.gaps[1:] or self.gaps
        return statistics.median(gaps[len(gaps) // 2 :])


class BurstProbe:
    """Probes on one device; measures the SM clock against %globaltimer once."""

    THREADS = 512  # per producer CTA: enough 16-byte stores in flight to saturate one SM's store path
    TIMEOUT_S = 5.0

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._c = extension()
        cycles, nanoseconds = self._c.clock_rate(device.index or 0, 50_000_000)
        self.cycles_per_second = cycles / nanoseconds * 1e9

    def _cycles(self, seconds: float) -> int:
        return int(seconds * self.cycles_per_second)

    def train(self, destination: torch.Tensor, producers: int, volume: int, bursts: int, gap: float,
              fence: bool = False) -> Train:
        """`bursts` bursts of `volume` bytes (a multiple of 16 * producers) from `producers` CTAs, each burst
        after a spin of `gap` seconds. With `fence`, a burst ends when its stores are visible system-wide."""
        if not destination.is_cuda or destination.numel() * destination.element_size() < volume:
            raise ValueError("burst_train: the destination must be a CUDA tensor of at least one burst")
        if producers <= 0 or bursts <= 0 or volume % (16 * producers):
            raise ValueError(f"burst_train: {volume} bytes do not split into 16-byte stores over {producers} CTAs")
        clocks, stalled = self._c.burst_train(destination, producers, volume, bursts, self._cycles(gap), fence,
                                              self.THREADS, self._cycles(self.TIMEOUT_S))
        if stalled >= 0:
            raise RuntimeError(
                f"burst_train: the {producers} producer CTAs did not all arrive at burst {stalled} within "
                f"{self.TIMEOUT_S}s (more CTAs than can be resident at once, or a GPU shared with other work?)")
        clocks = clocks.cpu()
        starts, ends = clocks[..., 0].double(), clocks[..., 1].double()
        issue = (ends - starts).max(dim=0).values / self.cycles_per_second
        gaps = torch.zeros(bursts, dtype=torch.float64)
        gaps[1:] = (starts[:, 1:] - ends[:, :-1]).mean(dim=0) / self.cycles_per_second
        gaps[0] = gap
        return Train(producers, volume, gap, issue.tolist(), gaps.tolist())


def round_volume(volume: int, producers: int) -> int:
    """The nearest volume the probe accepts: whole 16-byte stores, split evenly over the producers."""
    unit = 16 * producers
    return max(unit, round(volume / unit) * unit)
