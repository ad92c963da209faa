"""VAE decode: the whole latent on every rank (what each GPU does without parallel_vae) against the row-split
decode across the job's ranks, side by side in alternating rounds of one run; time and peak memory per rank.

    torchrun --nproc_per_node 2 examples/bench_vae.py --vae flux wan2.1-720p --out docs/benchmarks/vae-h200x2

Random weights and latents (zoo.VAES: real-size configs; the tiny ones check the script on CPU). Time is the
slowest rank's, peak memory the largest rank's (torch.cuda.max_memory_allocated, weights included). Writes
OUT.json and OUT.md on the main rank."""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import xstage_dit
from xstage_dit.testing import zoo
from xstage_dit.testing.numerics import relative_error
from provenance import OUTPUT_DIR, provenance, write_records
from xstage_dit.patches.vaes import vae_rule_for
from xstage_dit.vae.decode import ParallelDecode

GiB = 2**30


def _decode(vae: torch.nn.Module, z: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, float, float]:
    """The decoded sample, the slowest rank's seconds and the largest rank's peak GiB."""
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        out = vae.decode(z, return_dict=False)[0]
    if gpu:
        torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) / GiB if gpu else 0.0  # no allocator statistics on the CPU
    measured = torch.tensor([time.perf_counter() - start, peak], device=device)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX)
    return out, *measured.tolist()


def bench(name: str, repeats: int, device: torch.device) -> dict:
    vae = zoo.build_vae(name, device, torch.bfloat16)
    z = zoo.vae_latent(name, device, next(vae.parameters()).dtype)
    rule = vae_rule_for(vae)
    times: dict[str, list[float]] = {"whole": [], "split": []}
    peaks: dict[str, float] = {"whole": 0.0, "split": 0.0}
    outputs: dict[str, torch.Tensor] = {}
    for round_ in range(repeats + 1):  # round 0 warms up (cuDNN's algorithm choice, the allocator)
        for variant in ("whole", "split") if round_ % 2 else ("split", "whole"):
            split = ParallelDecode(vae, rule.layers(vae), dist.group.WORLD, rule.replicated_because) \
                if variant == "split" else None
            outputs[variant], seconds, peak = _decode(vae, z, device)
            if split is not None:
                split.remove()
            if round_:
                times[variant].append(seconds)
                peaks[variant] = max(peaks[variant], peak)
            if xstage_dit.is_main_process():
                print(f"{name} round {round_} {variant}: {seconds:.3f} s, peak {peak:.2f} GiB", flush=True)
    whole, split = (statistics.median(times[v]) for v in ("whole", "split"))
    reference = outputs["whole"].float()
    error = relative_error(outputs["split"], reference)
    return {"vae": name, "class": type(vae).__name__, "latent": list(z.shape), "output": list(reference.shape),
            "dtype": str(z.dtype).removeprefix("torch."), "ranks": dist.get_world_size(), "repeats": repeats,
            "whole_s": whole, "split_s": split, "time_ratio": split / whole,
            "whole_peak_gib": peaks["whole"], "split_peak_gib": peaks["split"],
            "memory_ratio": peaks["split"] / max(peaks["whole"], 1e-9), "relative_error": error,
            "whole_s_all": times["whole"], "split_s_all": times["split"], **provenance()}


def write(records: list[dict], prefix: Path) -> None:
    table = ["| VAE | latent -> output | dtype | whole s | split s | time ratio | whole peak GiB | split peak GiB | "
             "memory ratio | split vs whole rel. error |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        table.append(f"| {r['vae']} ({r['class']}) | {tuple(r['latent'])} -> {tuple(r['output'])} | {r['dtype']} | "
                     f"{r['whole_s']:.3f} | {r['split_s']:.3f} | {r['time_ratio']:.3f} | {r['whole_peak_gib']:.2f} | "
                     f"{r['split_peak_gib']:.2f} | {r['memory_ratio']:.3f} | {r['relative_error']:.1e} |")
    write_records(records, prefix, "VAE decode",
                  "Whole: every rank decodes the whole latent (one GPU's work, as without parallel_vae); split: the "
                  f"row-split decode over all ranks. Median of {records[0]['repeats']} alternating rounds; time of "
                  "the slowest rank, peak memory of the largest rank (weights included).", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vae", nargs="+", default=["flux", "wan2.1-720p"], choices=list(zoo.VAES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=f"{OUTPUT_DIR}/bench-vae",
                        help="output path prefix (.json, .md)")
    args = parser.parse_args()
    device = xstage_dit.local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    records = [bench(name, args.repeats, device) for name in args.vae]
    if xstage_dit.is_main_process():
        write(records, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
