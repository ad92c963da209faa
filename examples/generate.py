r"""Generate an image or a video with xstage_dit's Ulysses sequence parallelism.

    python examples/generate.py                                   # tiny random Flux, one process
    torchrun --nproc_per_node 2 examples/generate.py              # the same on 2 ranks
    accelerate launch --multi_gpu --num_processes 2 examples/generate.py   # the same with accelerate (CPU too)
    torchrun --nproc_per_node 2 examples/generate.py --config tiny-flux-kontext --image in.png
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc_per_node 8 examples/generate.py --model black-forest-labs/FLUX.1-dev --prompt "a cat"

Without --model the pipeline is built from a config in xstage_dit/testing/zoo.py with random weights (no download)
and the prompt seeds random text embeddings, since such configs have no text encoder; configs whose pipeline takes
images (Kontext, Fill, Control, image-to-video) draw random ones unless --image is given. With --model, steps
and guidance are the pipeline's own defaults unless given, and VAEs that diffusers keeps in float32 (Wan's) stay
in float32. Only the main rank shows progress and writes the output (--output, by default into out/ of the current
directory, which git ignores in the checkout): PNG/JPEG for images, GIF or MP4 (at the
model's frame rate; MP4 needs the `video` extra, which also muxes the sound of audio-video models, LTX-2's) for
videos."""
from __future__ import annotations

import argparse
import logging
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import xstage_dit
from xstage_dit.cli import positive_int
from xstage_dit.launcher import launched
from xstage_dit.serve import loading, media
from xstage_dit.serve.media import IMAGE_SUFFIXES, VIDEO_SUFFIXES
from xstage_dit.testing.catalog import CONFIGS

from provenance import OUTPUT_DIR

if TYPE_CHECKING:
    import PIL.Image

# torch, diffusers and the zoo (seconds) are imported once the arguments are checked: --help and a bad argument
# answer at once, and every rank of a job refused on its arguments ends before any of them imports torch


def refuse(message: str) -> NoReturn:
    """Stop the job on a bad argument, as argparse does (the usage, the message, exit status 2), once for the job."""
    build_parser().error(message)


def build_parser() -> loading.JobParser:
    parser = loading.JobParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_pipeline_arguments(parser)
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dawn")
    parser.add_argument("--negative-prompt", help="--model only (a config's negative embeddings are random)")
    parser.add_argument("--image", type=Path, help="input image of image-to-image/video pipelines (Kontext, Edit, "
                                                   "image-to-video): the pipeline's `image` argument")
    parser.add_argument("--height", type=positive_int)
    parser.add_argument("--width", type=positive_int)
    parser.add_argument("--num-frames", type=positive_int, help="video models only")
    parser.add_argument("--steps", type=positive_int,
                        help=f"default: the pipeline's own (--model), {loading.ZOO_STEPS} (--config)")
    parser.add_argument("--guidance", type=float,
                        help="classifier-free guidance scale (true CFG for Flux, HunyuanVideo, QwenImage; 1 disables "
                             "it); default: the pipeline's own (--model), 1 (--config)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help=f"output file (default: {OUTPUT_DIR / 'output.png'}, or "
                                                    f"{OUTPUT_DIR / 'output.gif'} for video)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, enable's knobs checked against the launcher's world size."""
    parser = build_parser()
    args = parser.parse_args(argv)
    loading.check_enable_knobs(parser, args)
    return args


def check_size(args: argparse.Namespace, multiple: int, name: str) -> None:
    """--height and --width are multiples of what pipeline `name` takes (as the service checks its requests)."""
    for side in ("height", "width"):
        value = getattr(args, side)
        if value is not None and value % multiple:
            refuse(f"argument --{side}: {name} takes multiples of {multiple}, got {value}")


def check_image_input(args: argparse.Namespace, pipeline: str, image_input: str) -> None:
    """An --image only for a pipeline that takes one (`image_input` as loading.image_input says)."""
    if args.image is not None and image_input == "none":
        refuse(f"argument --image: {pipeline} takes no input image")


def output_path(args: argparse.Namespace, is_video: bool) -> Path:
    """The file to write, checked before anything is loaded or generated (and --num-frames, for videos only). What
    only the main rank needs, since it writes the file, only it checks: another node may lack the folder."""
    if args.num_frames is not None and not is_video:
        refuse(f"argument --num-frames: {args.model or args.config} makes images")
    output = args.output or OUTPUT_DIR / ("output.gif" if is_video else "output.png")
    suffixes = VIDEO_SUFFIXES if is_video else IMAGE_SUFFIXES
    if output.suffix.lower() not in suffixes:
        refuse(f"--output {output}: {'a video' if is_video else 'an image'} is written as {', '.join(suffixes)}")
    if not launched().is_main:
        return output
    if output.suffix.lower() == ".mp4" and not media.can_write_mp4():
        refuse(f"--output {output}: MP4 needs imageio, imageio-ffmpeg and PyAV (pip install 'xstage_dit[video]'); "
               f"or write a .gif")
    if args.output is not None and not output.parent.resolve().is_dir():
        refuse(f"--output {output}: no directory {output.parent}")
    return output


def input_image(path: Path | None) -> PIL.Image.Image | None:
    """The --image file as RGB, read before anything is loaded."""
    if path is None:
        return None
    import PIL.Image

    try:
        with PIL.Image.open(path) as image:
            return image.convert("RGB")
    except FileNotFoundError:
        refuse(f"--image {path}: no such file")
    except OSError as error:  # a directory, a file PIL cannot read
        refuse(f"--image {path}: not an image this script can read ({error})")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    output = None
    if not args.model:  # a zoo config: what its pipeline takes is listed, known before torch is imported
        listing = CONFIGS[args.config]
        output = output_path(args, listing.video)
        check_image_input(args, listing.pipeline, listing.image)
        check_size(args, listing.size_multiple, args.config)
    image = input_image(args.image)
    run(args, output, image)


def run(args: argparse.Namespace, output: Path | None, image: PIL.Image.Image | None) -> None:
    """Load the pipeline, enable xstage_dit on it, run it and write its output (on the main rank)."""
    import torch

    from step_timer import StepTimer, reporting_steps

    logging.basicConfig(level=logging.INFO if xstage_dit.is_main_process() else logging.WARNING)
    loading.quiet_libraries()
    device = xstage_dit.local_device()
    family = loading.family_of(args.model, args.config)
    if args.model:  # a checkpoint's class is read from its config; video or not, from the zoo's family if it knows it
        output = output_path(args, family.video) if family else None
        pipeline_cls = loading.pipeline_class(args.model)
        if pipeline_cls is not None:
            check_image_input(args, pipeline_cls.__name__, loading.image_input(pipeline_cls))
    if args.negative_prompt is not None and not args.model:
        logging.getLogger(__name__).warning("--negative-prompt needs --model: a config's negative embeddings are "
                                            "random")
    loaded = loading.load_pipeline(args.model, args.config, family, device, loading.default_dtype(args, device))
    pipe = loaded.pipe
    output = output or output_path(args, is_video=loaded.is_video)
    if args.model:  # what sizes a checkpoint takes its VAE tells, once loaded
        check_size(args, loading.size_multiple(pipe), loaded.name)
    call = loaded.call_kwargs(loading.Generation((args.prompt,), loading.CallOptions(
        negative_prompt=args.negative_prompt if args.model else None, height=args.height, width=args.width,
        num_frames=args.num_frames, steps=args.steps, guidance=args.guidance, image=image)))
    try:
        xstage_dit.enable(pipe, **loading.enable_knobs(args))
    except ValueError as error:  # what only the loaded model tells (its heads against the Ulysses degree)
        refuse(str(error))

    timer = StepTimer(device)
    with reporting_steps(pipe, timer) as step_callback:
        timer.start()
        result = pipe(**call, generator=torch.Generator().manual_seed(args.seed), output_type="pil",
                      **step_callback)
        timer.finish()

    if xstage_dit.is_main_process():
        output.parent.mkdir(parents=True, exist_ok=True)  # the default folder
        media.write_output(result, 0, output, loaded.fps, pipe)
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
