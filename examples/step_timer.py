"""Wall time of each denoising step, for the examples and benchmarks."""
from __future__ import annotations

import time

import torch


class StepTimer:
    """Pass as `callback_on_step_end`; call `start()` right before the pipeline call."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.marks: list[float] = []

    def start(self) -> None:
        self.marks = [self._now()]

    def __call__(self, pipe, step, timestep, callback_kwargs):
        self.marks.append(self._now())
        return callback_kwargs

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    @property
    def total_seconds(self) -> float:
        return self.marks[-1] - self.marks[0]
