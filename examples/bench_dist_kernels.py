"""Attention + post-attention all-to-all on N ranks, the paper's table: attention only, serial (our attention,
then the reference all-to-all: pack, NCCL all_to_all_single, unpack) and fused (the scatter epilogue storing
into the peers' symmetric buffers, then the barrier), with the Burst-Gap planner's prediction per row.

    torchrun --nproc_per_node 8 examples/bench_dist_kernels.py --out docs/benchmarks/dist-kernels-h200x8

Each rank holds its heads (H/N) of the whole sequence, as after the pre-attention all-to-all; head_dim 128, bf16.
Times are the slowest rank's mean over the timed iterations (all ranks start each variant together). Ranks that
share a GPU (a dry run) time-slice it and talk through gloo: such figures say nothing about multi-GPU speed.
Writes OUT.json, OUT.md and OUT.png on the main rank."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from xstage_dit.kernels.attention import Scatter, flash_attention
from xstage_dit.runtime import ensure_process_group
from xstage_dit.runtime.distributed import local_device, ranks_share_gpus
from xstage_dit.runtime.symmetric import SymmetricPool
from xstage_dit.sp.backends import UlyssesLayout
from xstage_dit.sp.exchange import all_to_all, finish_gather, start_gather
from xstage_dit.sp.fused import first_row
from xstage_dit.xstage import AttentionShape, Planner, find_calibration

from bench_kernels import back_to_back_ms
from provenance import provenance

# (name, text tokens, image tokens, heads): the paper's lengths, then Flux 1024² and Wan 14B 720p
SHAPES = [(f"seq-{s}", 0, s, 24) for s in (8192, 16384, 32768, 65536)] + [
    ("flux-1024", 512, 4096, 24), ("wan14b-720p", 0, 75600, 40)]


def timed(fn, group: dist.ProcessGroup, iterations: int) -> float:
    """Slowest rank's mean seconds per call, after a warm-up, every rank starting together."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    dist.barrier(group)
    seconds = torch.tensor([back_to_back_ms(fn, iterations) * 1e-3], device="cuda")
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    return seconds.item()


def bench_shape(name: str, text: int, seq: int, heads: int, group: dist.ProcessGroup, pool: SymmetricPool,
                planner: Planner | None, iterations: int) -> list[dict]:
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if heads % n:
        return []
    local, share = -(-seq // n), heads // n
    layout = UlyssesLayout(text, seq, local, n, rank)
    generator = torch.Generator(device="cuda").manual_seed(rank)
    q, k, v = (torch.randn(1, text + n * local, share, 128, device="cuda", dtype=torch.bfloat16,
                           generator=generator) for _ in range(3))
    kv_len = text + seq
    out = pool.buffer("dist-bench-out", (1, text + local, heads, 128), torch.bfloat16)
    shape = AttentionShape(1, seq, text, heads, 128, n)
    rotated = True if planner is None else planner.tile_order(shape)
    scatter = Scatter(out.offsets, text, local, True, rank * share, first_row(layout, rotated))

    def attention_only():
        flash_attention(q, k, v, kv_len=kv_len)

    def serial():
        finish_gather(start_gather(flash_attention(q, k, v, kv_len=kv_len), layout, all_to_all(group)), layout)

    def fused():
        flash_attention(q, k, v, kv_len=kv_len, out=out.tensor, scatter=scatter)
        pool.barrier("bench_dist_kernels")

    ms = {label: timed(fn, group, iterations) * 1e3
          for label, fn in (("attention_only", attention_only), ("serial", serial), ("fused", fused))}
    predicted = {}
    if planner:
        predicted = {"attention_only": planner.attention(shape, own=True),
                     "serial": planner.attention(shape, own=True) + planner.exchange(shape.tensor_bytes(), text > 0),
                     "fused": planner.fused_kernel(shape, rotated) + planner.costs.launch}
    return [{"kernel": label, "name": name, "shape": [1, text + seq, heads, 128], "n_ranks": n, "ms": value,
             "baseline": "serial", "baseline_ms": ms["serial"], "ratio": value / ms["serial"],
             "tile_order": "rotated" if rotated else "rank-major",
             **({"predicted_ms": predicted[label] * 1e3, "prediction_error": predicted[label] * 1e3 / value - 1}
                if predicted else {})}
            for label, value in ms.items()]


def write(records: list[dict], prefix: Path) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    env = records[0]
    rows = {}
    for r in records:
        rows.setdefault(r["name"], {})[r["kernel"]] = r
    lines = [f"# Attention + post-all-to-all on {env['n_ranks']} ranks: {env['card']}, {env['date']}", "",
             f"torch {env['torch']}, Triton {env['triton']}; `{env['command']}`; {env['ranks_note']}", "",
             "| shape | tokens | attention only (ms) | serial (ms) | fused (ms) | fused speedup over serial "
             "| fused / attention only | predicted ms (attn / serial / fused) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in rows.items():
        a, s, f = (row[k]["ms"] for k in ("attention_only", "serial", "fused"))
        guess = " / ".join(f"{row[k]['predicted_ms']:.3f} ({row[k]['prediction_error']:+.0%})"
                           for k in ("attention_only", "serial", "fused")) if "predicted_ms" in row["fused"] else "-"
        lines.append(f"| {name} | {row['fused']['shape'][1]} | {a:.3f} | {s:.3f} | {f:.3f} | {s / f:.3f}x | "
                     f"{f / a:.3f} | {guess} |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, prefix.with_suffix(".png"))


def plot(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(8, 4))
    for i, kernel in enumerate(("attention_only", "serial", "fused")):
        ax.bar([x + 0.27 * i for x in range(len(names))], [rows[n][kernel]["ms"] / rows[n]["serial"]["ms"]
                                                          for n in names], width=0.27, label=kernel)
    ax.set_xticks([x + 0.27 for x in range(len(names))], names, fontsize=8)
    ax.set_ylabel("time / serial")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="dist-kernels")
    parser.add_argument("--shapes", nargs="+", choices=[s[0] for s in SHAPES], default=[s[0] for s in SHAPES])
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args()
    ensure_process_group(timeout_s=600)
    device = local_device()
    group = dist.group.WORLD
    pool = SymmetricPool.for_group(group, device, timeout_s=120)
    card = torch.cuda.get_device_name(device)
    topology = "same-gpu" if ranks_share_gpus() else None
    calibration = find_calibration(card, dist.get_world_size(), topology)
    planner = Planner.from_calibration(calibration) if calibration else None
    records = [r for shape in SHAPES if shape[0] in args.shapes
               for r in bench_shape(*shape, group, pool, planner, args.iterations)]
    if dist.get_rank() == 0:
        env = {**provenance(), "calibration": calibration.filename if calibration else None,
               "ranks_note": ("ranks share one GPU (a dry run: no scaling or speed claim)" if ranks_share_gpus()
                              else "one rank per GPU")}
        write([{**r, **env} for r in records], Path(args.out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
