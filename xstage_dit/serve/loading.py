"""The pipeline a job generates with, loaded the same way by the generation example and the service: a diffusers
checkpoint (`--model`) or a random-weight config of the package's zoo (`xstage_dit.testing.zoo`, `--config`: no
download, the prompt seeds random text embeddings since such configs have no text encoder), and the command-line
arguments of both: what to load and `enable`'s knobs, parsed and checked once for the job.

The command lines parse and check their arguments with this module before anything heavy loads, so torch, diffusers
and the zoo (which imports both: seconds) are imported by the functions that load or call a pipeline, not here."""
from __future__ import annotations

import argparse
import inspect
import logging
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from ..config import XStageConfig, installed_backends
from ..launcher import launched
from ..testing.catalog import CONFIGS

if TYPE_CHECKING:
    import PIL.Image
    import torch

DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> the torch dtype's name
EXPERT_PARALLEL = {"auto": None, "on": True, "off": False}  # --expert-parallel -> enable(expert_parallel=...)
ZOO_STEPS = 4  # random weights: a few steps show the run; more add nothing
DEFAULT_CONFIG = "tiny-flux"
ImageInput = Literal["none", "optional", "required"]
# diffusers' names of the pipelines that make their output from an input image, whatever `image` defaults to
_IMAGE_PIPELINES = ("ImageToVideo", "Img2Img", "Edit", "Inpaint", "Fill")
# ... and of those that take several reference images in one call (a list as `image`), up to REFERENCE_IMAGES
_REFERENCE_PIPELINES = ("EditPlus", "Flux2")
REFERENCE_IMAGES = 3
UNCARRIED_INPUTS = ("control_image",)  # call inputs a service request has no field for


def quiet_libraries() -> None:
    """Library warnings that tell a user of a job nothing are not shown (transformers' note, at import of
    diffusers' pipelines, that its image processors fall back to PIL without torchvision); the other ranks show
    only errors, so that each warning appears once, on the main rank."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    from ..api import is_main_process

    logging.getLogger("transformers.utils.import_utils").addFilter(
        lambda record: "requires torchvision (not installed)" not in record.getMessage())
    if not is_main_process():
        transformers_logging.set_verbosity_error()
        diffusers_logging.set_verbosity_error()


class JobParser(argparse.ArgumentParser):
    """argparse for a command line that every rank of a job runs: a usage error is said once for the job.

    Every rank parses the same arguments against the same launcher environment, so each meets the same error, before
    anything heavy is imported. The main rank says it and exits 2, which torchrun reports as the job's; the others
    exit 0 at once and say nothing. Were they to exit 2, torchrun would stop the other workers as soon as one of
    them failed, the main rank among them, possibly before it had printed."""

    def error(self, message: str) -> NoReturn:
        if not launched().is_main:
            sys.exit(0)
        super().error(message)


def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --config, --dtype and `enable`'s knobs."""
    parser.add_argument("--model", help="hub id or local path of a diffusers pipeline with real weights")
    parser.add_argument("--config", default=DEFAULT_CONFIG, choices=sorted(CONFIGS), metavar="NAME",
                        help="random-weight config of xstage_dit.testing.zoo used when --model is not given "
                             f"(default: {DEFAULT_CONFIG})")
    parser.add_argument("--dtype", choices=DTYPES, help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--backend", default="auto", choices=installed_backends())
    parser.add_argument("--ulysses-degree", type=int,
                        help="default: as wide as divides the heads within a node (the rest of a CFG group's ranks "
                             "form a ring)")
    parser.add_argument("--ring-degree", type=int, help="default: the CFG group's ranks / the Ulysses degree")
    parser.add_argument("--expert-parallel", choices=EXPERT_PARALLEL, default="auto",
                        help="a mixture of experts (NucleusMoE-Image, HiDream): on: split over the Ulysses group; "
                             "off: every expert on every rank; auto: every expert kept, the mode picked per layer "
                             "call by the planner")
    parser.add_argument("--cfg-degree", type=int, default=1, choices=(1, 2),
                        help="2: split the guidance branches over two groups of ranks")


def enable_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """`xstage_dit.enable`'s keywords from the arguments `add_pipeline_arguments` added."""
    return {"backend": args.backend, "ulysses_degree": args.ulysses_degree, "ring_degree": args.ring_degree,
            "cfg_degree": args.cfg_degree, "expert_parallel": EXPERT_PARALLEL[args.expert_parallel]}


def check_enable_knobs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`enable`'s knobs checked as `enable` checks them (XStageConfig's own checks, and the degrees against the
    launcher's WORLD_SIZE), before anything loads: a usage error now, not a traceback after the loading."""
    try:
        XStageConfig(**enable_knobs(args)).sequence_ranks(launched().world_size)
    except (TypeError, ValueError) as error:
        parser.error(str(error))


def size_multiple(pipe: Any) -> int:
    """What the pipeline's widths and heights are multiples of: its VAE's downsampling times its 2 x 2 patches."""
    scale = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", None) or 8
    return 2 * scale


def default_dtype(args: argparse.Namespace, device: torch.device) -> torch.dtype:
    import torch

    if args.dtype:
        return getattr(torch, DTYPES[args.dtype])
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@dataclass(frozen=True)
class CallOptions:
    """What a pipeline call asks for besides its prompts; None leaves the pipeline's default (--model) or the
    config's (--config)."""

    negative_prompt: str | None = None
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    steps: int | None = None
    guidance: float | None = None
    image: PIL.Image.Image | tuple[PIL.Image.Image, ...] | None = None  # a tuple: several reference images
    mask: PIL.Image.Image | None = None  # an inpainting pipeline's `mask_image`

    def input_images(self) -> dict[str, Any]:
        """The call's keyword arguments for the request's input image(s) and mask."""
        images = {"image": list(self.image) if isinstance(self.image, tuple) else self.image,
                  "mask_image": self.mask}
        return {kwarg: value for kwarg, value in images.items() if value is not None}


@dataclass(frozen=True)
class Generation:
    """One pipeline call: one image or video per prompt (`prompts` holds the batch), each made with `options`."""

    prompts: tuple[str, ...]
    options: CallOptions = CallOptions()


@dataclass
class LoadedPipeline:
    """A loaded pipeline with what building its calls needs: its zoo family (None: a class the zoo does not
    know) and, for a random-weight config, the config's name."""

    pipe: Any
    family: Any
    config: str | None
    device: torch.device
    dtype: torch.dtype
    _batch_dims: dict[str, int] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return self.config if self.config is not None else "model"

    @property
    def is_video(self) -> bool:
        return self.family.video if self.family is not None else hasattr(self.pipe, "video_processor")

    @property
    def fps(self) -> int:
        return self.family.fps if self.family is not None else 16

    def takes(self, kwarg: str) -> bool:
        return kwarg in inspect.signature(self.pipe.__call__).parameters

    def call_kwargs(self, generation: Generation) -> dict[str, Any]:
        """The pipeline's keyword arguments for `generation` (without generator or output type)."""
        if self.config is None:
            return self._model_call(generation)
        return self._config_call(generation)

    def _model_call(self, generation: Generation) -> dict[str, Any]:
        options, batch = generation.options, len(generation.prompts)
        size = {"height": options.height, "width": options.width, "num_frames": options.num_frames,
                "num_inference_steps": options.steps}
        call = {k: v for k, v in size.items() if v is not None}
        call["prompt"] = list(generation.prompts)
        negative = options.negative_prompt
        if options.guidance is not None:
            guidance_kwarg = self.family.guidance_kwarg if self.family else "guidance_scale"
            call[guidance_kwarg] = options.guidance
            if guidance_kwarg == "true_cfg_scale" and options.guidance > 1 and negative is None:
                negative = ""  # true CFG runs only with a negative prompt
        if negative is not None:
            call["negative_prompt"] = [negative] * batch
        call.update(options.input_images())
        return call

    def _config_call(self, generation: Generation) -> dict[str, Any]:
        from ..testing import zoo

        options = generation.options
        entry = zoo.ZOO[self.config]
        call = zoo.call_kwargs(
            self.config, height=options.height or entry.height, width=options.width or entry.width,
            num_frames=options.num_frames or entry.num_frames, steps=options.steps or ZOO_STEPS,
            guidance=1.0 if options.guidance is None else options.guidance)
        call.update(self._config_text(generation.prompts))
        call.update(options.input_images())
        return call

    def _config_text(self, prompts: tuple[str, ...]) -> dict[str, Any]:
        """Each prompt's random embeddings (seeded by the prompt alone, so an image does not depend on the batch it
        ran in), joined along each input's batch dimension."""
        import torch

        from ..testing import zoo

        drawn = [zoo.text_embeddings(self.config, 1, zoo.prompt_seed(p), device=self.device, dtype=self.dtype)
                 for p in prompts]
        if len(drawn) == 1:
            return drawn[0]
        joined = {}
        for name, first in drawn[0].items():
            if isinstance(first, list):  # one tensor per prompt (Z-Image's captions)
                joined[name] = [tensor for inputs in drawn for tensor in inputs[name]]
            else:
                joined[name] = torch.cat([inputs[name] for inputs in drawn], dim=self.batch_dims()[name])
        return joined

    def batch_dims(self) -> dict[str, int]:
        """Which dimension of each text input is the batch (HiDream's Llama states lead with the layer)."""
        if self._batch_dims is None:
            from ..testing import zoo

            one, two = (zoo.text_embeddings(self.config, b, 0) for b in (1, 2))
            self._batch_dims = {name: next(d for d, (a, b) in enumerate(zip(t.shape, two[name].shape)) if a != b)
                                for name, t in one.items() if not isinstance(t, list)}
        return self._batch_dims


def image_input(pipeline_cls: type) -> ImageInput:
    """Whether the calls of `pipeline_cls` take an input image: "required" where its `image` has no default or
    the class makes its output from one (image-to-video, img2img, edit, inpaint, fill), "optional" where a call
    may go without one (Kontext, FLUX.2's reference images), else "none"."""
    parameter = inspect.signature(pipeline_cls.__call__).parameters.get("image")
    if parameter is None:
        return "none"
    if parameter.default is inspect.Parameter.empty or any(m in pipeline_cls.__name__ for m in _IMAGE_PIPELINES):
        return "required"
    return "optional"


def max_input_images(pipeline_cls: type) -> int:
    """How many input images one call of `pipeline_cls` takes: several for those that take reference images."""
    return REFERENCE_IMAGES if any(m in pipeline_cls.__name__ for m in _REFERENCE_PIPELINES) else 1


def inpaints(pipeline_cls: type) -> bool:
    """Whether `pipeline_cls` takes a mask (white where it paints) with its input image."""
    return "mask_image" in inspect.signature(pipeline_cls.__call__).parameters


def uncarried_inputs(pipeline_cls: type) -> list[str]:
    """The input images `pipeline_cls` takes that no request carries (control images): a random-weight config
    draws them; a checkpoint cannot be served without them."""
    parameters = inspect.signature(pipeline_cls.__call__).parameters
    return [name for name in UNCARRIED_INPUTS if name in parameters]


def family_of(model: str | None, config: str) -> Any:
    """The zoo family of the pipeline asked for (None for a pipeline class the zoo does not know)."""
    from ..testing import zoo

    if not model:
        return zoo.FAMILIES[zoo.ZOO[config].family]
    class_name = _class_name(model)
    return next((f for f in zoo.FAMILIES.values()
                 if class_name.startswith(f.pipeline.removesuffix("Pipeline"))), None)


def pipeline_class(model: str) -> type | None:
    """The diffusers pipeline class of checkpoint `model` (None: a class diffusers does not have)."""
    import diffusers

    return getattr(diffusers, _class_name(model), None)


def _class_name(model: str) -> str:
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.load_config(model)["_class_name"]


def load_pipeline(model: str | None, config: str, family: Any, device: torch.device, dtype: torch.dtype
                  ) -> LoadedPipeline:
    """The pipeline on `device`: `model`'s weights (VAEs that diffusers keeps in float32, Wan's, stay in float32),
    or `config`'s random ones."""
    import torch

    from ..testing import zoo

    if model:
        from diffusers import DiffusionPipeline

        dtypes = {"default": dtype, "vae": torch.float32} if family and family.vae_float32 else dtype
        pipe = DiffusionPipeline.from_pretrained(model, dtype=dtypes).to(device)
        return LoadedPipeline(pipe, family, None, device, dtype)
    return LoadedPipeline(zoo.build_pipeline(config, device=device, dtype=dtype), family, config, device, dtype)
