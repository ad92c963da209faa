"""One NucleusMoE-Image MoE layer at the released size (dim 2048, 64 experts of width 1344, expert choice at a
capacity factor of 4 or 2, shared expert), timed per call: diffusers' own layer on one GPU (grouped matmuls, and
its default loop over experts), and xstage_dit's exact expert choice, each rank holding S/N tokens, in each mode
(sp/expert_modes.py): every expert on every rank (replicated), or E/N per rank with the rows travelling over
collectives or stored from the kernels (X-Stage) in several schedules; beside each, the Burst-Gap planner's
prediction, and which mode and schedule it picks.

    python examples/bench_moe.py --out docs/benchmarks/moe-h200
    torchrun --nproc_per_node 2 examples/bench_moe.py --out docs/benchmarks/moe-h200x2

The xstage modes run the production code: the patch's layer wrapper (patches/nucleusmoe.py) over a
SequenceShard of the job's ranks. Per call: median of CUDA-event times over the repeats, the slowest rank's;
memory: routed-expert weights on the device and peak allocation, the largest rank's. Writes OUT.json and OUT.md
on the main rank."""
from __future__ import annotations

import argparse
import gc
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

import xstage_dit
import zoo
from provenance import provenance, write_records
from xstage_dit.patches.nucleusmoe import ExactExpertChoice
from xstage_dit.runtime import ensure_process_group
from xstage_dit.sp.expert_modes import ExpertModes
from xstage_dit.sp.fabric import open_fabric
from xstage_dit.sp.plan import PlanContext
from xstage_dit.sp.planning import planner_for
from xstage_dit.sp.sharding import SequenceShard
from xstage_dit.xstage.planner import ExpertMode, ExpertSchedule, ExpertShape

DIM, EXPERTS, EXPERT_DIM = 2048, 64, 1344
TOKENS = {"1024²": 4096, "2048²": 16384}
# the stores mode's schedules timed: one wave, and four waves plain and interleaved
SCHEDULES = {"": ExpertSchedule(), "-4-waves": ExpertSchedule(4), "-4-waves-interleaved": ExpertSchedule(4, True)}


@dataclass(frozen=True)
class Variant:
    """One timed way to run the layer: diffusers' own (`stock`: its grouped matmuls or its loop), or xstage_dit's in
    `mode`, with `schedule` for the stores mode."""

    name: str
    stock: bool = False
    mode: ExpertMode = ExpertMode.REPLICATED
    schedule: ExpertSchedule | None = None


def variants(ranks: int) -> list[Variant]:
    if ranks == 1:
        return [Variant("stock-grouped", stock=True), Variant("stock-loop", stock=True), Variant("xstage-replicated")]
    return ([Variant("xstage-replicated"), Variant("xstage-expert-parallel-collectives", mode=ExpertMode.COLLECTIVES)]
            + [Variant(f"xstage-expert-parallel-stores{suffix}", mode=ExpertMode.STORES, schedule=schedule)
               for suffix, schedule in SCHEDULES.items()])


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


def _captured(call):
    """`call` captured in a CUDA graph, after one eager call on a side stream; returns the graph's replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph.replay


def _slowest(value: float) -> float:
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], device=xstage_dit.local_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def bench(variant: Variant, size: str, capacity_factor: float, repeats: int, device: torch.device) -> dict:
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layer = _layer(capacity_factor, grouped=variant.name != "stock-loop", device=device)
    tokens = TOKENS[size]
    shard = SequenceShard(ranks, rank, dist.group.WORLD if ranks > 1 else None)
    shard.seq_len = tokens
    generator = torch.Generator(device).manual_seed(rank)
    local = tokens if variant.stock else tokens // ranks
    x = torch.randn(1, local, DIM, device=device, dtype=torch.bfloat16, generator=generator)
    unmodulated = torch.randn_like(x)
    timestep = torch.randn(1, DIM, device=device, dtype=torch.bfloat16, generator=generator)
    wrapper = predicted = picked = None
    if not variant.stock:
        if variant.mode is ExpertMode.STORES:  # the group's symmetric memory, as enable opens it
            open_fabric(dist.group.WORLD, device, 600.0)
        context = PlanContext(shard, ExpertModes((variant.mode,)))
        wrapper = ExactExpertChoice(layer, context, variant.schedule)
        predicted, picked = _prediction(variant, ExpertShape(1, tokens, DIM, EXPERT_DIM, EXPERTS, math.ceil(
            capacity_factor * tokens / EXPERTS), ranks), device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        ms = _time(lambda: layer(x, unmodulated, timestep), repeats)
        peak = torch.cuda.max_memory_allocated(device)
        # diffusers' loop reads expert sizes on the host: no graph holds it
        replay = None if variant.name == "stock-loop" else _captured(lambda: layer(x, unmodulated, timestep))
        graph_ms = None if replay is None else _time(replay, repeats)
    del replay
    gc.collect()  # no graph holding collectives outlives its variant (pytorch#115388)
    expert_bytes = sum(w.numel() * w.element_size() for w in (layer.experts.gate_up_proj, layer.experts.down_proj))
    record = {"mode": variant.name, "size": size, "tokens": tokens, "capacity_factor": capacity_factor,
              "ranks": ranks, "ms": _slowest(ms), "graph_ms": None if graph_ms is None else _slowest(graph_ms),
              "predicted_ms": predicted, "planner_picks": picked,
              "expert_weights_gib": _slowest(expert_bytes / 2**30),
              "peak_gib": _slowest(peak / 2**30), "repeats": repeats,
              **provenance()}
    if wrapper is not None:
        wrapper.remove()
    return record


def _prediction(variant: Variant, shape: ExpertShape, device: torch.device) -> tuple[float | None, str | None]:
    """The planner's predicted ms for this variant, and its pick among every mode (with its schedule)."""
    planner = planner_for(device, shape.degree)
    if planner is None or not planner.predicts_experts():
        return None, None
    if variant.mode is ExpertMode.STORES:
        seconds = planner.experts_stores(shape, variant.schedule or planner.expert_schedule(shape))
    else:
        seconds = planner.predict_experts(shape, (variant.mode,))[variant.mode]
    modes = (ExpertMode.REPLICATED,) + ((ExpertMode.COLLECTIVES, ExpertMode.STORES) if shape.degree > 1 else ())
    predicted = planner.predict_experts(shape, modes)
    best = min(predicted, key=predicted.__getitem__)
    pick = best.value + (f" ({planner.expert_schedule(shape)})" if best is ExpertMode.STORES else "")
    return seconds * 1e3, pick


def write(records: list[dict], prefix: Path) -> None:
    table = ["| size (tokens) | capacity factor | ranks | mode | eager ms per layer call | graphed ms | "
             "predicted ms | planner picks | expert weights per rank (GiB) | peak per rank (GiB) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def ms(value: float | None) -> str:
        return "" if value is None else f"{value:.3f}"

    for r in records:
        table.append(f"| {r['size']} ({r['tokens']}) | {r['capacity_factor']:g} | {r['ranks']} | {r['mode']} | "
                     f"{ms(r['ms'])} | {ms(r['graph_ms'])} | {ms(r['predicted_ms'])} | {r['planner_picks'] or ''} | "
                     f"{r['expert_weights_gib']:.2f} | {r['peak_gib']:.2f} |")
    write_records(records, prefix, "NucleusMoE-Image MoE layer", f"Medians of {records[0]['repeats']}, bf16, "
                  "batch 1; times and memory are the slowest / largest rank's. Eager: one call of the layer as "
                  "a model runs it without graphs (host launch time included); graphed: the same call captured "
                  "in a CUDA graph and replayed. Predicted: the planner's time for the routed part (the router "
                  "scores' gather, the experts and the moving of their rows; the router's and the shared expert's "
                  "projections left out).", table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default="bench-moe", help="output path prefix (.json, .md)")
    args = parser.parse_args()
    device = xstage_dit.local_device()
    if device.type != "cuda":
        raise SystemExit("bench_moe.py times GPU kernels: run it on a GPU")
    ensure_process_group(timeout_s=600)
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    records = [bench(variant, size, factor, args.repeats, device)
               for size in TOKENS for factor in (4.0, 2.0) for variant in variants(ranks)]
    if xstage_dit.is_main_process():
        write(records, Path(args.out))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
