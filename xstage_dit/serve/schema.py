"""What a client may ask for, checked on rank 0 before anything reaches the ranks: the HTTP bodies (OpenAI's image
fields and ours), the model's limits, and the checked request every rank runs; the service's knobs (its command
line)."""
from __future__ import annotations

import base64
import binascii
import io
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

import PIL.Image
from pydantic import BaseModel, ConfigDict, Field

from .loading import CallOptions, Generation, ImageInput

_SIZE = re.compile(r"([0-9]{1,5})x([0-9]{1,5})")  # ASCII digits only: \d and int() take other scripts' digits
_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")  # what an input image may be: no other decoder of PIL sees a request
SEED_RANGE = 2**31  # a seed the service draws when none is given: below it, so clients can send it back as an int


class ImageBody(BaseModel):
    """POST /v1/images/generations (and the form fields of /v1/images/edits). Types are strict: a number in a
    string, a boolean for a number or a string for a boolean is refused, not converted. A field the body does not
    have is refused; `user` (OpenAI's id of the end user) is taken and ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")

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
    mask: str | None = Field(None, description="inpainting mask, base64 (or a data URL): white where the "
                                               "pipeline paints")
    user: str | None = Field(None, description="OpenAI's end-user id: taken and ignored")
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
class ServeOptions:
    """The service's knobs (its command line; `enable`'s are applied before it starts)."""

    host: str = "127.0.0.1"
    port: int = 8000
    queue_bound: int = 16
    max_batch: int = 1
    timeout_s: float = 600.0
    limits: Limits = Limits()
    enable: dict[str, Any] = field(default_factory=dict)  # what `enable` was given, for /v1/models to report
    max_body_bytes: int = 8 * 2**20  # a request's body, its images included
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: no key needed
    open_metrics: bool = False  # /metrics needs no key (for a Prometheus scraper)

    def describe(self, ranks: int) -> dict[str, Any]:
        return {"ranks": ranks, "queue_bound": self.queue_bound, "max_batch": self.max_batch,
                "timeout_s": self.timeout_s, "max_timeout_s": self.limits.max_timeout_s,
                "max_body_bytes": self.max_body_bytes, "keys": bool(self.api_keys), "enable": self.enable}


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
    max_images: int = 1  # input images one request may give (several: reference images)
    mask: bool = False  # whether the pipeline inpaints: an input image comes with a mask
    ignored: frozenset[str] = frozenset()  # request fields the pipeline has no argument for
    scale: ModelScale | None = None  # how the model prices a request (None: no bound by size or cost)


class RequestError(ValueError):
    """A request the service refuses before it runs: the HTTP status, the field at fault (None: no one field)
    and why."""

    def __init__(self, param: str | None, message: str, status: int = 400,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(f"{param}: {message}" if param else message)
        self.param, self.message, self.status, self.headers = param, message, status, headers


@dataclass(frozen=True)
class Uploads:
    """A request's input images, encoded (PNG, JPEG or WebP): a JSON body's base64 or a multipart form's files."""

    images: tuple[bytes, ...] = ()
    mask: bytes | None = None

    @classmethod
    def of_json(cls, body: ImageBody) -> Uploads:
        return cls(() if body.image is None else (_base64(body.image, "image"),),
                   None if body.mask is None else _base64(body.mask, "mask"))


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


def check(body: ImageBody, card: ModelCard, limits: Limits, request_id: str, uploads: Uploads | None = None
          ) -> GenerationRequest:
    """The request `body` asks for, with its input images (`uploads`; by default the body's base64 ones), or
    RequestError naming the first field the model cannot take."""
    video = isinstance(body, VideoBody)
    if video != card.video:
        endpoint = "/v1/videos/generations" if card.video else "/v1/images/generations"
        raise RequestError("model", f"{card.id} makes {'videos' if card.video else 'images'}: use {endpoint}")
    if body.model is not None and body.model != card.id:
        raise RequestError("model", f"this service serves {card.id!r}, not {body.model!r}", status=404)
    ignored = sorted(name for name in body.model_fields_set & card.ignored if getattr(body, name) is not None)
    if ignored:
        raise RequestError(ignored[0], f"{card.id}'s pipeline has no argument for it: it would be ignored")
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
    image, mask = _inputs(uploads if uploads is not None else Uploads.of_json(body), card, limits)
    return GenerationRequest(
        id=request_id, prompt=body.prompt, n=body.n, video=video,
        seed=body.seed if body.seed is not None else secrets.randbelow(SEED_RANGE),
        options=CallOptions(negative_prompt=body.negative_prompt, height=height, width=width, num_frames=num_frames,
                            steps=body.num_inference_steps, guidance=body.guidance_scale, image=image,
                            mask=mask),
        deadline_s=body.timeout_s or limits.max_timeout_s)


def _size(size: str | None, card: ModelCard, limits: Limits) -> tuple[int | None, int | None]:
    if size is None:
        return card.default_height, card.default_width
    match = _SIZE.fullmatch(size)
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


def _inputs(uploads: Uploads, card: ModelCard, limits: Limits
            ) -> tuple[PIL.Image.Image | tuple[PIL.Image.Image, ...] | None, PIL.Image.Image | None]:
    """The pipeline's input image (a tuple of them where it takes several) and mask, decoded."""
    if not uploads.images:
        if card.image == "required":
            raise RequestError("image", f"{card.id} makes its output from an input image: give one")
        if uploads.mask is not None:
            raise RequestError("mask", "a mask goes with an input image: give one")
        return None, None
    if card.image == "none":
        raise RequestError("image", f"{card.id} takes no input image")
    if len(uploads.images) > card.max_images:
        raise RequestError("image", f"{card.id} takes at most {card.max_images} input image(s), got "
                                    f"{len(uploads.images)}")
    if card.mask != (uploads.mask is not None):
        raise RequestError("mask", f"{card.id} inpaints: give the mask (white where it paints) with the image"
                           if card.mask else f"{card.id} takes no mask")
    images = tuple(_decoded(data, "image", "RGB", limits) for data in uploads.images)
    mask = _decoded(uploads.mask, "mask", "L", limits) if uploads.mask is not None else None
    return images[0] if len(images) == 1 else images, mask


def _base64(encoded: str, param: str) -> bytes:
    data = encoded.split(",", 1)[1] if encoded.startswith("data:") else encoded
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise RequestError(param, f"not base64 ({error})") from error


def _decoded(data: bytes, param: str, mode: str, limits: Limits) -> PIL.Image.Image:
    """`data` as an image of `mode`, its size checked before its pixels are decoded."""
    try:
        image = PIL.Image.open(io.BytesIO(data), formats=_IMAGE_FORMATS)
    except (OSError, PIL.Image.DecompressionBombError) as error:
        raise RequestError(param, f"not a PNG, JPEG or WebP image ({error})") from error
    if image.width * image.height > limits.max_pixels:
        raise RequestError(param, f"at most {limits.max_pixels} pixels, got {image.width}x{image.height}")
    try:
        return image.convert(mode)
    except (OSError, ValueError) as error:
        raise RequestError(param, f"does not decode ({error})") from error
