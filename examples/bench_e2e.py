r"""End-to-end latency of diffusers pipelines, stock versus xstage_dit, measured side by side in one run.

    python examples/bench_e2e.py --config flux-dev wan-1.3b --out docs/benchmarks/e2e-h200
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc_per_node 8 examples/bench_e2e.py --config wan-14b --out docs/benchmarks/e2e-h200x8

Pipelines are built from the released models' configs with random weights and random text embeddings of the
real shapes (no text encoders). Every variant runs the same calls on the same pipeline, interleaved
(stock, xstage, stock, xstage, ...) so that drift of the machine hits both alike. Per step: median wall time
between step-end callbacks, and the host's time to issue the step (each step starts on an idle GPU); end to end:
one pipeline call (denoising loop, and with --decode the VAE decode, which also gets a column of its own: the
time from the last step's end to the call's end; xstage variants split it across ranks, `parallel_vae`).
"stock" runs only in a one-process job: with several ranks it would just repeat the one-GPU work.

A variant is stock or xstage-BACKEND in one of the --modes: eager; compiled (the transformers'
`compile_repeated_blocks(fullgraph=True)`, as diffusers recommends); graphs (enable(cuda_graphs=True)); both.
Stock has no graphs mode. Variants are enabled anew for every call, so a graphs variant's call includes its
warm-up steps and its capture: they count in the end-to-end time, while its per-step figures are over the steps
that only replayed (`replayed_steps` in the record; every step where none did).
FP8: a backend name ending in +fp8-PARTS runs enable(fp8=PARTS) (e.g. reference+fp8-linear,
auto+fp8-attention,linear, +fp8-all: every step in FP8); --torchao-fp8 adds stock-torchao-fp8 in the stock modes:
a copy of the transformer with every Linear quantized by torchao's `quantize_` with torchao's float8 rowwise config
as users write it (fp8="linear" uses the same with a floor under each activation row's scale), as users quantize
a model.
torchao's `quantize_` would also turn on its recommended inductor settings for the whole process, which would
then apply to every variant compiled after it; neither path does here: every variant compiles with torch's
defaults. --errors adds each variant's relative L2 error against stock eager for the transformer's first forward and
for the final latents (one more call, seeded alike, after the timed ones), and with --decode the decoded output's
PSNR against stock eager's (one more call).

    python examples/bench_e2e.py --config flux-dev --modes compiled compiled+graphs \
        --backend reference reference+fp8-linear --torchao-fp8 --errors --out docs/benchmarks/fp8-linear
Writes OUT.json (appending records), OUT.md (table) and OUT.png (plot) on the main rank; with --profile also
OUT-profile.json and OUT-profile.md (GPU time per step by kernel, variants side by side; rank 0's, in
OUT-nN-profile.* for N ranks)."""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import logging
import math
import re
import statistics
from pathlib import Path

import torch

import xstage_dit
from xstage_dit import patches
from xstage_dit.logging_utils import fresh_warnings, logger
from xstage_dit.precision.linear import quantization_config
from xstage_dit.runtime import world_from_env

from xstage_dit.testing import zoo
from xstage_dit.testing.numerics import relative_error
from kernel_profile import kernel_times, write_profiles
from provenance import OUTPUT_DIR, described, provenance
from step_timer import StepTimer, reporting_steps

DIFFUSERS_ROPE = "+diffusers-rope"  # backend-name suffix: that backend with enable(fuse_rope=False)
DIFFUSERS_MLP = "+diffusers-mlp"  # backend-name suffix: that backend with enable(fuse_mlp=False)
EXPERT_PARALLEL = "+expert-parallel"  # backend-name suffix: that backend with enable(expert_parallel=True)
FP8 = re.compile(r"\+fp8-([\w,]+)")  # backend-name suffix: that backend with enable(fp8=<parts>, comma-separated)
TORCHAO_FP8 = "stock-torchao-fp8"
MODES = ["eager", "compiled", "graphs", "compiled+graphs"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["flux-dev"], choices=sorted(zoo.ZOO))
    parser.add_argument("--height", type=int, help="default: the config's native resolution")
    parser.add_argument("--width", type=int)
    parser.add_argument("--num-frames", type=int)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per timed call")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per variant (after one warm-up)")
    parser.add_argument("--guidance", type=float, default=1.0, help="CFG scale; >1 doubles transformer calls")
    parser.add_argument("--backend", nargs="+", default=["reference"],
                        help="xstage_dit backends to time; a name ending in " + DIFFUSERS_ROPE + " runs that backend "
                             "with diffusers' own RoPE code (enable(fuse_rope=False)), one ending in "
                             + DIFFUSERS_MLP + " with diffusers' feed-forward code (enable(fuse_mlp=False)), one "
                             "ending in " + EXPERT_PARALLEL + " with its experts split (enable(expert_parallel=True)), "
                             "one ending in +fp8-PARTS with enable(fp8=PARTS) (linear, attention, payloads or all)")
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=MODES,
                        help="how each variant runs (stock: eager and compiled only)")
    parser.add_argument("--diffusers-cp", action="store_true",
                        help="with several ranks on GPUs, also time diffusers' own "
                             "ContextParallelConfig(ulysses_degree=N) on its cuDNN attention backend (a fresh copy "
                             "of the pipeline, timed after the other variants)")
    parser.add_argument("--torchao-fp8", action="store_true",
                        help="also time stock diffusers with its transformer quantized by torchao's quantize_ "
                             "(float8 rowwise, every Linear), in the stock modes")
    parser.add_argument("--errors", action="store_true",
                        help="each variant's relative L2 error against stock eager (one more call per variant)")
    parser.add_argument("--decode", action="store_true", help="include the VAE decode in end-to-end time")
    parser.add_argument("--profile", action="store_true",
                        help="on a GPU, also run one call per variant under torch.profiler: GPU time by kernel per "
                             "step, in OUT-profile.json and OUT-profile.md")
    parser.add_argument("--out", type=Path, default=f"{OUTPUT_DIR}/bench-e2e",
                        help="output path prefix (.json, .md, .png)")
    return parser.parse_args()


class CountTokens:
    """Image/video tokens the transformer's blocks see: the query rows of its first routed attention module
    (image or video tokens only, in every supported family), this rank's share once enabled."""

    def __init__(self, model: torch.nn.Module) -> None:
        first_attention = patches.plan_for(model).attention_modules(model)[0]
        self.count = 0
        self._handle = first_attention.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        self.count = self.count or kwargs.get("hidden_states", args[0] if args else None).shape[1]

    def remove(self) -> None:
        self._handle.remove()


def time_call(pipe, call: dict, device: torch.device, graphs: bool = False) -> StepTimer:
    """One timed pipeline call; with `graphs` (xstage_dit enabled with CUDA graphs) the timer also tells which
    steps only replayed graphs."""
    timer = StepTimer(device, (lambda: xstage_dit.cuda_graph_use(pipe)) if graphs else None)
    with reporting_steps(pipe, timer) as step_callback:
        timer.start()
        pipe(**call, **step_callback)
        timer.finish()
    return timer


def variant_names(backends: list[str], modes: list[str], world_size: int, torchao_fp8: bool = False) -> list[str]:
    stocks = ["stock", TORCHAO_FP8] if torchao_fp8 else ["stock"]
    stock = [f"{base}{'' if mode == 'eager' else '+' + mode}" for base in stocks for mode in modes
             if "graphs" not in mode]
    xstage = [f"xstage-{b}{'' if mode == 'eager' else '+' + mode}" for b in backends for mode in modes]
    return (stock if world_size == 1 else []) + xstage


_TORCHAO_COPIES: dict[int, torch.nn.Module] = {}  # the quantized copy of a pipeline's transformer, made once


@contextlib.contextmanager
def torchao_fp8_transformer(pipe):
    """The pipeline with a copy of its transformer whose Linear layers torchao's `quantize_` quantized (all of
    them, float8 rowwise, torchao's defaults), undone on exit."""
    from torchao.quantization import quantize_

    if id(pipe) not in _TORCHAO_COPIES:
        quantized = copy.deepcopy(pipe.transformer)
        quantize_(quantized, quantization_config(floored=False))
        _TORCHAO_COPIES[id(pipe)] = quantized
    original, pipe.transformer = pipe.transformer, _TORCHAO_COPIES[id(pipe)]
    try:
        yield
    finally:
        pipe.transformer = original


@contextlib.contextmanager
def compiled_blocks(pipe):
    """The pipeline's transformers with their repeated blocks compiled (fullgraph), undone on exit."""
    models = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    for model in models:
        model.compile_repeated_blocks(fullgraph=True)
    try:
        yield
    finally:
        for model in models:
            for module in model.modules():
                module._compiled_call_impl = None


# per variant, what xstage_dit warned of while it ran (a fallback: an FP8 part that did not run, say), for its record
SAID: dict[str, set[str]] = {}


@contextlib.contextmanager
def said_while(variant: str):
    """xstage_dit's warnings meanwhile, into SAID[variant] (each said anew: a warning is said once a process)."""
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: SAID.setdefault(variant, set()).add(record.getMessage())
    logger.addHandler(handler)
    try:
        with fresh_warnings():
            yield
    finally:
        logger.removeHandler(handler)


@contextlib.contextmanager
def variant_of(pipe, variant: str):
    """The pipeline as `variant` runs it: "xstage-<backend>[+diffusers-rope][+diffusers-mlp][+expert-parallel]
    [+fp8-<parts>]" enables xstage_dit for the block, "stock-torchao-fp8" runs a torchao-quantized copy of the
    transformer, "+compiled" compiles the repeated blocks, "+graphs" captures the transformers' forwards."""
    fp8 = FP8.search(variant)
    parts = fp8.group(1).split(",") if fp8 else []
    fp8_parts = tuple(parts) if len(parts) > 1 else parts[0] if parts else None
    name = FP8.sub("", variant)
    for suffix in (DIFFUSERS_ROPE, DIFFUSERS_MLP, EXPERT_PARALLEL):
        name = name.replace(suffix, "")
    base, *modes = name.split("+")
    with contextlib.ExitStack() as stack:
        stack.enter_context(said_while(variant))
        if base == TORCHAO_FP8:
            stack.enter_context(torchao_fp8_transformer(pipe))
        if "compiled" in modes:
            stack.enter_context(compiled_blocks(pipe))
        if base.startswith("xstage-"):
            xstage_dit.enable(pipe, backend=base.removeprefix("xstage-"), fuse_rope=DIFFUSERS_ROPE not in variant,
                              fuse_mlp=DIFFUSERS_MLP not in variant,
                              cuda_graphs="graphs" in modes, expert_parallel=EXPERT_PARALLEL in variant,
                              fp8=fp8_parts)
            stack.callback(xstage_dit.disable, pipe)
        yield


def measure(pipe, variants: list[str], call: dict, device: torch.device, repeats: int) -> dict[str, dict]:
    """Per variant: step times, call totals and peak memory over `repeats` calls after one warm-up call, the
    variants interleaved."""
    samples: dict[str, dict[str, list]] = {
        v: {"steps": [], "host": [], "totals": [], "after_loop": [], "peak": [], "replayed": []} for v in variants}
    for repeat in range(repeats + 1):  # repeat 0 warms up every variant
        for variant in variants:
            with variant_of(pipe, variant):
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                timer = time_call(pipe, call, device, graphs="graphs" in variant.split("+"))
            if xstage_dit.is_main_process():  # progress, for a run cut short
                print(f"  {variant} call {repeat}: {timer.total_seconds:.2f} s, median step "
                      f"{statistics.median(timer.step_seconds) * 1e3:.1f} ms", flush=True)
            if repeat:
                # a graphs variant's steps that only replayed, where there are any (each call enables anew, so
                # its first steps warm up and capture)
                kept = timer.replayed if any(timer.replayed) else [True] * len(timer.step_seconds)
                samples[variant]["steps"] += [s for s, keep in zip(timer.step_seconds, kept) if keep]
                samples[variant]["host"] += [s for s, keep in zip(timer.host_seconds, kept) if keep]
                samples[variant]["replayed"] += timer.replayed
                samples[variant]["totals"].append(timer.total_seconds)
                samples[variant]["after_loop"].append(timer.after_loop_seconds)
                if device.type == "cuda":
                    samples[variant]["peak"].append(torch.cuda.max_memory_allocated(device) / 2**30)
    return samples


@dataclasses.dataclass(frozen=True)
class Errors:
    """A variant's distance from stock eager on the same seeded call: relative L2 of the transformer's first output
    (one forward on the same inputs) and of the final latents; with --decode, the decoded output's PSNR."""
    first_forward: float
    final_latents: float
    psnr_db: float | None


class FirstForward:
    """The first output of the pipeline's (first) transformer while installed, copied: a CUDA graph's replay
    overwrites its output buffer at the next step."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.output: torch.Tensor | None = None
        self._handle = model.register_forward_hook(self._record)

    def _record(self, module, args, output) -> None:
        if self.output is None:
            first = output[0] if isinstance(output, tuple) else output.sample
            items = first if isinstance(first, list) else [first]  # Z-Image's: one tensor per batch item
            self.output = torch.cat([item.detach().double().flatten() for item in items])

    def remove(self) -> None:
        self._handle.remove()


def psnr_db(value: torch.Tensor, reference: torch.Tensor) -> float:
    """PSNR of decoded outputs in [0, 1] (output_type "pt")."""
    mse = torch.mean((value.clamp(0, 1) - reference.clamp(0, 1)) ** 2).item()
    return float("inf") if mse == 0 else 10 * math.log10(1 / mse)


def output_errors(pipe, variants: list[str], call: dict, decode: bool) -> dict[str, Errors]:
    """Each variant's errors against stock eager: one call per variant (its enable's warm-up included, as in the
    timed calls), its noise seeded alike; with `decode` one more, decoded."""
    def seeded(output_type: str) -> dict:
        return {**call, "output_type": output_type, "generator": torch.Generator().manual_seed(1)}

    def outputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        first = FirstForward(pipe.transformer)  # inside the variant: torchao's swaps the transformer
        try:
            latents = pipe(**seeded("latent"), return_dict=False)[0].double()
        finally:
            first.remove()
        decoded = pipe(**seeded("pt"), return_dict=False)[0].double() if decode else None
        return first.output, latents, decoded

    reference = outputs()
    errors = {}
    for variant in variants:
        with variant_of(pipe, variant):
            first, latents, decoded = outputs()
        errors[variant] = Errors(relative_error(first, reference[0]), relative_error(latents, reference[1]),
                                 psnr_db(decoded, reference[2]) if decode else None)
    return errors


def profile_variants(pipe, variants: list[str], call: dict, name: str, steps: int) -> list[dict]:
    """One profiled call per variant (warm: after the timed ones): GPU time by kernel per step."""
    records = []
    for variant in variants:
        with variant_of(pipe, variant):
            kernels = kernel_times(lambda: pipe(**call), steps)
        records.append({"config": name, "variant": variant, "kernels": kernels,
                        "gpu_ms_per_step": sum(k["ms_per_step"] for k in kernels.values()), **provenance()})
    return records


def diffusers_context_parallel(name: str, world_size: int, device: torch.device, dtype: torch.dtype):
    """The pipeline under diffusers' own Ulysses context parallelism, on diffusers' cuDNN attention backend."""
    from diffusers import ContextParallelConfig

    from xstage_dit.runtime import ensure_process_group

    ensure_process_group(timeout_s=600)
    pipe = zoo.build_pipeline(name, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.set_attention_backend("_native_cudnn" if device.type == "cuda" else "native")
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size))
    return pipe


def bench_config(name: str, args: argparse.Namespace, world_size: int) -> tuple[list[dict], list[dict]]:
    """Timing records of config `name`'s variants, and their kernel profiles (with --profile on a GPU)."""
    device = xstage_dit.local_device()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    entry = zoo.ZOO[name]
    size = {"height": args.height or entry.height, "width": args.width or entry.width,
            "num_frames": args.num_frames or entry.num_frames}
    pipe = zoo.build_pipeline(name, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    call = zoo.call_kwargs(name, **size, steps=args.steps, guidance=args.guidance)
    call.update(zoo.text_embeddings(name, 1, seed=0, device=device, dtype=dtype))
    call.update(generator=torch.Generator().manual_seed(0), output_type="pil" if args.decode else "latent")

    tokens = CountTokens(pipe.transformer)
    SAID.clear()
    variants = variant_names(args.backend, args.modes, world_size, args.torchao_fp8)
    samples = measure(pipe, variants, call, device, args.repeats)
    tokens.remove()
    errors = output_errors(pipe, variants, call, args.decode) if args.errors else {}
    profiles = []
    if args.profile and device.type == "cuda":  # torch.profiler's kernel times need a GPU
        profiles = profile_variants(pipe, variants, call, name, args.steps)
    has_cp_plan = getattr(pipe.transformer, "_cp_plan", None) is not None
    _TORCHAO_COPIES.pop(id(pipe), None)
    del pipe
    if args.diffusers_cp and world_size > 1 and not has_cp_plan and xstage_dit.is_main_process():
        print(f"{name}: diffusers has no context-parallel plan (_cp_plan) for this model")
    if args.diffusers_cp and world_size > 1 and has_cp_plan and device.type == "cuda":  # its mesh needs GPUs
        # its own copy of the pipeline (context parallelism cannot be undone), built after ours is freed so that
        # peak memory stays comparable; timed after the others, not interleaved with them
        torch.cuda.empty_cache()
        cp_pipe = diffusers_context_parallel(name, world_size, device, dtype)
        try:
            samples.update(measure(cp_pipe, ["diffusers-cp"], call, device, args.repeats))
            variants.append("diffusers-cp")
        except AssertionError as error:
            # diffusers' Ulysses asserts (on every rank, before any collective) on lengths N does not divide
            if xstage_dit.is_main_process():
                print(f"{name}: diffusers-cp cannot run this shape at {world_size} ranks: {error}")
        del cp_pipe
    if device.type == "cuda":
        torch.cuda.empty_cache()

    records = []
    baseline = statistics.median(samples[variants[0]]["steps"])
    for variant in variants:
        step = statistics.median(samples[variant]["steps"])
        records.append({
            "config": name, **size, "tokens": tokens.count, "world_size": world_size, "variant": variant,
            "steps_per_call": args.steps, "guidance": args.guidance, "decode": args.decode,
            "step_ms": step * 1e3, "step_ms_all": [s * 1e3 for s in samples[variant]["steps"]],
            # graphs variants: timed steps whose transformer calls all replayed (the steps above, where any did)
            "replayed_steps": sum(samples[variant]["replayed"]) if "graphs" in variant.split("+") else None,
            "host_ms": statistics.median(samples[variant]["host"]) * 1e3,
            "e2e_s": statistics.median(samples[variant]["totals"]),
            "decode_s": statistics.median(samples[variant]["after_loop"]) if args.decode else None,
            "peak_gib": max(samples[variant]["peak"], default=None),
            "ratio_to_first_variant": step / baseline, "first_variant": variants[0],
            "rel_l2_vs_stock_eager": errors[variant].final_latents if variant in errors else None,
            "rel_l2_first_forward_vs_stock_eager": errors[variant].first_forward if variant in errors else None,
            "psnr_db_vs_stock_eager": errors[variant].psnr_db if variant in errors else None,
            "warnings": sorted(SAID.get(variant, ())),
            **provenance(),
        })
    return records, profiles


def write_outputs(records: list[dict], prefix: Path) -> None:
    json_path = prefix.with_suffix(".json")
    previous = json.loads(json_path.read_text()) if json_path.exists() else []
    json_path.write_text(json.dumps(previous + records, indent=1) + "\n")
    rows = previous + records
    env = records[0]
    lines = [
        f"# End-to-end latency: {env['card']}, {env['date']}",
        "",
        described(env) + " Random weights, real configs; medians over interleaved repeats.",
        "",
        "Scaling (several ranks): per-step speedup over stock diffusers on one GPU at the same size (its latest "
        "run), and that speedup divided by the ranks.",
        "",
        "| config | size (h×w×frames) | tokens | ranks | variant | per step (ms) | host (ms) | ratio "
        "| end to end (s) | of which decode (s) | peak (GiB) | speedup vs 1-GPU stock | efficiency "
        "| rel. L2 vs stock eager: first forward, final latents | PSNR vs stock eager (dB) | command at commit |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        host = f"{r['host_ms']:.1f}" if "host_ms" in r else "-"
        decode = f"{r['decode_s']:.2f}" if r.get("decode_s") is not None else "-"
        speedup = scaling(r, rows)
        scaled = f"{speedup:.2f}x | {speedup / r['world_size']:.0%}" if speedup else "- | -"
        replayed = f" ({r['replayed_steps']} replayed steps)" if r.get("replayed_steps") is not None else ""
        first = r.get("rel_l2_first_forward_vs_stock_eager")  # absent from older records
        error = (f"{'-' if first is None else f'{first:.2e}'}, {r['rel_l2_vs_stock_eager']:.2e}"
                 if r.get("rel_l2_vs_stock_eager") is not None else "-")
        psnr = f"{r['psnr_db_vs_stock_eager']:.1f}" if r.get("psnr_db_vs_stock_eager") is not None else "-"
        lines.append(
            f"| {r['config']} | {r['height']}×{r['width']}×{r['num_frames']} | {r['tokens']} | {r['world_size']} | "
            f"{r['variant']}{replayed} | {r['step_ms']:.1f} | {host} | "
            f"{r['ratio_to_first_variant']:.3f} (vs {r['first_variant']}) | "
            f"{r['e2e_s']:.2f} | {decode} | {peak} | {scaled} | {error} | {psnr} | "
            f"`{r['command']}` at {r.get('commit', '-')} |"
        )
    said = [f"- {r['config']}, {r['variant']}: {message}" for r in rows for message in r.get("warnings", ())]
    if said:
        lines += ["", "xstage_dit's warnings while a variant ran (a fallback runs another path than its name says):",
                  "", *said]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    plot(rows, prefix.with_suffix(".png"))


def scaling(row: dict, rows: list[dict]) -> float | None:
    """Per-step speedup of a several-rank `row` over the latest one-GPU stock run of the same config and size, if
    any (one-rank rows have their ratio to stock of the same run)."""
    if row["world_size"] == 1:
        return None
    size = ("config", "height", "width", "num_frames")
    stock = [r for r in rows if r["variant"] == "stock" and r["world_size"] == 1
             and all(r[k] == row[k] for k in size)]
    return stock[-1]["step_ms"] / row["step_ms"] if stock else None


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:  # an optional picture: the JSON and the table are written already
        print(f"matplotlib is not installed: no {path}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['config']}\n{r['variant']}\n{r['world_size']} rank(s)" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4))
    ax.bar(range(len(rows)), [r["step_ms"] for r in rows], color="tab:blue")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("per-step latency (ms)")
    ax.set_title(f"bench_e2e on {rows[-1]['card']} ({rows[-1]['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    args = parse_args()
    # the compiled variants compile the same blocks' code under other guards (stock classes, our routed ones),
    # and Dynamo counts every compiled module's entries against the one code object they share
    torch._dynamo.config.recompile_limit = 64
    device = xstage_dit.local_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    world_size, _ = world_from_env()
    records, profiles = [], []
    for name in args.config:
        timed, profiled = bench_config(name, args, world_size)
        records += timed
        profiles += profiled
    if xstage_dit.is_main_process():
        prefix = args.out
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_outputs(records, prefix)
        if profiles:  # one profile file per rank count (the timing file accumulates runs at every count)
            write_profiles(profiles, prefix if world_size == 1 else prefix.with_name(f"{prefix.name}-n{world_size}"))
        for r in records:
            print(f"{r['config']:>9} {r['variant']:>30} ranks={r['world_size']} step {r['step_ms']:8.1f} ms "
                  f"host {r['host_ms']:7.1f} ms "
                  f"ratio {r['ratio_to_first_variant']:.3f} e2e {r['e2e_s']:.2f} s peak {r['peak_gib']} GiB"
                  + (f" rel. L2 vs stock eager: first forward {r['rel_l2_first_forward_vs_stock_eager']:.3e}, "
                     f"final latents {r['rel_l2_vs_stock_eager']:.3e}" if r["rel_l2_vs_stock_eager"] is not None
                     else "")
                  + (f" PSNR {r['psnr_db_vs_stock_eager']:.1f} dB" if r["psnr_db_vs_stock_eager"] is not None else ""))


if __name__ == "__main__":
    main()
