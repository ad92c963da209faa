r"""Generate an image or a video with xstage_dit's Ulysses sequence parallelism.

    python examples/generate.py                                   # tiny random Flux, one process
    torchrun --nproc_per_node 2 examples/generate.py              # the same on 2 ranks
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc_per_node 8 examples/generate.py --model black-forest-labs/FLUX.1-dev --prompt "a cat"

Without --model the pipeline is built from a config in examples/zoo.py with random weights (no download) and
the prompt seeds random text embeddings, since such configs have no text encoder. Only the main rank shows
progress and writes the output."""
from __future__ import annotations

import argparse
import logging
import statistics

import torch
from diffusers import DiffusionPipeline
from diffusers.utils import export_to_gif

import xstage_dit

import zoo
from step_timer import StepTimer


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="hub id or local path of a diffusers pipeline with real weights")
    parser.add_argument("--config", default="tiny-flux", choices=sorted(zoo.ZOO),
                        help="random-weight config used when --model is not given")
    parser.add_argument("--prompt", default="a lighthouse on a cliff at dawn")
    parser.add_argument("--height", type=int)
    parser.add_argument("--width", type=int)
    parser.add_argument("--num-frames", type=int, help="video models only")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--guidance", type=float, default=1.0,
                        help="classifier-free guidance scale (true CFG for Flux, HunyuanVideo, QwenImage); 1 disables it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", choices=xstage_dit.available_backends())
    parser.add_argument("--cfg-degree", type=int, default=1, choices=(1, 2),
                        help="2: split the guidance branches over two groups of ranks")
    parser.add_argument("--output", help="output file (default: output.png, or output.gif for video)")
    return parser.parse_args()


def load_pipeline(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """(pipeline, extra call kwargs, is_video)."""
    if args.model:
        pipe = DiffusionPipeline.from_pretrained(args.model, torch_dtype=dtype).to(device)
        is_video = hasattr(pipe, "video_processor")
        size = {"height": args.height, "width": args.width}
        if is_video:
            size["num_frames"] = args.num_frames
        call = {k: v for k, v in size.items() if v is not None}
        call.update(prompt=args.prompt, num_inference_steps=args.steps)
        family = next((f for f in zoo.FAMILIES.values() if f.pipeline == type(pipe).__name__), None)
        guidance_kwarg = family.guidance_kwarg if family else "guidance_scale"
        call[guidance_kwarg] = args.guidance
        if guidance_kwarg == "true_cfg_scale" and args.guidance > 1:
            call["negative_prompt"] = ""  # true CFG runs only with a negative prompt
        return pipe, call, is_video
    entry = zoo.ZOO[args.config]
    pipe = zoo.build_pipeline(args.config, device=device, dtype=dtype)
    call = zoo.call_kwargs(
        args.config, height=args.height or entry.height, width=args.width or entry.width,
        num_frames=args.num_frames or entry.num_frames, steps=args.steps, guidance=args.guidance,
    )
    call.update(zoo.text_embeddings(args.config, 1, zoo.prompt_seed(args.prompt), device=device, dtype=dtype))
    return pipe, call, entry.is_video


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO if xstage_dit.is_main_process() else logging.WARNING)
    device = xstage_dit.local_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    pipe, call, is_video = load_pipeline(args, device, dtype)
    xstage_dit.enable(pipe, backend=args.backend, cfg_degree=args.cfg_degree)

    timer = StepTimer(device)
    timer.start()
    result = pipe(**call, generator=torch.Generator().manual_seed(args.seed), output_type="pil",
                  callback_on_step_end=timer)
    timer.finish()

    if xstage_dit.is_main_process():
        output = args.output or ("output.gif" if is_video else "output.png")
        if is_video:
            export_to_gif(result.frames[0], output)
        else:
            result.images[0].save(output)
        steps = timer.step_seconds
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        print(f"{world} rank(s), {device.type}: {len(steps)} steps, per-step median "
              f"{statistics.median(steps) * 1e3:.1f} ms (first {steps[0] * 1e3:.1f} ms), "
              f"denoising {timer.total_seconds - timer.after_loop_seconds:.2f} s, decode "
              f"{timer.after_loop_seconds:.2f} s; wrote {output}")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
