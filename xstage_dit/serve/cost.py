"""What one request costs the served model, bounded on rank 0 before any rank sees it: the most pixels the model's
released configuration takes, and a call's predicted time (its tokens x steps x outputs, priced by a call timed at
warm-up) against the request's deadline."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from .schema import GenerationRequest, ModelCard, ModelScale, RequestError

RELEASED_SIDE_FACTOR = 2  # a model takes up to twice each side of the resolution it was released for


def model_scale(pipe: Any, size_multiple: int, height: int | None, width: int | None, frames: int | None,
                steps: int | None, video: bool) -> ModelScale | None:
    """The scale of `pipe` (None where neither its call nor its config nor `height` and `width` give a size).
    Its released resolution: the defaults of its call's height and width, or its (or its transformer's) default
    sample size in latents times its VAE's scale factor, or `height` and `width` where the pipeline says neither;
    a request without a size, frames or steps gets `height`, `width`, `frames`, `steps`, or the pipeline's
    defaults where those are None."""
    defaults = {name: parameter.default for name, parameter in inspect.signature(pipe.__call__).parameters.items()}
    released = _released_size(pipe, defaults, size_multiple // 2) or (height, width)
    height, width = height or released[0], width or released[1]
    if height is None or width is None:
        return None
    released = (released[0] or height, released[1] or width)
    frames = frames or (defaults.get("num_frames") if isinstance(defaults.get("num_frames"), int) else None)
    return ModelScale(height=height, width=width, frames=(frames or 1) if video else 1,
                      steps=steps or defaults.get("num_inference_steps") or 50, size_multiple=size_multiple,
                      frames_per_latent=getattr(pipe, "vae_scale_factor_temporal", None)
                      or getattr(pipe, "vae_temporal_compression_ratio", None) or 1,  # LTX's name
                      max_pixels=RELEASED_SIDE_FACTOR ** 2 * released[0] * released[1])


def _released_size(pipe: Any, defaults: dict[str, Any], vae_scale: int) -> tuple[int, int] | None:
    if isinstance(defaults.get("height"), int) and isinstance(defaults.get("width"), int):
        return defaults["height"], defaults["width"]
    transformer = getattr(pipe, "transformer", None)
    sample = getattr(pipe, "default_sample_size", None) or getattr(getattr(transformer, "config", None),
                                                                   "sample_size", None)
    if isinstance(sample, int):
        return sample * vae_scale, sample * vae_scale
    return None


@dataclass(frozen=True)
class StepCost:
    """One denoising step's time at `tokens` tokens, from a call of the model's default size timed at warm-up:
    the call's time over its steps (its fixed part, text and decoding, counted into its steps)."""

    tokens: int
    seconds: float

    def call_s(self, tokens: int, steps: int, outputs: int) -> float:
        """A call's predicted time, erring long: a step grows at most with the square of its tokens (attention)
        and takes no less than the step measured."""
        return self.seconds * max(1.0, tokens / self.tokens) ** 2 * steps * outputs


def bound(request: GenerationRequest, card: ModelCard, cost: StepCost) -> None:
    """RequestError naming the first of the request's size (or frames), steps and outputs that makes its predicted
    call time longer than its deadline."""
    scale = card.scale
    tokens, steps = scale.tokens(request.options), request.options.steps or scale.steps
    checks = (("num_frames" if request.options.num_frames and card.video else "size", 1, 1),
              ("num_inference_steps", steps, 1), ("n", steps, request.n))
    for param, at_steps, outputs in checks:
        predicted = cost.call_s(tokens, at_steps, outputs)
        if predicted > request.deadline_s:
            raise RequestError(param, f"the call's predicted time, {predicted:.3g} s ({tokens} tokens x {at_steps} "
                                      f"step(s) x {outputs} output(s), at {cost.seconds:.3g} s a step of "
                                      f"{cost.tokens} tokens measured at warm-up), is over the request's deadline "
                                      f"of {request.deadline_s:g} s (`timeout_s`, at most the service's "
                                      f"--max-timeout-s)")
