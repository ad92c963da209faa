"""One NucleusMoE-Image MoE layer at the released size (dim 2048, 64 experts of width 1344, expert choice at a
capacity factor of 4 or 2, shared expert), timed per call: diffusers' own layer on one GPU (grouped matmuls, and
its default loop over experts), and xstage_dit's exact expert choice with every expert on every rank
(replicated) or E/N per rank (`expert_parallel=True`), each rank holding S/N tokens.

    python examples/bench_moe.py --out docs/benchmarks/moe-h200
    torchrun --nproc_per_node 2 examples/bench_moe.py --out docs/benchmarks/moe-h200x2

The xstage modes run the production code: the patch's layer wrapper (patches/nucleusmoe.py) over a
SequenceShard of the job's ranks. Per call: median of CUDA-event times over the repeats, the slowest rank's;
memory: routed-expert weights on the device and peak allocation, the largest rank's. Writes OUT.json and OUT.md
on the main rank."""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

import xstage_dit
import zoo
from provenance import provenance, write_records
from xstage_dit.patches.nucleusmoe import ExactExpertChoice
from xstage_dit.runtime import ensure_process_group
from xstage_dit.sp.plan import PlanContext
from xstage_dit.sp.sharding import SequenceShard

DIM, EXPERTS, EXPERT_DIM = 2048, 64, 1344
TOKENS = {"1024²": 4096, "2048²": 16384}


def _layer(capacity_factor: float, grouped: bool, device: torch.device) -> NucleusMoELayer:
    torch.manual_seed(0)
    with torch.device(device):
        layer = NucleusMoELayer(DIM, EXPERT_DIM, EXPERTS, capacity_factor, use_sigmoid=False, route_scale=2.5,
                                use_grouped_mm=grouped).to(torch.bfloat16).eval()
    zoo.draw_packed_experts(layer)
    return layer


def _time(call, repeats: int) -> float:
    """Median milliseconds of `call` on the GPU, after one warm-up call."""
    times = []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def _slowest(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], device=xstage_dit.local_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench(mode: str, size: str, capacity_factor: float, repeats: int, device: torch.device) -> dict:
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layer = _layer(capacity_factor, grouped=mode != "stock-loop", device=device)
    tokens = TOKENS[size]
    shard = SequenceShard(ranks, rank, dist.group.WORLD if ranks > 1 else None)
    shard.seq_len = tokens
    generator = torch.Generator(device).manual_seed(rank)
    local = tokens // ranks if mode.startswith("xstage") else tokens
    x = torch.randn(1, local, DIM, device=device, dtype=torch.bfloat16, generator=generator)
    unmodulated = torch.randn_like(x)
    timestep = torch.randn(1, DIM, device=device, dtype=torch.bfloat16, generator=generator)
    wrapper = None
    if mode.startswith("xstage"):
        wrapper = ExactExpertChoice(layer, PlanContext(shard, expert_parallel=mode == "xstage-expert-parallel"))
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        ms = _time(lambda: layer(x, unmodulated, timestep), repeats)
    expert_bytes = sum(w.numel() * w.element_size() for w in (layer.experts.gate_up_proj, layer.experts.down_proj))
    record = {"mode": mode, "size": size, "tokens": tokens, "capacity_factor": capacity_factor, "ranks": ranks,
              "ms": _slowest(ms), "expert_weights_gib": _slowest(expert_bytes / 2**30),
              "peak_gib": _slowest(torch.cuda.max_memory_allocated(device) / 2**30), "repeats": repeats,
              **provenance()}
    if wrapper is not None:
        wrapper.remove()
    return record


def write(records: list[dict], prefix: Path) -> None:
    table = ["| size (tokens) | capacity factor | ranks | mode | ms per layer call | expert weights per rank (GiB) "
             "| peak per rank (GiB) |", "|---|---|---|---|---|---|---|"]
    for r in records:
        table.append(f"| {r['size']} ({r['tokens']}) | {r['capacity_factor']:g} | {r['ranks']} | {r['mode']} | "
                     f"{r['ms']:.2f} | {r['expert_weights_gib']:.2f} | {r['peak_gib']:.2f} |")
    write_records(records, prefix, "NucleusMoE-Image MoE layer", f"Medians of {records[0]['repeats']}, bf16, "
                  "batch 1; times and memory are the slowest / largest rank's.", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench-moe", help="output path prefix (.json, .md)")
    args = parser.parse_args()
    device = xstage_dit.local_device()
    if device.type != "cuda":
        raise SystemExit("bench_moe.py times GPU kernels: run it on a GPU")
    ensure_process_group(timeout_s=600)
    several = dist.is_initialized() and dist.get_world_size() > 1
    modes = ["xstage-replicated", "xstage-expert-parallel"] if several else ["stock-grouped", "stock-loop",
                                                                              "xstage-replicated"]
    records = [bench(mode, size, factor, args.repeats, device)
               for size in TOKENS for factor in (4.0, 2.0) for mode in modes]
    if xstage_dit.is_main_process():
        write(records, Path(args.out))


if __name__ == "__main__":
    main()
