"""`xstage-dit`: command-line tools. `info` prints what this machine offers xstage_dit; `serve` runs the
generation service (the same as `python -m xstage_dit.serve`; under torchrun, `torchrun --no-python ...
xstage-dit serve ...`); `calibrate` measures its store path and kernels for the Burst-Gap planner; `plan` prints
what the planner predicts for one attention layer: every Ulysses x ring split of its ranks with each backend that
runs it and the pick (under Ulysses alone, also what backend="auto" would run and what each backend says of its
plan: the fused kernel's tile order; `--fp8 payloads` prices the fused path's stores as FP8 payloads) and, given
`--experts`, for one expert-choice MoE layer (each mode, and the stores mode's schedule)."""
from __future__ import annotations

import argparse
import importlib.metadata
import math
import sys
from pathlib import Path
from typing import Callable

# torch, diffusers and what imports them load in the commands that use them (seconds), so that --help, --version
# and a bad argument answer at once; the planner and its calibrations are plain Python
from .burst_gap.calibration import SHIPPED, SHIPPED_GPU, Calibration, calibration_dir, find_calibration
from .burst_gap.moe_plan import SCHEDULES, ExpertMode, ExpertShape
from .burst_gap.planner import Planner, widest_ulysses
from .burst_gap.ring_plan import INTERNODE_RATE, Nodes, RingBlocks, RingTransport
from .burst_gap.ulysses_plan import AttentionShape
from .sizes import fp8_payload_bytes


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _nvshmem() -> str:
    try:
        import torch.distributed._symmetric_memory as symm_mem

        return "available" if symm_mem.is_nvshmem_available() else "not available"
    except (ImportError, RuntimeError) as error:
        return f"not available ({error})"


def info() -> str:
    import torch

    from .probing.calibrate import describe, topology_matrix
    from .sp.attention.backends import available_backends

    lines = [
        f"xstage_dit {_version('xstage_dit')}: torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"triton {_version('triton')}, diffusers {_version('diffusers')}",
        f"backends: {', '.join(available_backends())}",
    ]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        lines += [f"GPUs: {len(names)} x {', '.join(sorted(set(names)))}", f"NVSHMEM: {_nvshmem()}",
                  "links:", topology_matrix()]
    else:
        lines.append("GPUs: none (the reference and overlap backends run on CPU with gloo)")
    directory = calibration_dir()
    calibrations = sorted(directory.glob("calibration-*.json")) if directory.is_dir() else []
    lines.append(f"Burst-Gap calibrations in {directory}: " + ("" if calibrations else "none (xstage-dit calibrate)"))
    lines += [f"  {describe(Calibration.load(p))}" for p in calibrations]
    return "\n".join(lines)


def plan(calibration: Calibration, shape: AttentionShape) -> str:
    """Each registered backend's predicted time for `shape`, what auto runs, and what each backend says of its
    plan for it (the fused kernel's tile order)."""
    from .sp.attention.auto import decide
    from .sp.attention.backends import backends, costs_of

    planner = Planner.from_calibration(calibration)
    candidates = tuple(backends())
    predicted = planner.predict(shape, costs_of(candidates))
    lines = [f"{shape} with {calibration.filename}:"]
    lines += [f"  {name:>9}: {seconds * 1e3:.3f} ms predicted" for name, seconds in predicted.items()]
    notes = [b.describe_plan(planner, shape) for b in candidates if b.describe_plan is not None]
    lines.append("; ".join([f"  auto runs {decide(planner, shape, candidates).name}", *filter(None, notes)]))
    return "\n".join(lines)


def plan_split(calibration: Calibration, shape: AttentionShape, nodes: Nodes) -> str:
    """Every Ulysses x ring split of `shape`'s ranks with each backend that can run it, fastest first, the
    planner's pick, and the split `enable` runs with no degrees given."""
    from .sp.attention.backends import backends, costs_of

    planner = Planner.from_calibration(calibration)
    splits = planner.layer_splits(shape, nodes, costs_of(tuple(backends())))
    lines = [f"{shape.degree} ranks, {nodes.ranks_per_node} a node (between nodes "
             f"{nodes.internode_rate * 8 / 1e9:.0f} Gb/s a rank, assumed), U x R splits:"]
    lines += [f"  {split}" for split in splits]
    best = splits[0]
    lines.append(f"  plan: Ulysses {best.ulysses} x ring {best.ring}, backend {best.backend}, "
                 f"{best.seconds * 1e3:.3f} ms predicted")
    fused = next((split for split in splits if split.transport is RingTransport.FUSED), None)
    if fused is not None:  # how the fastest X-Stage ring's blocks drain under its attention
        train = planner.rings.forward(RingBlocks.of(shape, fused.ring, fused.ulysses))
        lines.append(f"  fused ring's forward (Ulysses {fused.ulysses} x ring {fused.ring}): {train}")
    ulysses = widest_ulysses(shape.degree, [shape.heads], nodes.ranks_per_node)
    lines.append(f"  enable() with no degrees runs Ulysses {ulysses} x ring {shape.degree // ulysses} (Ulysses as "
                 f"wide as divides the heads within a node)")
    return "\n".join(lines)


def plan_experts(calibration: Calibration, shape: ExpertShape) -> str:
    """Each MoE mode's predicted time for `shape`, each schedule of the stores mode, and the planner's pick."""
    planner = Planner.from_calibration(calibration)
    if not planner.experts.calibrated():
        return f"{calibration.filename} has no expert-kernel rates: run `xstage-dit calibrate --kernels-only` on it"
    modes = tuple(ExpertMode) if shape.degree > 1 else (ExpertMode.REPLICATED,)
    predicted = planner.experts.predict(shape, modes)
    lines = [f"{shape}:"]
    lines += [f"  {mode.value:>28}: {seconds * 1e3:.3f} ms predicted" for mode, seconds in predicted.items()]
    if shape.degree > 1:
        lines += [f"  {'stores, ' + str(s):>28}: {planner.experts.stores(shape, s) * 1e3:.3f} ms predicted"
                  for s in SCHEDULES]
        lines.append(f"  the stores mode's schedule: {planner.experts.schedule(shape)}")
    lines.append(f"  expert_parallel=None runs {min(predicted, key=predicted.__getitem__).value}")
    return "\n".join(lines)


def _number(kind: type, accepts: Callable[[float], bool], what: str) -> Callable[[str], int | float]:
    """An argparse type: `kind` parsed from the text, refused in one line unless `accepts` it."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value
    return parse


positive_int = _number(int, lambda value: value >= 1, "a whole number >= 1")
non_negative_int = _number(int, lambda value: value >= 0, "a whole number >= 0")
positive_float = _number(float, lambda value: 0 < value < math.inf, "a finite number > 0")  # NaN compares false


def _load(path: Path, parser: argparse.ArgumentParser, option: str) -> Calibration:
    """The calibration in `path`, or a usage error naming the file and what is wrong with it."""
    try:
        return Calibration.load(path)
    except OSError as error:
        parser.error(f"argument {option}: cannot read {path}: {error.strerror or error}")
    except ValueError as error:
        parser.error(f"argument {option}: {error}")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # its own parser (python -m xstage_dit.serve --help)
        from .serve.__main__ import exit_now
        from .serve.__main__ import main as serve

        exit_now(serve(argv[1:], prog="xstage-dit serve"))
    parser = argparse.ArgumentParser(prog="xstage-dit", description=__doc__)
    parser.add_argument("--version", action="version", version=f"xstage-dit {_version('xstage_dit')}")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("info", help="GPUs, links, NVSHMEM, backends and calibrations found")
    commands.add_parser("serve", help="the generation service over HTTP (xstage-dit serve --help)")
    run = commands.add_parser("calibrate", help="measure the store path and kernels, fit the Burst-Gap model")
    run.add_argument("--out", type=Path, default=None, help="directory for the JSON (default: the calibration "
                     "directory the planner reads, $XSTAGE_CALIBRATION_DIR or ~/.cache/xstage_dit)")
    run.add_argument("--quick", action="store_true", help="a small sweep (a smoke test, not a calibration)")
    run.add_argument("--kernels-only", type=Path, nargs="+", metavar="CALIBRATION",
                     help="after a kernel change: measure only the kernel costs again, into these calibrations "
                          "of this GPU (their Burst-Gap fit is kept), written to --out")
    layer = commands.add_parser("plan", help="predicted time per backend for one attention layer")
    layer.add_argument("--tokens", type=positive_int, required=True, help="image/video tokens of the whole sequence")
    layer.add_argument("--text", type=non_negative_int, default=0, help="joint text tokens (replicated)")
    layer.add_argument("--heads", type=positive_int, required=True)
    layer.add_argument("--head-dim", type=positive_int, default=128)
    layer.add_argument("--ranks", type=positive_int, required=True,
                       help="ranks that split one sequence (Ulysses x ring)")
    layer.add_argument("--ulysses", type=positive_int, help="plan only this Ulysses degree (default: every one that "
                       "splits the heads within a node)")
    layer.add_argument("--ranks-per-node", type=positive_int, help="consecutive ranks that share a node (default: "
                       "--ranks, at most 8)")
    layer.add_argument("--internode-gbps", type=positive_float, default=INTERNODE_RATE * 8 / 1e9,
                       help="what one rank sends to another node, Gb/s (an assumption: no calibration measures it)")
    layer.add_argument("--batch", type=positive_int, default=1)
    layer.add_argument("--fp8", nargs="+", choices=["payloads"], default=[],
                       help="what runs in FP8, as enable's fp8 knob: \"payloads\" (the fused path's stores send e4m3 "
                            "rows and their scales: about half the bytes)")
    layer.add_argument("--experts", type=positive_int,
                       help="also plan an expert-choice MoE layer of this many experts")
    layer.add_argument("--dim", type=positive_int, default=2048, help="the MoE layer's model width")
    layer.add_argument("--expert-width", type=positive_int, default=1344, help="each expert's hidden width")
    layer.add_argument("--capacity-factor", type=positive_float, default=4.0)
    layer.add_argument("--calibration", type=Path, help="a calibration JSON (default: the best match for this "
                       "machine's GPU and --ranks in the calibration directory)")
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse would name them with the top-level usage; the subcommand's says what it takes
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command == "info":
        print(info())
    elif args.command == "calibrate":
        for path in args.kernels_only or ():
            _load(path, run, "--kernels-only")
        import torch

        if not torch.cuda.is_available():  # one line, not a traceback
            raise SystemExit("xstage-dit calibrate: needs a CUDA GPU (it times stores issued by GPU kernels)")
        from .probing.calibrate import calibrate, remeasure_kernel_costs

        if args.kernels_only:
            remeasure_kernel_costs(args.kernels_only, args.out or calibration_dir())
        else:
            calibrate(args.out or calibration_dir(), quick=args.quick)
    elif args.command == "plan":
        ulysses = args.ulysses
        if ulysses is not None and (args.ranks % ulysses or args.heads % ulysses):
            layer.error(f"argument --ulysses: {ulysses} must divide --ranks {args.ranks} and --heads {args.heads}")
        nodes = Nodes(args.ranks_per_node or min(args.ranks, 8), args.internode_gbps * 1e9 / 8)
        if ulysses is not None and ulysses > nodes.ranks_per_node:
            layer.error(f"argument --ulysses: {ulysses} is wider than a node of {nodes.ranks_per_node} ranks (the "
                        f"planner keeps Ulysses within a node)")
        if args.calibration:
            calibration = _load(args.calibration, layer, "--calibration")
        else:
            calibration = _this_machine(args.ranks)
        shape = AttentionShape(args.batch, args.tokens, args.text, args.heads, args.head_dim, args.ranks,
                               payload_bytes=fp8_payload_bytes(args.head_dim) if "payloads" in args.fp8 else None)
        if args.ranks > calibration.world_size:
            print(f"note: {calibration.filename} measured {calibration.world_size} rank(s); the predictions for "
                  f"{args.ranks} extrapolate its store path to more peers")
        if args.heads % args.ranks == 0 and args.ranks <= nodes.ranks_per_node and ulysses in (None, args.ranks):
            print(plan(calibration, shape))
        print(plan_split(calibration, shape, nodes) if ulysses is None else
              _one_split(calibration, shape, nodes, ulysses))
        if args.experts:
            capacity = max(1, math.ceil(args.capacity_factor * args.tokens / args.experts))
            shape = ExpertShape(args.batch, args.tokens, args.dim, args.expert_width, args.experts, capacity,
                                args.ranks)
            print(plan_experts(calibration, shape) if args.experts % args.ranks == 0 else
                  f"{args.experts} experts do not split over {args.ranks} ranks: MoE layers run replicated")


def _one_split(calibration: Calibration, shape: AttentionShape, nodes: Nodes, ulysses: int) -> str:
    """The splits of `plan_split` with this Ulysses degree."""
    from .sp.attention.backends import backends, costs_of

    planner = Planner.from_calibration(calibration)
    splits = [s for s in planner.layer_splits(shape, nodes, costs_of(tuple(backends()))) if s.ulysses == ulysses]
    return "\n".join([f"Ulysses {ulysses} x ring {shape.degree // ulysses}:", *(f"  {s}" for s in splits)])


def _this_machine(ranks: int) -> Calibration:
    """This GPU's best calibration for `ranks`; without a GPU, the shipped H200 one (said in a note)."""
    import torch

    if not torch.cuda.is_available():
        shipped = find_calibration(SHIPPED_GPU, ranks, directory=SHIPPED)
        print(f"note: no GPU here: planning for an {SHIPPED_GPU} with the shipped {shipped.filename} (--calibration "
              f"FILE for another)")
        return shipped
    found = find_calibration(torch.cuda.get_device_name(), ranks)
    if found is None:
        raise SystemExit(f"xstage-dit plan: no calibration for {torch.cuda.get_device_name()} in "
                         f"{calibration_dir()} (run `xstage-dit calibrate`)")
    return found


if __name__ == "__main__":
    main()
