"""What a client may ask for, checked on rank 0 before anything reaches the ranks: the HTTP bodies (OpenAI's image
fields and ours), the model's limits, and the checked request every rank runs."""
from __future__ import annotations

import base64
import binascii
import io
import re
import secrets
from dataclasses import dataclass
from typing import Literal

import PIL.Image
from pydantic import BaseModel, Field

from .loading import CallOptions, Generation, ImageInput

_SIZE = re.compile(r"^(\d+)x(\d+)$")
SEED_RANGE = 2**31  # a seed the service draws when none is given: below it, so clients can send it back as an int


class ImageBody(BaseModel):
    """POST /v1/images/generations. Fields OpenAI's API has and this service does not use are ignored."""

    prompt: str = Field(min_length=1)
    model: str | None = None
    n: int = 1
    size: str | None = Field(None, description="WIDTHxHEIGHT; default: the model's")
    response_format: Literal["b64_json", "url"] = "b64_json"
    negative_prompt: str | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = Field(None, description="image i of the request is drawn with seed + i")
    image: str | None = Field(None, description="input image, base64 (or a data URL): edit, Kontext, "
                                                "image-to-video pipelines")
    stream: bool = Field(False, description="answer as Server-Sent Events: progress, then the result")
    timeout_s: float | None = Field(None, gt=0, description="seconds from admission to the answer: past them the "
                                                            "request answers 504 (its call stops at the next step)")


class VideoBody(ImageBody):
    """POST /v1/videos/generations: one video, answered as an MP4 (or, streamed, its base64)."""

    num_frames: int | None = None


@dataclass(frozen=True)
class Limits:
    """What the service accepts (its command line)."""

    max_n: int = 4
    max_steps: int = 100
    max_pixels: int = 2048 * 2048
    max_frames: int = 257
    max_timeout_s: float = 600.0  # the longest deadline a request may ask for, and the deadline of one without


@dataclass(frozen=True)
class ModelScale:
    """How the served model prices a request: the size, frames and steps of a request that names none, how many
    pixels per side and frames make one token, and the most pixels its released configuration takes."""

    height: int
    width: int
    frames: int  # 1 for an image model
    steps: int
    size_multiple: int  # pixels per token along each side (the VAE's downsampling times the 2 x 2 patches)
    frames_per_latent: int
    max_pixels: int

    def tokens(self, options: CallOptions) -> int:
        """The transformer's tokens for one output of a call with `options`."""
        height, width = options.height or self.height, options.width or self.width
        frames = options.num_frames or self.frames
        side = -(-height // self.size_multiple) * -(-width // self.size_multiple)
        return side * ((frames - 1) // self.frames_per_latent + 1)


@dataclass(frozen=True)
class ModelCard:
    """What the served pipeline can take, read once it is loaded."""

    id: str
    video: bool
    image: ImageInput  # whether a request gives an input image: never, may, or must
    text_encoder: bool  # False for a random-weight config: prompts seed embeddings, negative prompts mean nothing
    size_multiple: int
    default_height: int | None
    default_width: int | None
    fps: int
    scale: ModelScale | None = None  # how the model prices a request (None: no bound by size or cost)


class RequestError(ValueError):
    """A request the service refuses before it runs: the HTTP status, the field at fault and why."""

    def __init__(self, param: str, message: str, status: int = 400) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message, self.status = param, message, status


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request, the same on every rank: `n` outputs drawn with seeds `seed` .. `seed + n - 1`."""

    id: str
    prompt: str
    n: int
    seed: int
    video: bool
    options: CallOptions = CallOptions()
    deadline_s: float = float("inf")  # from admission to the answer

    @property
    def batch_key(self) -> tuple | None:
        """Requests with equal keys run in one pipeline call; None: this one runs alone (an input image)."""
        return None if self.options.image is not None else (self.video, self.options)

    @property
    def seeds(self) -> list[int]:
        return [self.seed + i for i in range(self.n)]


def generation_of(batch: list[GenerationRequest]) -> Generation:
    """One pipeline call for requests with one batch key: each request's prompt once per output."""
    return Generation(tuple(r.prompt for r in batch for _ in range(r.n)), batch[0].options)


def check(body: ImageBody, card: ModelCard, limits: Limits, request_id: str) -> GenerationRequest:
    """The request `body` asks for, or RequestError naming the first field the model cannot take."""
    video = isinstance(body, VideoBody)
    if video != card.video:
        endpoint = "/v1/videos/generations" if card.video else "/v1/images/generations"
        raise RequestError("model", f"{card.id} makes {'videos' if card.video else 'images'}: use {endpoint}")
    if body.model is not None and body.model != card.id:
        raise RequestError("model", f"this service serves {card.id!r}, not {body.model!r}", status=404)
    if not 1 <= body.n <= (1 if video else limits.max_n):
        raise RequestError("n", f"must be between 1 and {1 if video else limits.max_n}, got {body.n}")
    height, width = _size(body.size, card, limits)
    if body.num_inference_steps is not None and not 1 <= body.num_inference_steps <= limits.max_steps:
        raise RequestError("num_inference_steps", f"must be between 1 and {limits.max_steps}, "
                                                  f"got {body.num_inference_steps}")
    if body.guidance_scale is not None and not 0 <= body.guidance_scale <= 100:
        raise RequestError("guidance_scale", f"must be between 0 and 100, got {body.guidance_scale}")
    if body.negative_prompt is not None and not card.text_encoder:
        raise RequestError("negative_prompt", f"{card.id} has no text encoder (random weights): its negative "
                                              f"embeddings are random")
    if body.seed is not None and not 0 <= body.seed < 2**63 - limits.max_n:
        raise RequestError("seed", f"must be between 0 and 2**63 - {limits.max_n}, got {body.seed}")
    num_frames = getattr(body, "num_frames", None)
    if num_frames is not None and not 1 <= num_frames <= limits.max_frames:
        raise RequestError("num_frames", f"must be between 1 and {limits.max_frames}, got {num_frames}")
    if body.timeout_s is not None and body.timeout_s > limits.max_timeout_s:
        raise RequestError("timeout_s", f"at most {limits.max_timeout_s:g} s, got {body.timeout_s:g}")
    image = _image(body.image, card)
    return GenerationRequest(
        id=request_id, prompt=body.prompt, n=body.n, video=video,
        seed=body.seed if body.seed is not None else secrets.randbelow(SEED_RANGE),
        options=CallOptions(negative_prompt=body.negative_prompt, height=height, width=width, num_frames=num_frames,
                            steps=body.num_inference_steps, guidance=body.guidance_scale, image=image),
        deadline_s=body.timeout_s or limits.max_timeout_s)


def _size(size: str | None, card: ModelCard, limits: Limits) -> tuple[int | None, int | None]:
    if size is None:
        return card.default_height, card.default_width
    match = _SIZE.match(size)
    if match is None:
        raise RequestError("size", f"must be WIDTHxHEIGHT, e.g. 1024x1024, got {size!r}")
    width, height = int(match[1]), int(match[2])
    multiple = card.size_multiple
    if width < multiple or height < multiple or width % multiple or height % multiple:
        raise RequestError("size", f"{card.id} takes widths and heights that are multiples of {multiple}, got {size}")
    if width * height > limits.max_pixels:
        raise RequestError("size", f"at most {limits.max_pixels} pixels (the service's --max-pixels), got {size}")
    if card.scale is not None and width * height > card.scale.max_pixels:
        raise RequestError("size", f"{card.id} takes at most {card.scale.max_pixels} pixels (from the "
                                   f"resolution it was released for), got {size}")
    return height, width


def _image(encoded: str | None, card: ModelCard) -> PIL.Image.Image | None:
    if encoded is None:
        if card.image == "required":
            raise RequestError("image", f"{card.id} makes its output from an input image: give one (base64 or a "
                                        f"data URL)")
        return None
    if card.image == "none":
        raise RequestError("image", f"{card.id} takes no input image")
    data = encoded.split(",", 1)[1] if encoded.startswith("data:") else encoded
    try:
        image = PIL.Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
        return image.convert("RGB")
    except (binascii.Error, ValueError, OSError) as error:
        raise RequestError("image", f"not a base64 PNG, JPEG or WebP image ({error})") from error
