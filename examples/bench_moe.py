"""One NucleusMoE-Image MoE layer at the released size (dim 2048, 64 experts of width 1344, expert choice at a
capacity factor of 4 or 2, shared expert), timed per call: diffusers' own layer on one GPU (grouped matmuls, and
its default loop over experts), and xstage_dit's exact expert choice, each rank holding S/N tokens, in each mode
(sp/moe/modes.py): every expert on every rank (replicated), or E/N per rank with the rows travelling over
collectives or stored from the kernels (X-Stage) in several schedules; beside each, the Burst-Gap planner's
prediction, and which mode and schedule it picks.

    python examples/bench_moe.py --out docs/benchmarks/moe-h200
    torchrun --nproc_per_node 2 examples/bench_moe.py --out docs/benchmarks/moe-h200x2

The xstage modes run the production code: the patch's layer wrapper (patches/image/nucleusmoe.py) over a
SequenceShard of the job's ranks. Per call: median of CUDA-event times over the repeats, the slowest rank's;
memory: routed-expert weights on the device and peak allocation, the largest rank's. Writes OUT.json and OUT.md
on the main rank."""
from __future__ import annotations

import argparse
import gc
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoELayer

import xstage_dit
from xstage_dit.testing import zoo
from provenance import OUTPUT_DIR, provenance, write_records
from xstage_dit.patches.image.nucleusmoe import ExactExpertChoice
from xstage_dit.runtime import ensure_process_group
from xstage_dit.sp.moe.choice import capacity_of
from xstage_dit.sp.moe.modes import ExpertModes
from xstage_dit.sp.fabric import open_fabric
from xstage_dit.sp.plan import PlanContext
from xstage_dit.sp.planner import planner_for
from xstage_dit.sp.sharding import SequenceShard
from xstage_dit.burst_gap.moe_plan import ExpertMode, ExpertSchedule, ExpertShape

DIM, EXPERTS, EXPERT_DIM = 2048, 64, 1344
TOKENS = {"1024²": 4096, "2048²": 16384}
# the stores mode's schedules timed: one wave, and four waves plain and interleaved
SCHEDULES = {"": ExpertSchedule(), "-4-waves": ExpertSchedule(4), "-4-waves-interleaved": ExpertSchedule(4, True)}
REPLAYS_PER_SAMPLE = 10  # a replay lasts well under a millisecond: a sample times several back to back


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


@dataclass
class Prepared:
    """A variant's layer with its inputs, ready to call eagerly and (but diffusers' loop) as a graph replay."""

    variant: Variant
    layer: NucleusMoELayer
    call: Callable[[], torch.Tensor]
    replay: Callable[[], None] | None
    wrapper: ExactExpertChoice | None
    predicted_ms: float | None
    picked: str | None
    peak_bytes: int


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


def prepare(variant: Variant, size: str, capacity_factor: float, device: torch.device) -> Prepared:
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    before = torch.cuda.memory_allocated(device)
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
        predicted, picked = _prediction(variant, ExpertShape(1, tokens, DIM, EXPERT_DIM, EXPERTS, capacity_of(
            capacity_factor, tokens, EXPERTS), ranks), device)

    def call() -> torch.Tensor:
        with torch.no_grad():
            return layer(x, unmodulated, timestep)

    torch.cuda.reset_peak_memory_stats(device)  # after the layer's float32 construction
    call()
    peak = torch.cuda.max_memory_allocated(device) - before
    # diffusers' loop reads expert sizes on the host: no graph holds it
    replay = None if variant.name == "stock-loop" else _captured(call)
    return Prepared(variant, layer, call, replay, wrapper, predicted, picked, peak)


def _interleaved(calls: list[Callable[[], object]], repeats: int, inner: int) -> list[float]:
    """Median milliseconds per call of each of `calls`, sampled in turn (a clock or neighbour drifting over the run
    weighs on every variant alike), each sample `inner` calls back to back."""
    samples: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for timed, call in zip(samples, calls):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                call()
            end.record()
            torch.cuda.synchronize()
            timed.append(start.elapsed_time(end) / inner)
    return [statistics.median(timed) for timed in samples]


def bench(size: str, capacity_factor: float, repeats: int, device: torch.device) -> list[dict]:
    """Every variant of this layer shape, set up side by side and timed in turn, eagerly and replayed."""
    ranks = dist.get_world_size() if dist.is_initialized() else 1
    prepared = [prepare(v, size, capacity_factor, device) for v in variants(ranks)]
    eager = _interleaved([p.call for p in prepared], repeats, inner=1)
    graphed = [p for p in prepared if p.replay is not None]
    graph_ms = dict(zip((p.variant.name for p in graphed),
                        _interleaved([p.replay for p in graphed], repeats, inner=REPLAYS_PER_SAMPLE)))
    records = []
    for p, ms in zip(prepared, eager):
        experts = p.layer.experts
        expert_bytes = sum(w.numel() * w.element_size() for w in (experts.gate_up_proj, experts.down_proj))
        graphed_ms = graph_ms.get(p.variant.name)
        records.append({"mode": p.variant.name, "size": size, "tokens": TOKENS[size],
                        "capacity_factor": capacity_factor, "ranks": ranks, "ms": _slowest(ms),
                        "graph_ms": None if graphed_ms is None else _slowest(graphed_ms),
                        "predicted_ms": p.predicted_ms, "planner_picks": p.picked,
                        "expert_weights_gib": _slowest(expert_bytes / 2**30),
                        "peak_gib": _slowest(p.peak_bytes / 2**30), "repeats": repeats,
                        "replays_per_sample": REPLAYS_PER_SAMPLE, **provenance()})
    for p in prepared:
        if p.wrapper is not None:
            p.wrapper.remove()
    del prepared, graphed
    gc.collect()  # no graph holding collectives outlives its shape (pytorch#115388)
    return records


def _prediction(variant: Variant, shape: ExpertShape, device: torch.device) -> tuple[float | None, str | None]:
    """The planner's predicted ms for this variant, and its pick among every mode (with its schedule): the timed
    variant's name where one runs it, else the mode and schedule."""
    planner = planner_for(device, shape.degree)
    if planner is None or not planner.experts.calibrated():
        return None, None
    if variant.mode is ExpertMode.STORES:
        seconds = planner.experts.stores(shape, variant.schedule or planner.experts.schedule(shape))
    else:
        seconds = planner.experts.predict(shape, (variant.mode,))[variant.mode]
    modes = (ExpertMode.REPLICATED,) + ((ExpertMode.COLLECTIVES, ExpertMode.STORES) if shape.degree > 1 else ())
    predicted = planner.experts.predict(shape, modes)
    best = min(predicted, key=predicted.__getitem__)
    if best is not ExpertMode.STORES:
        return seconds * 1e3, f"xstage-{best.value}"
    schedule = planner.experts.schedule(shape)
    timed = [suffix for suffix, timed_schedule in SCHEDULES.items() if timed_schedule == schedule]
    return seconds * 1e3, f"xstage-{best.value}{timed[0]}" if timed else f"{best.value} ({schedule})"


def _ratios(records: list[dict]) -> list[str]:
    """Per layer shape, from the graphed times: the X-Stage stores against the collectives, the interleaved
    schedule against the plain one, the planner's pick against the fastest, expert parallel against replicated."""
    lines = ["| size | capacity factor | collectives / stores (1 wave) | 4 waves: plain / interleaved | "
             "replicated / stores (1 wave) | stores / replicated expert weights | fastest | planner's pick over the "
             "fastest |", "|---|---|---|---|---|---|---|---|"]
    shapes = dict.fromkeys((r["size"], r["capacity_factor"]) for r in records)
    for size, factor in shapes:
        rows = {r["mode"]: r for r in records if (r["size"], r["capacity_factor"]) == (size, factor)}
        ms = {mode: r["graph_ms"] for mode, r in rows.items()}
        stores, replicated = rows["xstage-expert-parallel-stores"], rows["xstage-replicated"]
        fastest = min(ms, key=ms.__getitem__)
        pick = stores["planner_picks"]
        over = f"{pick}: {ms[pick] / ms[fastest] - 1:+.1%}" if pick in ms else f"{pick}: not timed"
        waves = "xstage-expert-parallel-stores-4-waves"
        lines.append(
            f"| {size} | {factor:g} | {ms['xstage-expert-parallel-collectives'] / stores['graph_ms']:.2f}x | "
            f"{ms[waves] / ms[waves + '-interleaved']:.3f} | {replicated['graph_ms'] / stores['graph_ms']:.2f}x | "
            f"{stores['expert_weights_gib'] / replicated['expert_weights_gib']:.2f} | "
            f"{fastest} ({ms[fastest]:.3f} ms) | {over} |")
    return lines


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
    first = records[0]
    write_records(records, prefix, "NucleusMoE-Image MoE layer", (
        f"Every variant of a layer shape is set up side by side and sampled in turn; medians of {first['repeats']} "
        f"samples (an eager sample is one call, a graphed one {first['replays_per_sample']} replays back to back), "
        "bf16, batch 1; times and memory are the slowest / largest rank's. Eager: one call of the layer as a model "
        "runs it without graphs (host launch time included); graphed: the same call captured in a CUDA graph and "
        "replayed. Predicted: the planner's time for the routed part (the router scores' gather, the experts and "
        "the moving of their rows; the router's and the shared expert's projections left out). In the ratios "
        "(graphed times) a time ratio above 1 means the second named is faster."),
        table + ([] if records[0]["ranks"] == 1 else ["", *_ratios(records)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=f"{OUTPUT_DIR}/bench-moe",
                        help="output path prefix (.json, .md)")
    args = parser.parse_args()
    device = xstage_dit.local_device()
    if device.type != "cuda":
        raise SystemExit("bench_moe.py times GPU kernels: run it on a GPU")
    ensure_process_group(timeout_s=600)
    records = [r for size in TOKENS for factor in (4.0, 2.0) for r in bench(size, factor, args.repeats, device)]
    if xstage_dit.is_main_process():
        write(records, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
