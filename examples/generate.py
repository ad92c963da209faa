r"""Generate an image or a video with xstage_dit's Ulysses sequence parallelism.

    python examples/generate.py                                   # tiny random Flux, one process
    torchrun --nproc_per_node 2 examples/generate.py              # the same on 2 ranks
    accelerate launch --multi_gpu --num_processes 2 examples/generate.py   # the same with accelerate (CPU too)
    torchrun --nproc_per_node 2 examples/generate.py --config tiny-flux-kontext --image in.png
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc_per_node 8 examples/generate.py --model black-forest-labs/FLUX.1-dev --prompt "a cat"

Without --model the pipeline is built from a config in examples/zoo.py with random weights (no download) and
the prompt seeds random text embeddings, since such configs have no text encoder; configs whose pipeline takes
images (Kontext, Fill, Control, image-to-video) draw random ones unless --image is given. With --model, steps
and guidance are the pipeline's own defaults unless given, and VAEs that diffusers keeps in float32 (Wan's) stay
in float32. Only the main rank shows progress and writes the output (--output, by default into out/ of the current
directory, which git ignores in the checkout): PNG/JPEG for images, GIF or MP4 (at the
model's frame rate; MP4 needs the `video` extra, which also muxes the sound of audio-video models, LTX-2's) for
videos."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import statistics
from pathlib import Path
from typing import Any, NoReturn

import PIL.Image
import torch
from diffusers import DiffusionPipeline
from diffusers.utils import export_to_gif, export_to_video
from diffusers.utils import logging as diffusers_logging
from diffusers.utils.export_utils import encode_video
from transformers.utils import logging as transformers_logging

import xstage_dit
from xstage_dit.cli import positive_int

import zoo
from provenance import OUTPUT_DIR
from step_timer import StepTimer, reporting_steps

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
EXPERT_PARALLEL = {"auto": None, "on": True, "off": False}  # --expert-parallel -> enable(expert_parallel=...)
IMAGE_SUFFIXES, VIDEO_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp"), (".gif", ".mp4")
ZOO_STEPS = 4  # random weights: a few steps show the run; more add nothing


def refuse(message: str) -> NoReturn:
    """Stop the job before anything is loaded: the message once, on the main rank; a quiet exit on the others."""
    raise SystemExit(message if xstage_dit.is_main_process() else 2)


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are printed once for the job, not once per rank."""

    def error(self, message: str) -> NoReturn:
        if not xstage_dit.is_main_process():
            raise SystemExit(2)
        super().error(message)


def quiet_libraries() -> None:
    """Library warnings that tell a user of this script nothing are not shown (transformers' note, at import of
    diffusers' pipelines, that its image processors fall back to PIL without torchvision); the other ranks show
    only errors, so that each warning appears once, on the main rank."""
    logging.getLogger("transformers.utils.import_utils").addFilter(
        lambda record: "requires torchvision (not installed)" not in record.getMessage())
    if not xstage_dit.is_main_process():
        transformers_logging.set_verbosity_error()
        diffusers_logging.set_verbosity_error()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="hub id or local path of a diffusers pipeline with real weights")
    parser.add_argument("--config", default="tiny-flux", choices=sorted(zoo.ZOO),
                        help="random-weight config used when --model is not given")
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dawn")
    parser.add_argument("--negative-prompt", help="--model only (a config's negative embeddings are random)")
    parser.add_argument("--image", type=Path, help="input image of image-to-image/video pipelines (Kontext, Edit, "
                                                   "image-to-video): the pipeline's `image` argument")
    parser.add_argument("--height", type=positive_int)
    parser.add_argument("--width", type=positive_int)
    parser.add_argument("--num-frames", type=positive_int, help="video models only")
    parser.add_argument("--steps", type=positive_int,
                        help=f"default: the pipeline's own (--model), {ZOO_STEPS} (--config)")
    parser.add_argument("--guidance", type=float,
                        help="classifier-free guidance scale (true CFG for Flux, HunyuanVideo, QwenImage; 1 disables "
                             "it); default: the pipeline's own (--model), 1 (--config)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, help="default: bf16 on a GPU, fp32 on the CPU")
    parser.add_argument("--backend", default="auto", choices=xstage_dit.available_backends())
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
    parser.add_argument("--output", type=Path, help=f"output file (default: {OUTPUT_DIR / 'output.png'}, or "
                                                    f"{OUTPUT_DIR / 'output.gif'} for video)")
    return parser.parse_args(argv)


def family_of(args: argparse.Namespace) -> zoo.Family | None:
    """The zoo family of the pipeline asked for (None for a pipeline class the zoo does not know)."""
    if not args.model:
        return zoo.FAMILIES[zoo.ZOO[args.config].family]
    class_name = DiffusionPipeline.load_config(args.model)["_class_name"]
    return next((f for f in zoo.FAMILIES.values() if class_name.startswith(f.pipeline.removesuffix("Pipeline"))),
                None)


def output_path(args: argparse.Namespace, is_video: bool) -> Path:
    """The file to write, checked before anything is loaded or generated."""
    output = args.output or OUTPUT_DIR / ("output.gif" if is_video else "output.png")
    suffixes = VIDEO_SUFFIXES if is_video else IMAGE_SUFFIXES
    if output.suffix.lower() not in suffixes:
        refuse(f"--output {output}: a {'video' if is_video else 'image'} is written as {', '.join(suffixes)}")
    if output.suffix.lower() == ".mp4" and not all(importlib.util.find_spec(m) for m in ("imageio_ffmpeg", "av")):
        refuse(f"--output {output}: MP4 needs imageio, imageio-ffmpeg and PyAV (pip install 'xstage_dit[video]'); "
               f"or write a .gif")
    if args.output is not None and not output.parent.resolve().is_dir():
        refuse(f"--output {output}: no directory {output.parent}")
    return output


def input_image(path: Path | None) -> PIL.Image.Image | None:
    """The --image file as RGB, read before anything is loaded."""
    if path is None:
        return None
    try:
        with PIL.Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        refuse(f"--image {path}: no such file")
    except OSError as error:  # a directory, a file PIL cannot read
        refuse(f"--image {path}: not an image this script can read ({error})")


def load_pipeline(args: argparse.Namespace, family: zoo.Family | None, device: torch.device, dtype: torch.dtype
                  ) -> tuple[DiffusionPipeline, dict[str, Any]]:
    """The pipeline and its call kwargs."""
    if args.model:
        dtypes = {"default": dtype, "vae": torch.float32} if family and family.vae_float32 else dtype
        pipe = DiffusionPipeline.from_pretrained(args.model, dtype=dtypes).to(device)
        size = {"height": args.height, "width": args.width, "num_frames": args.num_frames,
                "num_inference_steps": args.steps}
        call = {k: v for k, v in size.items() if v is not None}
        call.update(prompt=args.prompt)
        if args.negative_prompt is not None:
            call["negative_prompt"] = args.negative_prompt
        if args.guidance is not None:
            guidance_kwarg = family.guidance_kwarg if family else "guidance_scale"
            call[guidance_kwarg] = args.guidance
            if guidance_kwarg == "true_cfg_scale" and args.guidance > 1 and args.negative_prompt is None:
                call["negative_prompt"] = ""  # true CFG runs only with a negative prompt
        return pipe, call
    if args.negative_prompt is not None:
        logging.getLogger(__name__).warning("--negative-prompt needs --model: a config's negative embeddings are "
                                            "random")
    entry = zoo.ZOO[args.config]
    pipe = zoo.build_pipeline(args.config, device=device, dtype=dtype)
    call = zoo.call_kwargs(
        args.config, height=args.height or entry.height, width=args.width or entry.width,
        num_frames=args.num_frames or entry.num_frames, steps=args.steps or ZOO_STEPS,
        guidance=1.0 if args.guidance is None else args.guidance,
    )
    call.update(zoo.text_embeddings(args.config, 1, zoo.prompt_seed(args.prompt), device=device, dtype=dtype))
    return pipe, call


def write(result: Any, output: Path, family: zoo.Family | None, pipe: DiffusionPipeline) -> None:
    fps = family.fps if family else 16
    audio = getattr(result, "audio", None)  # an audio-video pipeline's waveforms (LTX-2's vocoder output)
    output.parent.mkdir(parents=True, exist_ok=True)  # the default folder
    if output.suffix.lower() not in VIDEO_SUFFIXES:
        result.images[0].save(output)
    elif output.suffix.lower() == ".mp4" and audio is not None:
        encode_video(result.frames[0], fps, str(output), audio=audio[0].float().cpu(),
                     audio_sample_rate=pipe.vocoder.config.output_sampling_rate)
    elif output.suffix.lower() == ".mp4":
        export_to_video(result.frames[0], str(output), fps=fps)
    else:
        export_to_gif(result.frames[0], str(output), fps=fps)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO if xstage_dit.is_main_process() else logging.WARNING)
    quiet_libraries()
    device = xstage_dit.local_device()
    dtype = DTYPES[args.dtype] if args.dtype else torch.bfloat16 if device.type == "cuda" else torch.float32
    family = family_of(args)
    # a pipeline class the zoo does not know: video or not is known once loaded
    output = output_path(args, is_video=family.video) if family else None
    image = input_image(args.image)
    pipe, call = load_pipeline(args, family, device, dtype)
    output = output or output_path(args, is_video=hasattr(pipe, "video_processor"))
    if image is not None:
        call["image"] = image
    xstage_dit.enable(pipe, backend=args.backend, ulysses_degree=args.ulysses_degree, ring_degree=args.ring_degree,
                      cfg_degree=args.cfg_degree, expert_parallel=EXPERT_PARALLEL[args.expert_parallel])

    timer = StepTimer(device)
    with reporting_steps(pipe, timer) as step_callback:
        timer.start()
        result = pipe(**call, generator=torch.Generator().manual_seed(args.seed), output_type="pil",
                      **step_callback)
        timer.finish()

    if xstage_dit.is_main_process():
        write(result, output, family, pipe)
        steps = timer.step_seconds
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        print(f"{world} rank(s), {device.type}: {len(steps)} steps, per-step median "
              f"{statistics.median(steps) * 1e3:.1f} ms (first {steps[0] * 1e3:.1f} ms), "
              f"denoising {timer.total_seconds - timer.after_loop_seconds:.2f} s, decode "
              f"{timer.after_loop_seconds:.2f} s; wrote {output}")
    # CUDA graphs that hold NCCL collectives must be gone before the process group (pytorch#115388)
    xstage_dit.disable(pipe)
    del pipe
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
