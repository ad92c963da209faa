"""One pipeline call for a batch of checked requests, made alike on every rank: one generator per output (so an
output is the same whichever batch it ran in), each step reported, the outputs handed back per request."""
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


def run_batch(loaded: LoadedPipeline, batch: list[GenerationRequest], on_step: StepReport | None = None
              ) -> list[Outputs]:
    """Generate `batch` (requests with one batch key) in one pipeline call."""
    started = time.perf_counter()  # building the inputs counts: a config's random text embeddings are its encoder
    call = loaded.call_kwargs(generation_of(batch))
    generators = [torch.Generator().manual_seed(seed) for request in batch for seed in request.seeds]
    result = loaded.pipe(**call, generator=generators, output_type="pil", **_step_callback(loaded, on_step, call))
    call_s = time.perf_counter() - started
    outputs, index = [], 0
    for request in batch:
        indices = list(range(index, index + request.n))
        outputs.append(Outputs(request.id, result, indices, request.seeds, call_s, loaded.fps, loaded.pipe))
        index += request.n
    return outputs


def _step_callback(loaded: LoadedPipeline, on_step: StepReport | None, call: dict[str, Any]) -> dict[str, Any]:
    """`callback_on_step_end` reporting each step to `on_step`, passed on every rank (the ranks check that their
    calls agree); a pipeline without that argument reports no step."""
    if not loaded.takes("callback_on_step_end"):
        return {}
    total = call.get("num_inference_steps") or inspect.signature(loaded.pipe.__call__).parameters[
        "num_inference_steps"].default
    last = [time.perf_counter()]

    def callback(pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        if on_step is None:
            return callback_kwargs
        now = time.perf_counter()  # when the host is done with the step: no sync, the GPU's queue stays full
        on_step(step + 1, total, now - last[0])
        last[0] = now
        return callback_kwargs

    return {"callback_on_step_end": callback}
