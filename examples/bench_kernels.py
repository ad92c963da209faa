"""Kernel benchmarks on one GPU, each variant timed side by side with its baseline in the same run, each row with
the Burst-Gap planner's prediction where a calibration of this GPU exists (xstage-dit calibrate).

    python examples/bench_kernels.py --out docs/benchmarks/kernels-h200 [--calibration FILE]

- the RoPE kernel vs diffusers' apply_rotary_emb on q/k of the e2e benchmark's attention shapes, and the
  norm + RoPE kernel vs the norms, concatenation and RoPE it replaces in Flux, in CUDA graphs;
- the fused backend's pre-all-to-all store with Flux's norms and rotation in it vs the norm + RoPE kernel and
  then the stores (loopback, CUDA graphs);
- host time per call (GPU kept busy) of our degree-1 attention entry and routed RoPE vs what they replace;
- own attention kernel vs cuDNN SDPA and FlashAttention-2 SDPA (bf16, the shapes of docs/benchmarks), after a
  sweep of tile configurations; at the e2e benchmark's attention shapes also vs cuDNN back to back (no L2 flush);
- FP8 attention (fp8=True: INT8 q·kᵀ, e4m3 p·v, its quantization pass included) vs the same on the portable
  Triton kernel, our bf16 kernel, cuDNN's bf16 SDPA and SageAttention (where installed) at Flux's one-GPU shape,
  16k tokens and Wan 14B 720p's 75.6k (12 heads), TFLOP/s and each one's relative error against float32 on
  sampled query rows, after a sweep of FP8 configurations (`--parts fp8`);
- the attention kernel with its last round of tiles cut over the keys vs whole tiles only, at one rank's shapes,
  and vs cuDNN in CUDA graphs (the GPU's time alone: a short call timed on its own also times its launch);
- one rank of N-rank Ulysses attention in loopback (N ranks simulated on this GPU; every "remote" store lands in
  local memory), each through the backends' own code: the fused backend's steps over a loopback fabric (store
  kernels, attention with the scatter epilogue; no barriers) in both tile orders vs our attention kernel alone;
  its pre-all-to-all step alone vs a device-to-device copy of the same bytes; with FP8 payloads (e4m3 rows and
  their scales: about half the bytes), its pre-all-to-all step and its whole call vs the same in bf16; and the
  whole call of serial (the
  reference backend's exchange code around its SDPA, each all-to-all a copy of the send buffer), overlap (the
  overlap backend's chunked schedule, the all-to-alls as copies on a second stream) and fused, each vs cuDNN
  attention alone.
Loopback shows what the kernels and their stores cost on this GPU, not NVLink drain, and nothing about scaling.
Each variant and its baselines are timed in alternating rounds of triton.testing.do_bench (every call after an L2
flush), so that clock and power drift weigh on all of them alike; a row gives the median over all its samples.
Writes OUT.json (a list of records) and OUT.md."""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from torch.nn.attention import SDPBackend, sdpa_kernel

from xstage_dit.kernels.all_to_all import store_heads
from xstage_dit.kernels.attention import FP8_CONFIG, TileConfig, flash_attention
from xstage_dit.kernels.attention_hopper import HopperConfig, split_tail
from xstage_dit.kernels.rotary import norm_rotate, rotary_interleaved
from xstage_dit.kernels.rotary_args import JointTokens, NormedTokens
from xstage_dit.sp.attention import ops
from xstage_dit.sp.attention.exchange import InFlight
from xstage_dit.sp.fabric import LoopbackFabric, View
from xstage_dit.sp.attention.fused import TILE_ROWS, fused_exchange, fused_steps
from xstage_dit.sp.attention.local import flash_attention_bshd
from xstage_dit.sp.attention.layout import UlyssesLayout
from xstage_dit.sp.attention.overlap import MAX_CHUNKS, chunked_exchange
from xstage_dit.sp.attention.reference import serial_exchange
from xstage_dit.burst_gap import AttentionShape, Calibration, Planner, find_calibration
from xstage_dit.testing.numerics import relative_error
from xstage_dit.burst_gap.ulysses_plan import TileOrder
from xstage_dit.sizes import fp8_payload_bytes

from provenance import OUTPUT_DIR, described, provenance

ATTENTION_SHAPES = [  # (B, H, S, D)
    (1, 24, 4608, 128), (1, 24, 16896, 128), (1, 40, 75600, 128), (1, 5, 75600, 128), (1, 3, 119056, 128),
    (1, 24, 4608, 64), (1, 48, 16896, 64),
]
# the attention layers of the e2e benchmark (Flux 1024², Wan 1.3B 480p), also timed back to back
IN_STEP_SHAPES = [(1, 24, 4608, 128), (1, 12, 32760, 128)]
LOOPBACK_SEQ = [8192, 16384, 32768, 65536]


ROUNDS = 8
# the row groups (--parts runs them in its order)
PARTS = ("tuning", "attention", "fp8", "tail", "rotary", "stores", "host", "loopback")


def back_to_back_ms(fn, calls: int = 10) -> float:
    """ms per call of `calls` calls issued back to back: no L2 flush in between, so a call finds what the one
    before left in L2, as an attention call inside a model's step finds its just-written inputs."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def graph_ms(fn, calls: int = 20) -> float:
    """ms per call of `calls` calls captured in one CUDA graph and replayed (the median of ROUNDS replays): the
    GPU's time alone, with no host launch in the loop (short kernels' do_bench times include the host's)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compiles) off the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(ROUNDS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def compare_ms(fns: dict, flush: bool = True) -> dict:
    """Median ms of each function, timed in ROUNDS alternating rounds (A B C A B C ...): do_bench (an L2 flush
    before every call), or with flush=False back to back."""
    samples = {name: [] for name in fns}
    for _ in range(ROUNDS):
        for name, fn in fns.items():
            samples[name] += (triton.testing.do_bench(fn, warmup=5, rep=30, return_mode="all") if flush
                              else [back_to_back_ms(fn) for _ in range(5)])
    return {name: statistics.median(times) for name, times in samples.items()}


def cudnn(q, k, v):
    """cuDNN SDPA on (B, S, H, D) tensors."""
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def fa2(q, k, v):
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def record(kernel: str, shape, ms: float, baseline: str, baseline_ms: float | None, predicted_ms: float | None = None,
           **extra) -> dict:
    row = {"kernel": kernel, "shape": list(shape), "ms": ms, "baseline": baseline, "baseline_ms": baseline_ms,
           **extra}
    if baseline_ms:
        row["ratio"] = ms / baseline_ms
    if predicted_ms is not None:
        row["predicted_ms"] = predicted_ms
        row["prediction_error"] = predicted_ms / ms - 1
    return row


TUNING_SHAPES = [(1, 24, 4608, 128), (1, 24, 16896, 128)]  # (B, H, S, D): the short lengths, where we trail most


def tune_attention(candidates: list | None = None, fp8: bool = False) -> list[dict]:
    """Time candidate configs at each tuning shape side by side (with `fp8`, of FP8 attention). By default the
    library's default (on Hopper the Gluon kernel's HopperConfig()) against its persistence, key tile, ring depth
    and ping-pong, and the Triton kernel's configurations (64-row tiles with one warpgroup double the grid: less
    wave quantization at short lengths)."""
    candidates = candidates or [HopperConfig(), HopperConfig(persistent=False), HopperConfig(pingpong=False),
                                HopperConfig(stages=2)] + [
        HopperConfig(block_n=64, stages=stages, pingpong=False) for stages in (3, 4)] + [
        TileConfig(128, block_n, 8, 3, tma=True) for block_n in (64, 128)] + [
        TileConfig(64, 64, 4, 3, tma=True), TileConfig(128, 128, 8, 3, tma=True, warp_specialize=True)]
    kind = "xstage_attention_fp8_tuning" if fp8 else "xstage_attention_tuning"
    results = []
    for b, h, s, d in TUNING_SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        runs = {}
        for cfg in candidates:
            try:
                flash_attention(q, k, v, config=cfg, fp8=fp8)
            except Exception as error:  # out of shared memory, unsupported on this chip: skip the config
                print(f"config {cfg} failed: {type(error).__name__}: {str(error)[:200]}")
                continue
            runs[cfg] = functools.partial(flash_attention, q, k, v, config=cfg, fp8=fp8)
        for cfg, ms in compare_ms(runs).items():
            print(f"{kind} {(b, s, h, d)} {cfg}: {ms:.3f} ms")
            results.append({"kernel": kind, "shape": [b, s, h, d],
                            "config": {"kernel": type(cfg).__name__, **vars(cfg)}, "ms": ms, "baseline": "none",
                            "baseline_ms": None})
    return results


def bench_attention(planner: Planner | None) -> list[dict]:
    """The attention kernel as the library runs it (its default config for the inputs) vs cuDNN and FA2."""
    records = []
    for b, h, s, d in ATTENTION_SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = compare_ms({"ours": lambda: flash_attention(q, k, v), "cudnn": lambda: cudnn(q, k, v),
                         "fa2": lambda: fa2(q, k, v)})
        shape = AttentionShape(b, s, 0, h, d, 1)
        flops = shape.flops()
        predicted = (planner.ulysses.attention(shape, own=True) * 1e3,
                     planner.ulysses.attention(shape, own=False) * 1e3) if planner else (None, None)
        for name, baseline in (("cudnn", "cudnn_sdpa"), ("fa2", "fa2_sdpa")):
            records.append(record("xstage_attention", (b, s, h, d), ms["ours"], baseline, ms[name],
                                  predicted[0] if name == "cudnn" else None, tflops=flops / ms["ours"] / 1e9,
                                  baseline_tflops=flops / ms[name] / 1e9))
        records.append(record("cudnn_sdpa", (b, s, h, d), ms["cudnn"], "none", None, predicted[1]))
    for b, h, s, d in IN_STEP_SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = compare_ms({"ours": lambda: flash_attention(q, k, v), "cudnn": lambda: cudnn(q, k, v)}, flush=False)
        flops = AttentionShape(b, s, 0, h, d, 1).flops()
        records.append(record("xstage_attention (back to back)", (b, s, h, d), ms["ours"],
                              "cudnn_sdpa (back to back)", ms["cudnn"], tflops=flops / ms["ours"] / 1e9,
                              baseline_tflops=flops / ms["cudnn"] / 1e9))
    return records


FP8_SHAPES = [(1, 24, 4608, 128), (1, 24, 16384, 128), (1, 12, 75600, 128)]  # (B, H, S, D)
SAMPLED_ROWS = 512  # query rows per shape whose output is checked against float32


def sampled_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Attention of query rows `rows` over every key in float32, (B, rows, H, D), one head at a time."""
    out = []
    for h in range(q.shape[2]):
        scores = torch.einsum("brd,bkd->brk", q[:, rows, h].float(), k[:, :, h].float()) * q.shape[-1] ** -0.5
        out.append(torch.einsum("brk,bkd->brd", scores.softmax(-1), v[:, :, h].float()))
    return torch.stack(out, dim=2)


def sage_attention() -> Callable | None:
    """SageAttention's PyPI release (INT8 q·kᵀ, FP16/FP8 p·v in Triton) on (B, S, H, D) inputs, where installed."""
    try:
        from sageattention import sageattn
    except ImportError:
        return None
    return lambda q, k, v: sageattn(q, k, v, tensor_layout="NHD", is_causal=False)


def bench_fp8_attention() -> list[dict]:
    """FP8 attention as flash_attention(fp8=True) runs it (quantization pass and kernel: on Hopper the Gluon
    kernel) vs the same FP8 on the portable Triton kernel, our bf16 kernel (its default config: the Gluon kernel on
    Hopper), cuDNN bf16 and SageAttention where installed, with the relative error of each against float32 on
    SAMPLED_ROWS query rows spread over the sequence; and FP8 configurations side by side."""
    records = tune_attention([HopperConfig(), HopperConfig(block_n=64), HopperConfig(pingpong=False),
                              HopperConfig(block_n=64, pingpong=False), HopperConfig(stages=4),
                              HopperConfig(block_n=64, stages=4), HopperConfig(persistent=False), FP8_CONFIG],
                             fp8=True)
    sage = sage_attention()
    for b, h, s, d in FP8_SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        calls = {"fp8": lambda: flash_attention(q, k, v, fp8=True).out,
                 "fp8-triton": lambda: flash_attention(q, k, v, fp8=True, config=FP8_CONFIG).out,
                 "bf16": lambda: flash_attention(q, k, v).out, "cudnn": lambda: cudnn(q, k, v)}
        if sage is not None:
            calls["sageattention"] = lambda: sage(q, k, v)
        ms = compare_ms(calls)
        rows = torch.linspace(0, s - 1, SAMPLED_ROWS, device="cuda").long()
        want = sampled_reference(q, k, v, rows)
        errors = {name: relative_error(call()[:, rows], want) for name, call in calls.items()}
        flops = AttentionShape(b, s, 0, h, d, 1).flops()
        print(f"FP8 attention {(b, s, h, d)}: " + ", ".join(
            f"{name} {ms[name]:.3f} ms {flops / ms[name] / 1e9:.0f} TFLOP/s error {errors[name]:.2e}"
            for name in calls))
        for name, baseline in (("fp8-triton", "xstage_attention_fp8 (Triton kernel)"), ("bf16", "xstage_attention"),
                               ("cudnn", "cudnn_sdpa"), ("sageattention", "sageattention")):
            if name not in calls:
                continue
            records.append(record("xstage_attention_fp8", (b, s, h, d), ms["fp8"], baseline, ms[name],
                                  tflops=flops / ms["fp8"] / 1e9, baseline_tflops=flops / ms[name] / 1e9,
                                  error=errors["fp8"], baseline_error=errors[name]))
    return records


# one rank's attention in Ulysses at N = 1, 2, 4, 8 (Flux 1024²: 24 heads; Wan 1.3B 480p: 12) and a short length
TAIL_SHAPES = [(1, 24 // n, 4608, 128) for n in (1, 2, 4, 8)] + [(1, 12 // n, 32760, 128) for n in (1, 2)] + [
    (1, 24, 1024, 128)]


def bench_tail_split() -> list[dict]:
    """The Gluon kernel with its last round of tiles cut over the keys (TailSplit, the default) vs the same
    kernel with whole tiles only, and cuDNN, at one rank's Ulysses attention shapes; and ours vs cuDNN timed in
    CUDA graphs, the GPU's time alone (for short calls, do_bench also times the host's launch)."""
    records = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for b, h, s, d in TAIL_SHAPES:
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ms = compare_ms({"split": lambda: flash_attention(q, k, v, config=HopperConfig()),
                         "whole": lambda: flash_attention(q, k, v, config=HopperConfig(split_tail=False)),
                         "cudnn": lambda: cudnn(q, k, v)})
        config = HopperConfig()
        tiles, key_tiles = b * h * triton.cdiv(s, config.block_m), triton.cdiv(s, config.block_n)
        split = split_tail(tiles, sms, key_tiles)
        print(f"tail split {(b, s, h, d)}: {tiles} tiles on {sms} SMs, {split.splits} pieces: {ms['split']:.3f} "
              f"ms, whole tiles {ms['whole']:.3f} ms, cuDNN {ms['cudnn']:.3f} ms")
        extra = dict(work_tiles=tiles, splits=split.splits)
        records.append(record("xstage_attention (tail split)", (b, s, h, d), ms["split"],
                              "xstage_attention (whole tiles)", ms["whole"], **extra))
        records.append(record("xstage_attention (tail split)", (b, s, h, d), ms["split"], "cudnn_sdpa", ms["cudnn"],
                              **extra))
        records.append(record("xstage_attention (CUDA graph)", (b, s, h, d), graph_ms(lambda: flash_attention(q, k, v)),
                              "cudnn_sdpa (CUDA graph)", graph_ms(lambda: cudnn(q, k, v)), **extra))
    return records


def bench_rotary() -> list[dict]:
    """Our one-pass RoPE kernel vs diffusers' apply_rotary_emb (what a patched model's routed call replaces) on
    q/k tensors of the e2e benchmark's attention shapes, and the norm + RoPE kernel vs the norms, concatenation and
    RoPE kernel it replaces in Flux's blocks; timed in CUDA graphs (these calls take microseconds: timed one by one
    they measure the host's launch)."""
    records = []
    for b, h, s, d in IN_STEP_SHAPES:
        x = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        cos, sin = (torch.randn(s, d, device="cuda") for _ in range(2))
        ours = graph_ms(lambda: rotary_interleaved(x, cos, sin, 1))
        moved = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()  # x in, out, tables
        records.append(record("rotary_emb (CUDA graph)", (b, s, h, d), ours,
                              "diffusers apply_rotary_emb (CUDA graph)",
                              graph_ms(lambda: apply_rotary_emb(x, (cos, sin), sequence_dim=1)),
                              gb_per_s=moved / ours / 1e6))
    # a Flux dual-stream block's query: its text and image tokens, each with its own RMSNorm, joined and rotated
    b, h, s, d = IN_STEP_SHAPES[0]
    text_len = 512
    parts = [NormedTokens(torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16),
                          torch.randn(d, device="cuda", dtype=torch.bfloat16), 1e-6) for n in (text_len, s - text_len)]
    cos, sin = (torch.randn(s, d, device="cuda") for _ in range(2))

    def norms_then_rope():  # what NormRopeProcessor replaces, with our RoPE kernel
        normed = torch.cat([F.rms_norm(p.tokens, (d,), p.weight, p.eps) for p in parts], dim=1)
        return rotary_interleaved(normed, cos, sin, 1)

    ours = graph_ms(lambda: norm_rotate(parts, cos, sin))
    moved = 4 * b * s * h * d + 2 * cos.numel() * cos.element_size()  # bf16 tokens in and out, tables
    records.append(record("norm + rope (CUDA graph)", (b, s, h, d), ours,
                          "2 rms_norm + cat + rotary_emb (CUDA graph)", graph_ms(norms_then_rope),
                          gb_per_s=moved / ours / 1e6))
    return records


def bench_stores() -> list[dict]:
    """One rank's pre-all-to-all store of a Flux dual-stream block's query at 2 and 4 ranks, through the fused
    backend's store kernel over a loopback fabric (the "remote" rows land in local memory, so this times the
    kernels, not NVLink): with the two norms, the join and the rotation applied in the stores (JointTokens) vs the
    norm + RoPE kernel and then the plain stores; in CUDA graphs."""
    b, h, s, d = IN_STEP_SHAPES[0]
    text_len = 512
    records = []
    for n_ranks in (2, 4):
        local = (s - text_len) // n_ranks
        layout = UlyssesLayout(text_len, s - text_len, local, n_ranks, 0)
        parts = [NormedTokens(torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16),
                              torch.randn(d, device="cuda", dtype=torch.bfloat16), 1e-6) for n in (text_len, local)]
        cos, sin = (torch.randn(text_len + local, d, device="cuda") for _ in range(2))
        fabric = LoopbackFabric(n_ranks, "cuda")  # holds the other ranks' buffers, which the stores reach
        buffer = fabric.rank(0).carve([View("q", (b, layout.gathered_len, h // n_ranks, d), torch.bfloat16)])["q"]
        rows = layout.store_rows(text_len)

        def store(tokens: JointTokens) -> None:
            store_heads(tokens, rows, offsets=buffer.destinations, base=buffer.tensor, rank=0)

        joint = JointTokens.normed_and_rotated(parts, cos, sin)
        records.append(record("norm + rope in the stores (CUDA graph)", (b, text_len + local, h, d),
                              graph_ms(lambda: store(joint)), "norm + rope kernel, then the stores (CUDA graph)",
                              graph_ms(lambda: store(JointTokens((norm_rotate(parts, cos, sin),)))),
                              n_ranks=n_ranks))
    return records


def host_ms(fn, calls: int = 40) -> float:
    """Host time per call in ms: `calls` calls issued while the GPU sleeps, so that launches only queue (the
    median of ROUNDS rounds)."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(ROUNDS):
        torch.cuda._sleep(400_000_000)  # about 0.2 s of GPU time, far longer than the calls take to issue
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e3)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def bench_host() -> list[dict]:
    """Host time per call at Flux's attention shape: what the CPU spends issuing our kernels as a patched model
    calls them (the degree-1 attention entry, the routed RoPE with its input check) against the calls they
    replace (cuDNN SDPA as diffusers' dispatcher makes it, diffusers' apply_rotary_emb). Where a step is
    host-bound (short attention calls at high degrees, small elementwise kernels) this is what it pays."""
    b, h, s, d = IN_STEP_SHAPES[0]
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cos, sin = (torch.randn(s, d, device="cuda") for _ in range(2))

    def routed_rope():  # what the router runs for a call it takes
        return ops.rotary_kernel_runs(q, cos, sin, 1) and ops.rotary(q, cos, sin, 1)

    pairs = [("attention, fused backend at degree 1 (host)", lambda: flash_attention_bshd(q, k, v, None, None),
              "diffusers dispatch_attention_fn, stock (host)", lambda: dispatch_attention_fn(q, k, v)),
             ("rotary_emb routed (host)", routed_rope,
              "diffusers apply_rotary_emb (host)", lambda: apply_rotary_emb(q, (cos, sin), sequence_dim=1)),
             ("rotary_emb custom op (host)", lambda: ops.rotary_emb_op(x=q, cos=cos, sin=sin, sequence_dim=1),
              "rotary_emb routed (host)", routed_rope)]
    return [record(name, (b, s, h, d), host_ms(fn), base_name, host_ms(base)) for name, fn, base_name, base in pairs]


class StreamCopy:
    """A loopback transport with the all-to-all in flight: a copy of the send buffer on a second stream (every
    simulated peer "sends" rank 0's data back, which times the same bytes). Like NCCL's stashing of a collective's
    tensors, the send buffer stays referenced until the main stream waited for the copy, instead of a
    record_stream (which costs host time per call)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def __call__(self, send: torch.Tensor) -> InFlight:
        recv = torch.empty_like(send)  # allocated on the main stream, which reads it after the wait
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            recv.copy_(send)
            done = torch.cuda.Event()
            done.record(self.stream)
        return InFlight(recv, EventWait(done, send))


class EventWait:
    def __init__(self, event: torch.cuda.Event, send: torch.Tensor) -> None:
        self.event, self.send = event, send

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)
        self.send = None  # later frees of it are ordered after the copy


def copy_now(send: torch.Tensor) -> InFlight:
    """The loopback transport of the serial path: the all-to-all as a copy, in stream order."""
    return InFlight(send.clone(), None)


def peers_rows(buffer: torch.Tensor) -> None:
    """Standard normal values, as peers' rows would hold (in any dtype: FP8 payloads too)."""
    buffer.copy_(torch.randn(buffer.shape, device=buffer.device))


class LoopbackRank:
    """Rank 0 of N-rank Ulysses attention on one GPU: its joint inputs, a loopback fabric for the fused backend's
    steps, and loopback transports for the reference and overlap backends' exchange code."""

    def __init__(self, n_ranks: int, seq: int, heads: int, head_dim: int) -> None:
        self.local, self.share = seq // n_ranks, heads // n_ranks
        self.layout = UlyssesLayout(0, seq, self.local, n_ranks, 0)
        self.qkv = [torch.randn(1, self.local, heads, head_dim, device="cuda", dtype=torch.bfloat16)
                    for _ in range(3)]
        self.fabric = LoopbackFabric(n_ranks, "cuda", initialise=peers_rows).rank(0)
        # this rank's heads of the whole sequence, as after the pre-all-to-all
        self.gathered = [torch.randn(1, seq, self.share, head_dim, device="cuda", dtype=torch.bfloat16)
                         for _ in range(3)]
        self.in_flight = StreamCopy()

    def fused_pre(self, fp8_payloads: bool = False) -> None:
        """The fused backend's first step alone: the pre-all-to-all store kernels (of FP8 payloads: `fp8_payloads`)."""
        next(fused_steps(*self.joint_qkv(), self.layout, self.fabric, None, None, TileOrder.ROTATED,
                         fp8_payloads=fp8_payloads))

    def fused_call(self, order: TileOrder, fp8_payloads: bool = False) -> torch.Tensor:
        return fused_exchange(*self.joint_qkv(), self.layout, self.fabric, None, None, order,
                              fp8_payloads=fp8_payloads)

    def joint_qkv(self) -> list[JointTokens]:
        return [JointTokens((t,)) for t in self.qkv]

    def serial_call(self) -> torch.Tensor:
        return serial_exchange(*self.qkv, self.layout, copy_now, None, None)

    def overlap_call(self) -> torch.Tensor:
        return chunked_exchange(*self.qkv, self.layout, self.in_flight, None, None)


def bench_loopback(n_ranks: int, heads: int, planner: Planner | None) -> list[dict]:
    records = []
    for seq in LOOPBACK_SEQ:
        rank = LoopbackRank(n_ranks, seq, heads, 128)
        shape = AttentionShape(1, seq, 0, heads, 128, n_ranks)
        dims = [1, seq, rank.share, 128]
        q, k, v = rank.gathered
        ms = compare_ms({"alone": lambda: flash_attention(q, k, v),  # the default config, as the fused kernel runs
                         "vendor": lambda: cudnn(q, k, v), "serial": rank.serial_call, "overlap": rank.overlap_call,
                         **{order: lambda o=order: rank.fused_call(o) for order in TileOrder}})
        # loopback has no barriers and no copy out of the fabric
        fused = {order: planner.ulysses.pre_all_to_all(shape)
                 + planner.ulysses.fused_kernel(shape, order, TILE_ROWS) for order in TileOrder} if planner else {}
        for order in TileOrder:
            records.append(record("fused_call_loopback", dims, ms[order], "xstage_attention_alone", ms["alone"],
                                  fused[order] * 1e3 if planner else None, n_ranks=n_ranks, tile_order=order.value))
        expected = {"serial": planner.ulysses.serial_call(shape),
                    "overlap": planner.ulysses.overlap_call(shape, MAX_CHUNKS)} if planner else {}
        for name in ("serial", "overlap"):
            records.append(record(f"{name}_call_loopback", dims, ms[name], "cudnn_attention_alone", ms["vendor"],
                                  expected[name] * 1e3 if planner else None, n_ranks=n_ranks))
        volume = 3 * shape.tensor_bytes()
        src = torch.empty(int(volume), dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ms = compare_ms({"pre": rank.fused_pre, "copy": lambda: dst.copy_(src),
                         "pre fp8": lambda: rank.fused_pre(fp8_payloads=True),
                         "call": lambda: rank.fused_call(TileOrder.ROTATED),
                         "call fp8": lambda: rank.fused_call(TileOrder.ROTATED, fp8_payloads=True)})
        records.append(record("pre_a2a_loopback", [1, rank.local, heads, 128], ms["pre"], "d2d_copy_same_bytes",
                              ms["copy"], planner.ulysses.pre_all_to_all(shape) * 1e3 if planner else None,
                              n_ranks=n_ranks))
        # FP8 payloads: the stores send e4m3 rows and their scales
        fp8_shape = replace(shape, payload_bytes=fp8_payload_bytes(128))
        sent = {"bf16": volume, "fp8": volume * fp8_shape.payload_ratio}
        records.append(record("pre_a2a_fp8_loopback", [1, rank.local, heads, 128], ms["pre fp8"],
                              "pre_a2a_loopback (bf16)", ms["pre"],
                              planner.ulysses.pre_all_to_all(fp8_shape) * 1e3 if planner else None, n_ranks=n_ranks,
                              sent_bytes=sent["fp8"], baseline_sent_bytes=sent["bf16"]))
        records.append(record("fused_call_fp8_loopback", dims, ms["call fp8"], "fused_call_loopback (bf16)",
                              ms["call"], n_ranks=n_ranks, tile_order=TileOrder.ROTATED.value))
        check = (rank.serial_call() - rank.overlap_call()).abs().max().item()
        assert check < 1e-2, f"loopback overlap differs from serial by {check}"
    return records


def write(records: list[dict], prefix: Path, calibration: Calibration | None) -> None:
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    env = records[0]
    errors = [abs(r["prediction_error"]) for r in records if "prediction_error" in r]
    source = (f"planner from `{calibration.filename}` ({calibration.topology})" if calibration
              else "no calibration: no predictions")
    lines = [f"# Kernels: {env['card']}, {env['date']}", "",
             described(env) + " Loopback = one rank of N simulated on one GPU (stores stay local: no NVLink, no scaling). "
             f"Predicted: {source}"
             + (f"; median |error| {statistics.median(errors):.1%} over {len(errors)} rows." if errors else "."), "",
             "| kernel | shape (B, S, H, D) | ms | baseline | baseline ms | ratio | TFLOP/s (ours / baseline) "
             "| predicted ms | error |",
             "|---|---|---|---|---|---|---|---|---|"]
    tables = ("xstage_attention_tuning", "xstage_attention_fp8_tuning", "xstage_attention_fp8")
    for r in records:
        if r["kernel"] in tables:
            continue
        name = r["kernel"] + (f" N={r['n_ranks']}" if "n_ranks" in r else "") + (
            f" ({r['tile_order']})" if "tile_order" in r else "")
        base = f"{r['baseline_ms']:.3f}" if r["baseline_ms"] else "-"
        ratio = f"{r['ratio']:.3f}" if "ratio" in r else "-"
        tf = f"{r['tflops']:.0f} / {r['baseline_tflops']:.0f}" if "tflops" in r else "-"
        guess = (f"{r['predicted_ms']:.3f} | {r['prediction_error']:+.1%}" if "predicted_ms" in r else "- | -")
        lines.append(f"| {name} | {tuple(r['shape'])} | {r['ms']:.3f} | {r['baseline']} | {base} | {ratio} | {tf} "
                     f"| {guess} |")
    tuning = [r for r in records if r["kernel"] == "xstage_attention_tuning"]
    if tuning:
        lines += ["", "Attention configurations (bf16; the table above runs the default, HopperConfig() on an H200):",
                  "", "| shape (B, S, H, D) | config | ms |", "|---|---|---|"]
        lines += [f"| {tuple(r['shape'])} | {r['config']} | {r['ms']:.3f} |" for r in tuning]
    fp8 = [r for r in records if r["kernel"] == "xstage_attention_fp8"]
    if fp8:
        lines += ["", "FP8 attention (flash_attention(fp8=True), its quantization pass included) vs bf16, relative "
                  f"error against float32 on {SAMPLED_ROWS} sampled query rows:", "",
                  "| shape (B, S, H, D) | baseline | TFLOP/s FP8 / baseline | ms FP8 / baseline "
                  "| error FP8 / baseline |", "|---|---|---|---|---|"]
        lines += [f"| {tuple(r['shape'])} | {r['baseline']} | {r['tflops']:.0f} / {r['baseline_tflops']:.0f} "
                  f"| {r['ms']:.3f} / {r['baseline_ms']:.3f} | {r['error']:.2e} / {r['baseline_error']:.2e} |"
                  for r in fp8]
    fp8_tuning = [r for r in records if r["kernel"] == "xstage_attention_fp8_tuning"]
    if fp8_tuning:
        lines += ["", "FP8 attention configurations (the table above runs the default, HopperConfig() on an H200):", "",
                  "| shape (B, S, H, D) | config | ms |", "|---|---|---|"]
        lines += [f"| {tuple(r['shape'])} | {r['config']} | {r['ms']:.3f} |" for r in fp8_tuning]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=f"{OUTPUT_DIR}/bench-kernels")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--calibration", type=Path, help="default: this GPU's loopback calibration, if any")
    parser.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS),
                        help="which row groups to run (default: all)")
    args = parser.parse_args()
    card = torch.cuda.get_device_name()
    calibration = (Calibration.load(args.calibration) if args.calibration
                   else find_calibration(card, 1, "loopback"))
    planner = Planner.from_calibration(calibration) if calibration else None
    parts = {"tuning": tune_attention, "attention": lambda: bench_attention(planner), "fp8": bench_fp8_attention,
             "tail": bench_tail_split,
             "rotary": bench_rotary, "stores": bench_stores,
             "host": bench_host, "loopback": lambda: bench_loopback(args.ranks, args.heads, planner)}
    records = [row for part in args.parts for row in parts[part]()]
    env = provenance()
    write([{**r, **env} for r in records], args.out, calibration)


if __name__ == "__main__":
    main()
