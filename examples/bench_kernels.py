"""Kernel benchmarks on one GPU, each variant timed side by side with its baseline in the same run.

    python examples/bench_kernels.py --out docs/benchmarks/kernels-h200

- own attention kernel vs cuDNN SDPA and FlashAttention-2 SDPA (bf16, the shapes of docs/benchmarks);
- fused post-all-to-all in loopback (N ranks simulated on this GPU: the scatter epilogue stores into N local
  buffers) vs the same kernel storing locally;
- the pre-all-to-all store kernel in loopback vs a device-to-device copy of the same bytes.
Loopback stores stay in this GPU's memory: these figures show what the epilogue costs, not NVLink drain, and
say nothing about scaling. Medians of triton.testing.do_bench. Writes OUT.json (a list of records) and OUT.md."""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from xstage_dit.kernels.all_to_all import scatter_heads
from xstage_dit.kernels.attention import TileConfig, flash_attention
from xstage_dit.kernels.loopback import LoopbackUlysses

ATTENTION_SHAPES = [  # (B, H, S, D)
    (1, 24, 4608, 128), (1, 24, 16896, 128), (1, 40, 75600, 128), (1, 5, 75600, 128), (1, 3, 119056, 128),
    (1, 24, 4608, 64), (1, 48, 16896, 64),
]
FUSED_SEQ = [8192, 16384, 32768, 65536]


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def attention_flops(b: int, h: int, s_q: int, s_k: int, d: int) -> float:
    return 4.0 * b * h * s_q * s_k * d


def sdpa(q, k, v, backend):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def bench_attention(config: TileConfig | None) -> list[dict]:
    records = []
    for b, h, s, d in ATTENTION_SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ours = median_ms(lambda: flash_attention(q, k, v, config=config))
        flops = attention_flops(b, h, s, s, d)
        for name, backend in (("cudnn_sdpa", SDPBackend.CUDNN_ATTENTION), ("fa2_sdpa", SDPBackend.FLASH_ATTENTION)):
            base = median_ms(lambda: sdpa(q, k, v, backend))
            records.append({"kernel": "xstage_attention", "shape": [b, s, h, d], "ms": ours, "baseline": name,
                            "baseline_ms": base, "ratio": ours / base, "tflops": flops / ours / 1e9,
                            "baseline_tflops": flops / base / 1e9})
    return records


def tune_attention(shape=(1, 24, 16896, 128)) -> tuple[TileConfig, list[dict]]:
    b, h, s, d = shape
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    results = []
    candidates = [TileConfig(128, block_n, 8, 3) for block_n in (64, 128)] + [
        TileConfig(128, block_n, warps, stages, tma=True, warp_specialize=ws)
        for block_n in (64, 128) for warps in (4, 8) for stages in (2, 3) for ws in (False, True)]
    for cfg in candidates:
        try:
            ms = median_ms(lambda: flash_attention(q, k, v, config=cfg))
        except Exception as error:  # out of shared memory, unsupported on this chip: skip the config
            print(f"config {cfg} failed: {type(error).__name__}: {str(error)[:200]}")
            continue
        results.append({"kernel": "xstage_attention_tuning", "shape": [b, s, h, d], "config": vars(cfg),
                        "ms": ms, "baseline": "none", "baseline_ms": None})
    best = min(results, key=lambda r: r["ms"])
    return TileConfig(**best["config"]), results


def bench_fused(n_ranks: int, heads: int, config: TileConfig | None) -> list[dict]:
    records = []
    share = heads // n_ranks
    for seq in FUSED_SEQ:
        local = seq // n_ranks
        loop = LoopbackUlysses(n_ranks, 1, 0, local, heads, 128, torch.bfloat16, "cuda")
        for buffers in loop.qkv:
            for t in buffers:
                t.normal_()
        q, k, v = loop.qkv[0]
        alone = median_ms(lambda: flash_attention(q, k, v, config=config))
        fused = median_ms(lambda: loop.attention(0, seq))
        records.append({"kernel": "fused_post_a2a_loopback", "shape": [1, seq, share, 128], "n_ranks": n_ranks,
                        "ms": fused, "baseline": "xstage_attention_alone", "baseline_ms": alone,
                        "ratio": fused / alone})
        image = torch.randn(1, local, heads, 128, device="cuda", dtype=torch.bfloat16)
        table = loop.qkv_tables[0]
        pre = median_ms(lambda: scatter_heads(image, table, loop.qkv[0][0], row0=0))
        dst = torch.empty_like(image)
        copy = median_ms(lambda: dst.copy_(image))
        records.append({"kernel": "pre_a2a_loopback", "shape": [1, local, heads, 128], "n_ranks": n_ranks,
                        "ms": pre, "baseline": "d2d_copy_same_bytes", "baseline_ms": copy, "ratio": pre / copy})
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-kernels")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--heads", type=int, default=24)
    args = parser.parse_args()
    config, tuning = tune_attention()
    print("best tile config", config)
    records = tuning + bench_attention(config) + bench_fused(args.ranks, args.heads, config)
    env = {"card": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "command": shlex.join(["python", *sys.argv]), "torch": torch.__version__,
           "triton": triton.__version__, "cuda": torch.version.cuda}
    records = [{**r, **env} for r in records]
    prefix = Path(args.out)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    lines = [f"# Kernels: {env['card']}, {env['date']}", "",
             f"torch {env['torch']}, Triton {env['triton']}, CUDA {env['cuda']}; `{env['command']}`. "
             "Loopback = N ranks simulated on one GPU (stores stay local: no NVLink, no scaling).", "",
             "| kernel | shape (B, S, H, D) | ms | baseline | baseline ms | ratio | TFLOP/s (ours / baseline) |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        if r["baseline_ms"] is None:
            continue
        tf = f"{r['tflops']:.0f} / {r['baseline_tflops']:.0f}" if "tflops" in r else "-"
        lines.append(f"| {r['kernel']}{' N=' + str(r['n_ranks']) if 'n_ranks' in r else ''} | {tuple(r['shape'])} | "
                     f"{r['ms']:.3f} | {r['baseline']} | {r['baseline_ms']:.3f} | {r['ratio']:.3f} | {tf} |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
