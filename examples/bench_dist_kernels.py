r"""Ulysses attention calls on N ranks, each backend side by side: our attention kernel alone over a rank's
gathered heads, and one whole call (both all-to-alls included) of every registered backend through its own
function (reference: NCCL all_to_all_single around cuDNN; overlap: the same, head-chunked; fused: the store
kernels, the attention kernel's scatter epilogue and the barriers over the group's symmetric memory, in the
planner's tile order), plus the fused call in the other tile order. Each row has the Burst-Gap planner's
prediction where a calibration exists.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        torchrun --nproc_per_node 8 examples/bench_dist_kernels.py --out docs/benchmarks/dist-kernels-h200x8

head_dim 128, bf16. Times are the slowest rank's mean over the timed iterations (all ranks start each variant
together). Ranks that share a GPU (a dry run) time-slice it and talk through gloo: such figures say nothing about
multi-GPU speed. Writes OUT.json, OUT.md and OUT.png on the main rank."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from xstage_dit.kernels.attention import flash_attention
from xstage_dit.kernels.rotary_args import JointTokens
from xstage_dit.runtime import ensure_process_group
from xstage_dit.runtime.distributed import local_device, ranks_share_gpus
from xstage_dit.sp.attention.backends import backends
from xstage_dit.sp.fabric import SymmetricFabric, open_fabric
from xstage_dit.sp.attention.fused import fused_exchange, tile_order
from xstage_dit.sp.attention.layout import UlyssesLayout
from xstage_dit.burst_gap import AttentionShape, Planner, find_calibration
from xstage_dit.burst_gap.ulysses_plan import TileOrder

from bench_kernels import back_to_back_ms
from provenance import OUTPUT_DIR, described, provenance

# (name, text tokens, image tokens, heads): the paper's lengths, then Flux 1024² and Wan 14B 720p
SHAPES = [(f"seq-{s}", 0, s, 24) for s in (8192, 16384, 32768, 65536)] + [
    ("flux-1024", 512, 4096, 24), ("wan14b-720p", 0, 75600, 40)]
BASELINE = "reference"


def timed(fn, group: dist.ProcessGroup, iterations: int) -> float:
    """Slowest rank's mean seconds per call, after a warm-up, every rank starting together."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group)
    seconds = torch.tensor([back_to_back_ms(fn, iterations) * 1e-3], device="cuda")
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return seconds.item()


def bench_shape(name: str, text: int, seq: int, heads: int, group: dist.ProcessGroup, fabric: SymmetricFabric,
                planner: Planner | None, iterations: int) -> list[dict]:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if heads % n:
        return []
    local = -(-seq // n)
    layout = UlyssesLayout(text, seq, local, n, rank)
    generator = torch.Generator(device="cuda").manual_seed(rank)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    q, k, v = (randn(1, text + local, heads, 128) for _ in range(3))
    gathered = [randn(1, layout.gathered_len, heads // n, 128) for _ in range(3)]
    shape = AttentionShape(1, seq, text, heads, 128, n)
    planned = tile_order(planner, shape)
    other = TileOrder.RANK_MAJOR if planned is TileOrder.ROTATED else TileOrder.ROTATED
    variants = {"attention_only": lambda: flash_attention(*gathered, kv_len=layout.key_len)}
    for backend in backends():
        variants[backend.name] = lambda b=backend: b.ulysses(q, k, v, layout, group, None, None)
    joint = [JointTokens((t,)) for t in (q, k, v)]
    variants[f"fused ({other.value})"] = lambda: fused_exchange(*joint, layout, fabric, None, None, other)
    ms = {label: timed(fn, group, iterations) * 1e3 for label, fn in variants.items()}
    predicted = {}
    if planner:
        predicted = {"attention_only": planner.ulysses.attention(shape, own=True),
                     **{b.name: b.cost(planner.ulysses, shape) for b in backends()}}
    return [{"kernel": label, "name": name, "shape": [1, text + seq, heads, 128], "n_ranks": n, "ms": value,
             "baseline": BASELINE, "baseline_ms": ms[BASELINE], "ratio": value / ms[BASELINE],
             "tile_order": other.value if label.startswith("fused (") else planned.value,
             **({"predicted_ms": predicted[label] * 1e3, "prediction_error": predicted[label] * 1e3 / value - 1}
                if label in predicted else {})}
            for label, value in ms.items()]


def write(records: list[dict], prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    env = records[0]
    rows: dict[str, dict[str, dict]] = {}
    for r in records:
        rows.setdefault(r["name"], {})[r["kernel"]] = r
    labels = list(next(iter(rows.values())))
    lines = [f"# Ulysses attention calls on {env['n_ranks']} ranks: {env['card']}, {env['date']}", "",
             described(env) + f" {env['ranks_note']}. "
             f"ms per call (slowest rank), in brackets the time / {BASELINE}'s and the planner's error.", "",
             "| shape | tokens | fused tile order | " + " | ".join(labels) + " |",
             "|---|---|---|" + "---|" * len(labels)]
    for name, row in rows.items():
        cells = []
        for label in labels:
            r = row[label]
            guess = f", {r['prediction_error']:+.0%}" if "prediction_error" in r else ""
            cells.append(f"{r['ms']:.3f} ({r['ratio']:.3f}{guess})")
        lines.append(f"| {name} | {row[BASELINE]['shape'][1]} | {row['fused']['tile_order']} | "
                     + " | ".join(cells) + " |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, labels, prefix.with_suffix(".png"))


def plot(rows: dict, labels: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    width = 0.8 / len(labels)
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, label in enumerate(labels):
        ax.bar([x + width * i for x in range(len(names))], [rows[n][label]["ratio"] for n in names], width=width,
               label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names, fontsize=8)
    ax.set_ylabel(f"time / {BASELINE}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=f"{OUTPUT_DIR}/dist-kernels")
    parser.add_argument("--shapes", nargs="+", choices=[s[0] for s in SHAPES], default=[s[0] for s in SHAPES])
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    ensure_process_group(timeout_s=600)
    device = local_device()
    group = dist.group.WORLD
    fabric = open_fabric(group, device, timeout_s=120)
    card = torch.cuda.get_device_name(device)
    topology = "same-gpu" if ranks_share_gpus() else None
    calibration = find_calibration(card, dist.get_world_size(), topology)
    planner = Planner.from_calibration(calibration) if calibration else None
    records = [r for shape in SHAPES if shape[0] in args.shapes
               for r in bench_shape(*shape, group, fabric, planner, args.iterations)]
    if dist.get_rank() == 0:
        env = {**provenance(), "calibration": calibration.filename if calibration else None,
               "ranks_note": ("ranks share one GPU (a dry run: no scaling or speed claim)" if ranks_share_gpus()
                              else "one rank per GPU")}
        write([{**r, **env} for r in records], args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
