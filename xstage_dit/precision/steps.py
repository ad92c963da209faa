"""Which denoising steps run in FP8: one record per enabled transformer (`StepPrecision`), set at each step of a
pipeline call (`FullPrecisionSteps`) and read by every FP8 part through `StepPrecision.fp8(part)`.

The policy (`XStageConfig.fp8_full_precision_steps` = k): the first and last k steps of each pipeline call run
without FP8 (`runs_fp8`): the first steps set the layout of the image, the last ones its fine detail, and both are
the steps most sensitive to rounding. A pipeline counts its steps in its own loop; the record follows them through
the pipeline's `callback_on_step_end`, which runs after each step (the user's callback, if any, still runs after
ours). Transformer calls outside a pipeline call (a bare transformer's) run FP8 in every call.

For an FP8 part (a Linear layer, an attention kernel, a payload): it gets its model's record at `enable`
(`ModelJob.precision`) and asks `record.fp8(part)` at each call; nothing else decides. The answer is host state:
it is part of the CUDA-graph signature (`key()`), and torch.compile guards on it, so a compiled block holds one
graph per precision and a switch recompiles at most once per precision."""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Hashable, Iterator

from ..hooks.pipeline_call import WrappedPipelineCall
from ..logging_utils import warn_once


def runs_fp8(step: int, steps: int, full_precision_steps: int) -> bool:
    """Whether step `step` (from 0) of a call of `steps` steps runs FP8 when the first and last
    `full_precision_steps` run in full precision (none does where steps <= 2 x full_precision_steps)."""
    return full_precision_steps <= step < steps - full_precision_steps


@dataclass
class StepPrecision:
    """One model's FP8 parts (XStageConfig.fp8) and whether the current step runs them in full precision."""

    parts: tuple[str, ...] = ()
    full_precision_now: bool = False

    def fp8(self, part: str) -> bool:
        """Whether `part` (one of config.FP8_PARTS) runs in FP8 now."""
        return part in self.parts and not self.full_precision_now

    def key(self) -> Hashable:
        """What the FP8 parts read of this record: a part of every CUDA graph's signature."""
        return bool(self.parts) and not self.full_precision_now


def takes_step_callbacks(pipe: Any) -> bool:
    """Whether `pipe`'s call takes diffusers' `callback_on_step_end`, through which the steps are followed."""
    return "callback_on_step_end" in inspect.signature(type(pipe).__call__).parameters


class FullPrecisionSteps:
    """Every call of `pipe` marks its first and last `full_precision_steps` steps full precision on `records`
    (its transformers'), until `remove()`."""

    def __init__(self, pipe: Any, records: list[StepPrecision], full_precision_steps: int) -> None:
        assert full_precision_steps > 0 and takes_step_callbacks(pipe)
        self._records, self._k = records, full_precision_steps
        self._wrapped = WrappedPipelineCall(pipe, self._around)

    def _mark(self, full_precision: bool) -> None:
        for record in self._records:
            record.full_precision_now = full_precision

    @contextlib.contextmanager
    def _around(self, arguments: dict[str, Any]) -> Iterator[dict[str, Any]]:
        theirs = arguments.get("callback_on_step_end")
        asked_steps = arguments.get("num_inference_steps")
        pipe_class = type(arguments["self"]).__name__

        def callback(pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
            # the pipeline's own count (timesteps or sigmas given, img2img's strength) where it keeps one
            steps = getattr(pipe, "_num_timesteps", None) or asked_steps
            if steps is None:
                warn_once(f"xstage_dit: a {pipe_class} call does not say how many steps it runs: only its first "
                          f"{self._k} run without FP8")
            self._mark(step + 1 < self._k if steps is None else not runs_fp8(step + 1, steps, self._k))
            return theirs(pipe, step, timestep, callback_kwargs) if theirs is not None else callback_kwargs

        replaced: dict[str, Any] = {"callback_on_step_end": callback}
        inputs = getattr(theirs, "tensor_inputs", None)
        if inputs is not None:  # a PipelineCallback: the tensors it asks for, as pipelines that know the class do
            replaced["callback_on_step_end_tensor_inputs"] = inputs
        self._mark(True)  # step 0 is one of the first k
        try:
            yield replaced
        finally:
            self._mark(False)

    def remove(self) -> None:
        self._wrapped.remove()
        self._mark(False)
