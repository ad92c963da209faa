"""One pipeline call for a batch of checked requests, made alike on every rank: one generator per output (so an
output is the same whichever batch it ran in), each step reported, the outputs handed back per request; the call
stops between two steps where the ranks agree to stop it."""
from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .loading import LoadedPipeline
from .media import encoded
from .schema import GenerationRequest, generation_of

StepReport = Callable[[int, int, float], None]  # (steps done, steps in all, seconds of the last step)
StopCheck = Callable[[], bool]  # at each step's end, on every rank alike: whether the call stops there


class Cancelled(Exception):
    """The ranks agreed to stop the call after `step` of its `steps`."""

    def __init__(self, step: int, steps: int) -> None:
        super().__init__(f"stopped after step {step} of {steps}")
        self.step, self.steps = step, steps


@dataclass(frozen=True)
class Outputs:
    """One request's outputs: items `indices` of its batch's pipeline output `result`, one per seed; `call_s`: the
    pipeline call that made them (of the whole batch, with building its inputs). Encoded by `files`, away from the
    ranks' loop."""

    request_id: str
    result: Any
    indices: list[int]
    seeds: list[int]
    call_s: float
    fps: int
    pipe: Any

    def files(self) -> list[bytes]:
        """PNG or MP4 bytes, one per seed."""
        return [encoded(self.result, index, self.fps, self.pipe) for index in self.indices]


def run_batch(loaded: LoadedPipeline, batch: list[GenerationRequest], on_step: StepReport | None = None,
              stop: StopCheck | None = None) -> list[Outputs]:
    """Generate `batch` (requests with one batch key) in one pipeline call; Cancelled where `stop` said so."""
    started = time.perf_counter()  # building the inputs counts: a config's random text embeddings are its encoder
    call = loaded.call_kwargs(generation_of(batch))
    generators = [torch.Generator().manual_seed(seed) for request in batch for seed in request.seeds]
    stopped: list[Cancelled] = []
    result = loaded.pipe(**call, generator=generators, output_type="pil",
                         **_step_callback(loaded, on_step, stop, stopped, call))
    if stopped:
        raise stopped[0]
    call_s = time.perf_counter() - started
    outputs, index = [], 0
    for request in batch:
        indices = list(range(index, index + request.n))
        outputs.append(Outputs(request.id, result, indices, request.seeds, call_s, loaded.fps, loaded.pipe))
        index += request.n
    return outputs


def _step_callback(loaded: LoadedPipeline, on_step: StepReport | None, stop: StopCheck | None,
                   stopped: list[Cancelled], call: dict[str, Any]) -> dict[str, Any]:
    """`callback_on_step_end` reporting each step to `on_step` and asking `stop`, passed on every rank (the ranks
    check that their calls agree). Where `stop` says so, it sets the pipeline's interrupt (diffusers' pipelines
    skip their remaining steps), or raises Cancelled where the pipeline has none, and puts Cancelled in `stopped`:
    every rank stops after the same step. A pipeline without that argument reports no step and runs whole."""
    if not loaded.takes("callback_on_step_end"):
        return {}
    total = call.get("num_inference_steps") or inspect.signature(loaded.pipe.__call__).parameters[
        "num_inference_steps"].default
    last = [time.perf_counter()]

    def callback(pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        if on_step is not None:
            now = time.perf_counter()  # when the host is done with the step: no sync, the GPU's queue stays full
            on_step(step + 1, total, now - last[0])
            last[0] = now
        if stop is not None and stop():
            stopped.append(Cancelled(step + 1, total))
            if not hasattr(type(pipe), "interrupt"):
                raise stopped[0]
            pipe._interrupt = True
        return callback_kwargs

    return {"callback_on_step_end": callback}
