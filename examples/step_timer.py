"""Wall time of each denoising step, for the examples and benchmarks."""
from __future__ import annotations

import contextlib
import inspect
import time
from typing import Any, Callable, Iterator

import torch
from xstage_dit.runtime.cuda_graphs import GraphUse


class StepTimer:
    """Pass as `callback_on_step_end`; call `start()` right before the pipeline call. Each step starts on an idle
    GPU (the previous step's end waited for it), so the host time until the step's end is the time the host took
    to issue the step's work (all of the step, where something in it waits for the GPU)."""

    def __init__(self, device: torch.device, graph_use: Callable[[], GraphUse] | None = None) -> None:
        """`graph_use`: the pipeline's `xstage_dit.cuda_graph_use`, to tell the steps that only replayed graphs."""
        self.device = device
        self.graph_use = graph_use
        self.marks: list[float] = []
        self.issued: list[float] = []  # when the host reached each step's end, before waiting for the GPU
        self.uses: list[GraphUse] = []  # at each mark, with `graph_use`
        self.end: float | None = None

    def start(self) -> None:
        self.marks, self.issued, self.end = [self._synchronized()], [], None
        self.uses = [self.graph_use()] if self.graph_use is not None else []

    def finish(self) -> None:
        """Call right after the pipeline call returns: the end of what follows the loop (the VAE decode)."""
        self.end = self._synchronized()

    def __call__(self, pipe, step, timestep, callback_kwargs):
        self.issued.append(time.perf_counter())
        self.marks.append(self._synchronized())
        if self.graph_use is not None:
            self.uses.append(self.graph_use())
        return callback_kwargs

    def _synchronized(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @property
    def step_seconds(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    @property
    def host_seconds(self) -> list[float]:
        """Per step, the host's time to issue it."""
        return [issued - start for start, issued in zip(self.marks, self.issued)]

    @property
    def replayed(self) -> list[bool]:
        """Per step (with `graph_use`): every transformer call in it replayed a graph captured before, or every
        block call in it did (where the whole forward could not be captured)."""
        return [(b.replays > a.replays and b.other_calls == a.other_calls)
                or (b.block_replays > a.block_replays and b.block_other_calls == a.block_other_calls)
                for a, b in zip(self.uses, self.uses[1:])]

    @property
    def total_seconds(self) -> float:
        """The whole call, from `start` to `finish`."""
        return self.end - self.marks[0]

    @property
    def after_loop_seconds(self) -> float:
        """From the last step's end to the call's end: the VAE decode and post-processing, if the call decodes."""
        return self.end - self.marks[-1]


@contextlib.contextmanager
def reporting_steps(pipe: Any, timer: StepTimer) -> Iterator[dict[str, Any]]:
    """The call kwargs that make `pipe` report each step's end to `timer`: its step callback, or for a pipeline
    without one (HunyuanVideo 1.5's) its scheduler's `step` wrapped for the call, which every pipeline calls once
    per step."""
    if "callback_on_step_end" in inspect.signature(pipe.__call__).parameters:
        yield {"callback_on_step_end": timer}
        return
    scheduler, step = pipe.scheduler, pipe.scheduler.step

    def timed_step(*args: Any, **kwargs: Any) -> Any:
        out = step(*args, **kwargs)
        timer(pipe, None, None, {})
        return out

    scheduler.step = timed_step
    try:
        yield {}
    finally:
        del scheduler.step
