r"""Correctness on real peers: each backend's parallel result against the single-GPU result, bf16, fixed seed.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc_per_node 8 examples/check_parallel.py --config flux-dev wan-1.3b --backend reference fused

Every rank first runs the stock pipeline alone on its GPU (no collectives), then the same call with xstage_dit
enabled on all ranks, and compares the latents. Random weights, real configs (zoo.py), a few steps. Tolerance:
bf16 pipelines whose attention kernel changes drift by up to a few 1e-2 relative over steps (float32: 1e-3). The
stock call also runs twice: where it does not repeat itself (expert choice turns bf16 atomics' rounding into
other selections), a parallel result may differ from it by up to 1.5 times as much as it differs from itself.
Writes OUT.json and OUT.md on the main rank; exits non-zero if any backend is out of tolerance."""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import xstage_dit
from xstage_dit.runtime import world_from_env
from xstage_dit.serve.loading import EXPERT_PARALLEL
from xstage_dit.sp.fabric import symmetric_backends_in_use
from xstage_dit.testing import zoo
from xstage_dit.testing.numerics import relative_error

from provenance import OUTPUT_DIR, described, provenance

TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-3}
REPEAT_MARGIN = 1.5  # how much further from the single GPU than its own repeat a parallel result may be


def generate(pipe, name: str, size: dict, steps: int, device: torch.device) -> torch.Tensor:
    call = zoo.call_kwargs(name, **size, steps=steps, guidance=1.0)
    call.update(zoo.text_embeddings(name, 1, seed=1, device=device, dtype=pipe.transformer.dtype))
    return pipe(**call, output_type="latent", generator=torch.Generator().manual_seed(5), return_dict=False)[0]


def largest_relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ||a - b|| / ||b|| over ranks."""
    error = torch.tensor([relative_error(a, b)], device=a.device)
    if dist.is_initialized():
        dist.all_reduce(error, op=dist.ReduceOp.MAX)
    return error.item()


def check(name: str, backends: list[str], expert_modes: list[str], steps: int, dtype: torch.dtype) -> list[dict]:
    device = xstage_dit.local_device()
    entry = zoo.ZOO[name]
    size = {"height": entry.height, "width": entry.width, "num_frames": entry.num_frames}
    pipe = zoo.build_pipeline(name, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    single = generate(pipe, name, size, steps, device).float()
    repeat = largest_relative_error(generate(pipe, name, size, steps, device).float(), single)
    tolerance = max(TOLERANCE[dtype], REPEAT_MARGIN * repeat)
    records = []
    for backend, experts in itertools.product(backends, expert_modes):
        xstage_dit.enable(pipe, backend=backend, expert_parallel=EXPERT_PARALLEL[experts])
        error = largest_relative_error(generate(pipe, name, size, steps, device).float(), single)
        xstage_dit.disable(pipe)
        records.append({"config": name, **size, "steps": steps, "dtype": str(dtype).removeprefix("torch."),
                        "backend": backend, "expert_parallel": experts, "world_size": world_from_env()[0],
                        "relative_error": error, "single_gpu_repeat_error": repeat, "tolerance": tolerance,
                        "ok": error < tolerance,
                        # the process's pools so far (a pool outlives the backend that created it)
                        "symmetric_memory": symmetric_backends_in_use()})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["flux-dev", "wan-1.3b"], choices=sorted(zoo.ZOO))
    parser.add_argument("--backend", nargs="+", default=["reference", "fused"])
    parser.add_argument("--expert-parallel", nargs="+", default=["auto"], choices=EXPERT_PARALLEL,
                        help="mixture-of-experts models: each setting in turn (generate.py's --expert-parallel)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--out", type=Path, default=f"{OUTPUT_DIR}/check-parallel")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    records = [r for name in args.config
               for r in check(name, args.backend, args.expert_parallel, args.steps, dtype)]
    if xstage_dit.is_main_process():
        env = provenance()
        records = [{**r, **env} for r in records]
        prefix = args.out
        prefix.parent.mkdir(parents=True, exist_ok=True)
        prefix.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
        lines = [f"# Parallel vs single-GPU: {env['card']}, {env['date']}", "", described(env), "",
                 "| config | size | dtype | ranks | backend | expert parallel | symmetric memory (pools so far) "
                 "| max relative error over ranks | single GPU vs itself | tolerance | ok |",
                 "|---|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {r['height']}×{r['width']}×{r['num_frames']} | {r['dtype']} | "
                  f"{r['world_size']} | {r['backend']} | {r['expert_parallel']} | "
                  f"{', '.join(r['symmetric_memory']) or '-'} | {r['relative_error']:.2e} | "
                  f"{r['single_gpu_repeat_error']:.2e} | {r['tolerance']:.1e} | {r['ok']} |" for r in records]
        prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    if not all(r["ok"] for r in records):
        sys.exit(1)


if __name__ == "__main__":
    main()
