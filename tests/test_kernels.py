"""Own kernels against float64 references on fresh random inputs: the attention kernel (key-length and key
masks, log-sum-exp; on Hopper also over (B, H, S, D) memory) and the fused backend's own steps over a loopback
fabric (N simulated ranks on one device: pre-all-to-all store kernel, attention with its scatter epilogue), with
every output element checked written. The key forward, the merge and the fused steps run in FP8 attention too,
within its bounds (numerics.FP8_ATTENTION_ERROR; its own tests: test_fp8_attention.py).

On CPU they run in Triton's interpreter (float32, small shapes); on a GPU (marked) in bf16 at real sizes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from numerics import (FP8_ATTENTION_ERROR, FP8_LSE_ERROR, attention_reference as _reference, fp8_error_bound,
                      fp8_round_trip, relative_error)

pytest.importorskip("triton", reason="triton is not installed: the fused extra (CUDA builds of torch bring it)")
from xstage_dit.kernels.attention import TileConfig, flash_attention  # noqa: E402
from xstage_dit.kernels.attention_args import KeyForward, Merge, PayloadScales, Running, Store  # noqa: E402
from xstage_dit.kernels.attention_hopper import HopperConfig, TailSplit, split_tail  # noqa: E402
from xstage_dit.kernels.fp8 import PAYLOAD_DTYPE, SCALE_DTYPE  # noqa: E402
from xstage_dit.kernels.rotary_args import JointTokens, NormedTokens, NormRope  # noqa: E402
from xstage_dit.sp.fabric import LoopbackFabric, View, run_in_lockstep  # noqa: E402
from xstage_dit.sp.attention.fused import fused_steps  # noqa: E402
from xstage_dit.sp.attention.layout import UlyssesLayout  # noqa: E402
from xstage_dit.burst_gap.ulysses_plan import TileOrder  # noqa: E402

# bf16 operands against a float64 reference land between 1e-3 and 1e-2 relative
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 5e-3}
# FP8 payloads (kernels/fp8.py): rounding the output rows costs about 2.5 % normwise (each value within 2^-4 of
# itself), and the rounded q, k and v move standard normal attention about as much again
FP8_OUTPUT = 2.0 ** -5
FP8_VS_PLAIN = 2.0 ** -4


def _bounds(dtype: torch.dtype, fp8: bool) -> tuple[float, float]:
    """The output's relative error and the log-sum-exp's largest error a call may have."""
    return (FP8_ATTENTION_ERROR, FP8_LSE_ERROR) if fp8 else (TOLERANCE[dtype], 1e-3)


def _check_attention(device, dtype, batch, q_len, kv_rows, kv_len, heads, head_dim, masked, config=None,
                     heads_major=False):
    def make(rows):  # heads_major: (B, S, H, D) views of (B, H, S, D) memory, as torch's SDPA layout gives
        if heads_major:
            return torch.randn(batch, heads, rows, head_dim, device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(batch, rows, heads, head_dim, device=device, dtype=dtype)

    q, k, v = make(q_len), make(kv_rows), make(kv_rows)
    key_mask = (torch.rand(batch, 9, device=device) > 0.4) if masked else None
    out = torch.full_like(q, float("nan"))
    attended = flash_attention(q, k, v, kv_len=kv_len, key_mask=key_mask, epilogue=Store(out, lse=True),
                               config=config)
    out, lse = attended.out, attended.lse
    ref, ref_lse = _reference(q, k, v, kv_len, key_mask)
    assert not out.isnan().any(), "unwritten output"
    assert relative_error(out, ref) < TOLERANCE[dtype]
    assert (lse.double() - ref_lse).abs().max().item() < 1e-3


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("heads_major", [False, True])
def test_attention_interpreted(head_dim, masked, heads_major):
    _check_attention("cpu", torch.float32, 2, 37, 45, 41, 2, head_dim, masked, heads_major=heads_major)


def _check_key_forward(device, dtype, batch, q_len, kv_rows, kv_len, heads, kv_heads, config=None,
                       heads_major=False, fp8=False):
    """Grouped keys attended and forwarded (the X-Stage ring's call): the output and LSE against the reference,
    and every key and value row [0, kv_len) of every key head stored into the destination buffers, unchanged (in
    FP8 attention too: the keys and values as given)."""
    def make(rows, n_heads):
        if heads_major:
            return torch.randn(batch, n_heads, rows, 128, device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(batch, rows, n_heads, 128, device=device, dtype=dtype)

    q, k, v = make(q_len, heads), make(kv_rows, kv_heads), make(kv_rows, kv_heads)
    k_to, v_to = (torch.full_like(t, float("nan")) for t in (k, v))
    attended = flash_attention(q, k, v, kv_len=kv_len, epilogue=Store(lse=True), config=config,
                               forward=KeyForward(k_to.data_ptr(), v_to.data_ptr()), fp8=fp8)
    out, lse = attended.out, attended.lse
    ref, ref_lse = _reference(q, k, v, kv_len)
    tolerance, lse_tolerance = _bounds(dtype, fp8)
    assert relative_error(out, ref) < tolerance
    assert (lse.double() - ref_lse).abs().max().item() < lse_tolerance
    assert torch.equal(k_to[:, :kv_len], k[:, :kv_len]) and torch.equal(v_to[:, :kv_len], v[:, :kv_len])


@pytest.mark.parametrize("q_len, kv_rows, kv_len", [(37, 45, 41), (70, 20, 20), (10, 60, 53)],
                         ids=["uneven", "more-query-tiles", "more-key-tiles"])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_attention_forwards_its_keys_interpreted(q_len, kv_rows, kv_len, kv_heads):
    _check_key_forward("cpu", torch.float32, 2, q_len, kv_rows, kv_len, 3, kv_heads)


def _check_merge(device, dtype, batch, q_len, first_keys, keys, heads, kv_heads, config=None, fp8=False):
    """A call that merges into a running result (the X-Stage ring's step, forwarding its keys too): over a fresh
    one (-inf log-sum-exp), then over the result of an earlier call on other keys, against one attention over
    every key."""
    tolerance, lse_tolerance = _bounds(dtype, fp8)
    def make(rows, n_heads):
        return torch.randn(batch, rows, n_heads, 128, device=device, dtype=dtype)

    q = make(q_len, heads)
    k1, v1, k2, v2 = make(first_keys, kv_heads), make(first_keys, kv_heads), make(keys, kv_heads), make(keys, kv_heads)
    running = Running.empty(q)
    k_to, v_to = torch.empty_like(k1), torch.empty_like(v1)
    for k, v in ((k1, v1), (k2, v2)):
        flash_attention(q, k, v, epilogue=Merge(running), config=config,
                        forward=KeyForward(k_to.data_ptr(), v_to.data_ptr()), fp8=fp8)
        if k is k1:
            ref, _ = _reference(q, k1, v1, first_keys)
            assert relative_error(running.out, ref) < tolerance
            assert torch.equal(k_to, k1) and torch.equal(v_to, v1)
    every_k, every_v = (torch.cat([a, b], dim=1) for a, b in ((k1, k2), (v1, v2)))
    ref, ref_lse = _reference(q, every_k, every_v, first_keys + keys)
    assert relative_error(running.out, ref) < tolerance
    assert (running.lse.double() - ref_lse).abs().max().item() < lse_tolerance


@pytest.mark.parametrize("kv_heads", [3, 1])
def test_attention_merges_into_a_running_result_interpreted(kv_heads):
    _check_merge("cpu", torch.float32, 2, 37, 45, 20, 3, kv_heads)


@pytest.mark.parametrize("q_len, kv_rows, kv_len", [(37, 45, 41), (10, 60, 53)], ids=["uneven", "more-key-tiles"])
def test_fp8_attention_forwards_its_keys_interpreted(q_len, kv_rows, kv_len):
    _check_key_forward("cpu", torch.float32, 2, q_len, kv_rows, kv_len, 3, 1, fp8=True)


def test_fp8_attention_merges_into_a_running_result_interpreted():
    _check_merge("cpu", torch.float32, 2, 37, 45, 20, 4, 2, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(4096, 4096, 4096), pytest.param((1000, 1100, 300), marks=pytest.mark.smoke),
                                     (8000, 700, 613)], ids=["ring-block", "uneven", "many-work-tiles"])
def test_fp8_attention_merges_into_a_running_result_on_gpu(lengths):
    _check_merge("cuda", torch.bfloat16, 2, *lengths, 6, 2, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(4096, 4096, 4096), (1000, 1100, 1031), (300, 4000, 3999)],
                         ids=["ring-block", "uneven", "more-key-tiles"])
@pytest.mark.parametrize("kv_heads", [6, 2])
@pytest.mark.parametrize("heads_major", [False, True])
def test_fp8_attention_forwards_its_keys_on_gpu(lengths, kv_heads, heads_major):
    q_len, kv_rows, kv_len = lengths
    _check_key_forward("cuda", torch.bfloat16, 2, q_len, kv_rows, kv_len, 6, kv_heads, heads_major=heads_major,
                       fp8=True)


def test_attention_refuses_an_epilogue_it_does_not_know_or_a_running_result_of_other_queries():
    """Refused in words before any launch: a Running result passed bare (not in a Merge), a merge into a
    running result shaped for other queries."""
    q = torch.randn(1, 20, 2, 64)
    with pytest.raises(TypeError, match="a Store, Scatter or Merge, got Running"):
        flash_attention(q, q, q, epilogue=Running.empty(q))
    with pytest.raises(ValueError, match="a running result for queries"):
        flash_attention(q, q, q, epilogue=Merge(Running.empty(q[:, :10])))


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(4096, 4096, 4096), (1000, 1100, 300), (8000, 700, 613)],
                         ids=["ring-block", "uneven", "many-work-tiles"])
@pytest.mark.parametrize("config", [None, TileConfig(tma=False)], ids=["default", "triton"])
def test_attention_merges_into_a_running_result_on_gpu(lengths, config):
    _check_merge("cuda", torch.bfloat16, 2, *lengths, 6, 2, config)


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", [(4096, 4096, 4096), (1000, 1100, 1031), (300, 4000, 3999), (8000, 700, 613)],
                         ids=["ring-block", "uneven", "more-key-tiles", "many-work-tiles"])
@pytest.mark.parametrize("kv_heads", [6, 2])
@pytest.mark.parametrize("heads_major", [False, True])
@pytest.mark.parametrize("config", [None, TileConfig(tma=False)], ids=["default", "triton"])
def test_attention_forwards_its_keys_on_gpu(lengths, kv_heads, heads_major, config):
    """The Gluon kernel's TMA stores from its K/V ring (the default on sm_90) and the Triton kernel's stores: batches
    whose last key tile runs into the next batch's rows, more key tiles than query tiles, split last rounds."""
    q_len, kv_rows, kv_len = lengths
    _check_key_forward("cuda", torch.bfloat16, 2, q_len, kv_rows, kv_len, 6, kv_heads, config, heads_major)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("loads", ["pointers", "tma", "tma+warp_specialize"])
def test_attention_on_gpu(dtype, head_dim, masked, loads):
    config = TileConfig(tma="tma" in loads, warp_specialize="warp" in loads)
    _check_attention("cuda", dtype, 2, 1000, 1100, 1031, 3, head_dim, masked, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("lengths", [(1000, 1100, 1031), (300, 64, 50), (256, 512, 512), (129, 4000, 3999),
                                     (8000, 700, 613)],
                         ids=["uneven", "one-partial-tile", "whole-tiles", "long", "many-work-tiles"])
@pytest.mark.parametrize("config", [HopperConfig(), HopperConfig(persistent=False),
                                    HopperConfig(pingpong=False, stages=2), HopperConfig(block_n=64)],
                         ids=["default", "program-per-tile", "no-pingpong", "64-key-tiles"])
def test_hopper_attention(dtype, head_dim, masked, lengths, config):
    """The Gluon kernel (the default on sm_90) against the reference: rows and keys past a tile, batches whose
    TMA tiles run into the next batch's rows, a key tile that is the only one and partial, and more work tiles
    (2 x 3 x 63) than an H200 has SMs, so that a persistent program walks several, its ring and ping-pong turns
    running on across them."""
    q_len, kv_rows, kv_len = lengths
    _check_attention("cuda", dtype, 2, q_len, kv_rows, kv_len, 3, head_dim, masked, config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernel needs an sm_90 GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("lengths", [(1000, 1100, 1031), (8000, 700, 613)], ids=["uneven", "many-work-tiles"])
def test_hopper_attention_heads_major(head_dim, masked, lengths):
    """The Gluon kernel over (B, H, S, D) memory (what SDPA-calling models pass): TMA tiles that run past one
    head's rows into the next head's."""
    q_len, kv_rows, kv_len = lengths
    _check_attention("cuda", torch.bfloat16, 2, q_len, kv_rows, kv_len, 3, head_dim, masked, HopperConfig(),
                     heads_major=True)


def _skip_unless_split(batch: int, heads: int, q_len: int, kv_len: int) -> None:
    """Skip unless the default Hopper launch of this shape splits its last round on this GPU."""
    config = HopperConfig()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    work_tiles = batch * heads * -(-q_len // config.block_m)
    if split_tail(work_tiles, sms, -(-kv_len // config.block_n)).splits == 1:
        pytest.skip(f"this GPU's {sms} SMs run the shape's tiles in whole rounds")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernel needs an sm_90 GPU")
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("heads_major", [False, True])
@pytest.mark.parametrize("shape", [(2, 1000, 4000, 3999, 3), (1, 4608, 4608, 4608, 12), (1, 4600, 4700, 4590, 12)],
                         ids=["fewer-tiles-than-sms", "flux-two-ranks", "uneven"])
def test_hopper_attention_splits_the_last_round(masked, heads_major, shape):
    """Launches whose last round of tiles the kernel cuts into pieces over the keys (fewer tiles than SMs; Flux's
    shape at two ranks, 432 tiles on an H200's 132 SMs; uneven lengths), against the reference, with key masks
    and LSE; and the merged result is the same on every call (the merge order does not depend on timing)."""
    batch, q_len, kv_rows, kv_len, heads = shape
    _skip_unless_split(batch, heads, q_len, kv_len)
    _check_attention("cuda", torch.bfloat16, batch, q_len, kv_rows, kv_len, heads, 128, masked, HopperConfig(),
                     heads_major=heads_major)
    q, k, v = (torch.randn(batch, q_len if t == "q" else kv_rows, heads, 128, device="cuda", dtype=torch.bfloat16)
               for t in "qkv")
    first = flash_attention(q, k, v, kv_len=kv_len).out
    assert all(torch.equal(first, flash_attention(q, k, v, kv_len=kv_len).out) for _ in range(5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernel needs an sm_90 GPU")
def test_hopper_attention_split_replays_in_a_cuda_graph():
    """A launch that splits its last round, captured once in a CUDA graph (its tickets zeroed and its partials
    allocated inside the graph) and replayed on fresh inputs, equals the eager call on those inputs bit for bit."""
    batch, seq, heads = 1, 4608, 12
    _skip_unless_split(batch, heads, seq, seq)
    static = [torch.randn(batch, seq, heads, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    flash_attention(*static)  # compiles the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attention(*static).out
    for _ in range(3):
        fresh = [torch.randn_like(t) for t in static]
        for slot, value in zip(static, fresh):
            slot.copy_(value)
        graph.replay()
        assert torch.equal(out, flash_attention(*fresh).out)


def test_tail_split_fills_the_last_round():
    """The pieces per tile of a launch's last round (an H200's 132 SMs): Flux at two ranks cuts its 36 leftover
    tiles in three; whole rounds, and tiles too short to cut, stay whole; fewer tiles than SMs are cut too; every
    piece has a key tile."""
    assert split_tail(432, 132, 36) == TailSplit(split_from=396, splits=3)
    assert split_tail(396, 132, 36).splits == 1
    assert split_tail(378, 132, 2).splits == 1
    assert split_tail(12, 132, 32) == TailSplit(split_from=0, splits=8)
    for work_tiles, key_tiles in [(864, 36), (3072, 256), (100, 9), (133, 40)]:
        split = split_tail(work_tiles, 132, key_tiles)
        assert split.splits <= key_tiles and (split.split_from % 132 == 0 if split.splits > 1
                                              else split.split_from == work_tiles)


def _compile_without_gpu(script: Path, *args: str) -> None:
    """Run `script` (it points Triton at a stand-in sm_90 driver) in a subprocess that compiles our kernels rather
    than interpreting them."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr


def test_hopper_kernel_compiles():
    """Without a GPU: the Gluon kernel still compiles to sm_90a machine code (ptxas included)."""
    _compile_without_gpu(Path(__file__).with_name("compile_hopper_kernel.py"))


def test_fp8_weights_reach_their_product_without_shuffles(tmp_path):
    """Without a GPU: examples/kernel_sass.py's count of the Hopper kernel's FP8 key loop on sm_90a. Its weights
    go from the score registers to p·v's operand with conversions alone (no byte permutes; the only shuffles are
    the row maxima's and sums' reductions, as in bf16), and nothing in the loop spills."""
    _compile_without_gpu(Path(__file__).resolve().parents[1] / "examples" / "kernel_sass.py", "--out",
                         str(tmp_path / "sass"))
    loops = {r["variant"]: r["key_loop_by_opcode"] for r in json.loads((tmp_path / "sass.json").read_text())}
    assert loops["fp8"].get("PRMT", 0) == 0 and loops["fp8"].get("SHFL", 0) == loops["bf16"].get("SHFL", 0), loops
    assert not any(loop.get(op, 0) for loop in loops.values() for op in ("STL", "LDL")), loops


def _norm_rope_reference(x, weight, eps, cos, sin):
    """diffusers' order: the RMSNorm module's output (in x's dtype), rotated in float32, rounded once."""
    from diffusers.models.embeddings import apply_rotary_emb

    if not x.shape[1]:
        return x
    normed = F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)
    return apply_rotary_emb(normed.float(), (cos, sin), sequence_dim=1).to(x.dtype)


def _check_loopback(device, dtype, n_ranks, batch, text_len, seq_len, heads, head_dim, text_first, order,
                    text_queries=True, norm_rope=False, fp8=False, fp8_payloads=False):
    """`text_queries=False`: the text is keys only, the queries are the image tokens. `norm_rope`: q and k reach
    the store kernels as raw text and image parts with their RMSNorm weights and RoPE tables, v as two parts (a
    joint-attention processor's JointTokens); else each as one joined tensor. `fp8`: FP8 attention.
    `fp8_payloads`: the payloads travel in FP8, against attention over q, k, v quantized as the stores quantize
    them (per token row and head: the same rows whichever rank stores them), its output quantized as the
    scatter's: in float32 within fp8_error_bound (FP8 attention: within its bound plus FP8_OUTPUT); in bf16 within
    the bf16 tolerance plus FP8_OUTPUT, and within FP8_VS_PLAIN of the same exchange in bf16."""
    local = -(-seq_len // n_ranks)

    def chunks(image):
        padded = F.pad(image, (0, 0, 0, 0, 0, n_ranks * local - seq_len))
        return [padded[:, r * local : (r + 1) * local] for r in range(n_ranks)]

    def in_order(text, image):
        return [text, image] if text_first else [image, text]

    def valid_rows(x, rank):
        rows = min(local, seq_len - rank * local)
        text_rows = x.shape[1] - local
        return x[:, : text_rows + rows] if text_first else torch.cat([x[:, :rows], x[:, local:]], dim=1)

    text = [torch.randn(batch, text_len, heads, head_dim, device=device, dtype=dtype) for _ in range(3)]
    image = [torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype) for _ in range(3)]
    text[0] = text[0] if text_queries else text[0][:, :0]
    key_mask = torch.ones(batch, text_len, dtype=torch.bool, device=device)
    key_mask[-1, text_len // 2 :] = False  # a padded prompt
    # per tensor and rank: what its store kernel reads
    tokens = [[JointTokens((torch.cat(in_order(t, c), dim=1),)) for c in chunks(i)] for t, i in zip(text, image)]
    full = [torch.cat([t, i], dim=1) for t, i in zip(text, image)]
    if norm_rope:
        angles = 10 * torch.rand(text_len + n_ranks * local, head_dim, device=device)
        text_tables, image_tables = (angles.cos(), angles.sin()), (angles[text_len:].cos(), angles[text_len:].sin())
        for which in (0, 1):  # q and k
            weights = [1 + torch.randn(head_dim, device=device, dtype=dtype) / 2 for _ in range(2)]
            eps = (1e-6, 1e-5)
            t, i = text[which], image[which]
            full[which] = torch.cat(
                [_norm_rope_reference(t, weights[0], eps[0], *(table[: t.shape[1]] for table in text_tables)),
                 _norm_rope_reference(i, weights[1], eps[1], *(table[:seq_len] for table in image_tables))], dim=1)
            for rank, chunk in enumerate(chunks(i)):
                rows = slice(rank * local, (rank + 1) * local)
                parts = [NormedTokens(t, weights[0], eps[0]), NormedTokens(chunk, weights[1], eps[1])]
                tables = [torch.cat(in_order(text_table[:t.shape[1]], image_table[rows]))
                          for text_table, image_table in zip(text_tables, image_tables)]
                tokens[which][rank] = JointTokens.normed_and_rotated(
                    [p for p in in_order(*parts) if p.tokens.shape[1]], *tables)
        tokens[2] = [JointTokens(tuple(in_order(text[2], c))) for c in chunks(image[2])]

    layouts = [UlyssesLayout(text_len, seq_len, local, n_ranks, rank, text_first, text_queries)
               for rank in range(n_ranks)]

    def exchange(payloads):
        fabric = LoopbackFabric(n_ranks, device, initialise=lambda t: t.fill_(float("nan")))
        return run_in_lockstep(
            [fused_steps(*(t[rank] for t in tokens), layouts[rank], fabric.rank(rank), None,
                         key_mask[:, None, None, :], order, fp8, payloads) for rank in range(n_ranks)],
            fabric.rank(0).barrier)

    outs = exchange(fp8_payloads)
    plain = exchange(False) if fp8_payloads and dtype != torch.float32 else None

    keep = torch.cat([key_mask, torch.ones(batch, seq_len, dtype=torch.bool, device=device)], dim=1)
    ref, _ = _reference(*(fp8_round_trip(t) if fp8_payloads else t for t in full), text_len + seq_len, keep)
    query_text_len = text[0].shape[1]
    expected = [torch.cat(in_order(ref[:, :query_text_len], c), dim=1) for c in chunks(ref[:, query_text_len:])]
    for rank in range(n_ranks):
        out, want = valid_rows(outs[rank], rank), valid_rows(expected[rank], rank)
        assert not out.isnan().any(), f"rank {rank}: unwritten output rows"
        if fp8_payloads and not fp8 and dtype == torch.float32:
            # the float32 attention within 1e-5 of the float64 one, then quantized
            excess = (out.double() - want).abs() / fp8_error_bound(want, slack=1e-5)
            assert excess.max().item() <= 1, f"rank {rank}: {excess.max().item():.2f} x the FP8 bound"
            continue
        error = relative_error(out, want)
        assert error < _bounds(dtype, fp8)[0] + (FP8_OUTPUT if fp8_payloads else 0), f"rank {rank}: {error:.2e}"
        if plain is not None:
            error = relative_error(out, valid_rows(plain[rank], rank))
            assert error < FP8_VS_PLAIN, f"rank {rank}: {error:.2e} from the bf16 exchange"


@pytest.mark.parametrize("n_ranks, seq_len", [(2, 20), (3, 19), (4, 13)])
@pytest.mark.parametrize("text_first", [True, False])
@pytest.mark.parametrize("order", list(TileOrder))
def test_fused_loopback_interpreted(n_ranks, seq_len, text_first, order):
    _check_loopback("cpu", torch.float32, n_ranks, 2, 5, seq_len, 2 * n_ranks, 64, text_first, order)


@pytest.mark.parametrize("n_ranks, seq_len, text_first", [(2, 20, True), (3, 19, False)])
def test_fused_loopback_in_fp8_interpreted(n_ranks, seq_len, text_first):
    """The scatter epilogue of FP8 attention: every rank's rows land where the bf16 kernel's do."""
    _check_loopback("cpu", torch.float32, n_ranks, 2, 5, seq_len, 2 * n_ranks, 64, text_first, TileOrder.ROTATED,
                    fp8=True)


@pytest.mark.parametrize("n_ranks, seq_len", [(2, 20), (3, 19)])
@pytest.mark.parametrize("text_first, text_queries", [(True, True), (False, True), (True, False)])
def test_fused_loopback_with_fp8_payloads_interpreted(n_ranks, seq_len, text_first, text_queries):
    """Every payload of the exchange (q, k, v stored, the output scattered) in FP8: within the FP8 bound of
    attention over the same quantized inputs."""
    _check_loopback("cpu", torch.float32, n_ranks, 2, 5, seq_len, 2 * n_ranks, 64, text_first, TileOrder.ROTATED,
                    text_queries, fp8_payloads=True)


def test_fused_loopback_with_fp8_payloads_and_fp8_attention_interpreted():
    """Both FP8 parts at once: the payloads dequantized before FP8 attention, its output scattered as a payload."""
    _check_loopback("cpu", torch.float32, 2, 2, 5, 20, 4, 64, True, TileOrder.ROTATED, fp8=True, fp8_payloads=True)


@pytest.mark.gpu
@pytest.mark.parametrize("n_ranks", [pytest.param(2, marks=pytest.mark.smoke), 4, 8])
@pytest.mark.parametrize("text_first", [True, False])
@pytest.mark.parametrize("order", list(TileOrder))
def test_fused_loopback_with_fp8_payloads_on_gpu(n_ranks, text_first, order):
    _check_loopback("cuda", torch.bfloat16, n_ranks, 2, 77, 4093, 3 * n_ranks, 128, text_first, order,
                    fp8_payloads=True)


def test_fp8_payloads_take_the_fabric_bytes_the_planner_prices_interpreted():
    """The fabric buffers of an FP8 exchange hold sizes.fp8_payload_bytes per element where the plain exchange
    holds the model's dtype (about half of bf16, an eighth of the float32 here plus the scales)."""
    from xstage_dit.sizes import fp8_payload_bytes

    n_ranks, local, heads, head_dim = 2, 64, 4, 64
    tokens = [JointTokens((torch.randn(2, local, heads, head_dim),)) for _ in range(3)]
    held = {}
    for payloads in (False, True):
        fabric = LoopbackFabric(n_ranks, "cpu")
        next(fused_steps(*tokens, UlyssesLayout(0, n_ranks * local, local, n_ranks, 0), fabric.rank(0), None, None,
                         TileOrder.ROTATED, fp8_payloads=payloads))
        held[payloads] = fabric.workspace.nbytes
    assert held[True] / held[False] == pytest.approx(fp8_payload_bytes(head_dim) / 4, rel=0.05)


@pytest.mark.parametrize("n_ranks, seq_len", [(2, 20), (3, 19)])
@pytest.mark.parametrize("text_first", [True, False])
def test_fused_loopback_with_keys_only_text_interpreted(n_ranks, seq_len, text_first):
    _check_loopback("cpu", torch.float32, n_ranks, 2, 5, seq_len, 2 * n_ranks, 64, text_first, TileOrder.ROTATED,
                    text_queries=False)


@pytest.mark.parametrize("n_ranks, seq_len", [(2, 20), (3, 19)])
@pytest.mark.parametrize("text_first", [True, False])
@pytest.mark.parametrize("text_queries", [True, False])
def test_fused_loopback_with_norm_rope_in_the_stores_interpreted(n_ranks, seq_len, text_first, text_queries):
    _check_loopback("cpu", torch.float32, n_ranks, 2, 5, seq_len, 2 * n_ranks, 64, text_first, TileOrder.ROTATED,
                    text_queries, norm_rope=True)


def test_fused_loopback_with_split_text_parts_interpreted():
    """Flux's text split between the ranks (patches/image/flux.py JointText): each rank's sequence rows are its text
    chunk and its image chunk, two parts with their own norms, neither of them replicated text."""
    n_ranks, batch, local, text_rows, heads, head_dim = 2, 2, 10, 3, 4, 64
    fabric = LoopbackFabric(n_ranks, "cpu", initialise=lambda t: t.fill_(float("nan")))

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.float32)

    weights, eps = [1 + randn(head_dim) / 2 for _ in range(2)], (1e-6, 1e-5)
    tokens, full = [[], [], []], [[], [], []]
    for rank in range(n_ranks):
        angles = 10 * torch.rand(local, head_dim)
        cos, sin = angles.cos(), angles.sin()
        for which in range(3):
            parts = (randn(batch, text_rows, heads, head_dim), randn(batch, local - text_rows, heads, head_dim))
            if which == 2:  # v: joined only
                tokens[which].append(JointTokens(parts))
                full[which] += parts
                continue
            tokens[which].append(JointTokens.normed_and_rotated(
                [NormedTokens(part, weight, e) for part, weight, e in zip(parts, weights, eps)], cos, sin))
            full[which] += [_norm_rope_reference(parts[0], weights[0], eps[0], cos[:text_rows], sin[:text_rows]),
                            _norm_rope_reference(parts[1], weights[1], eps[1], cos[text_rows:], sin[text_rows:])]
    outs = run_in_lockstep(
        [fused_steps(*(t[rank] for t in tokens), UlyssesLayout(0, n_ranks * local, local, n_ranks, rank),
                     fabric.rank(rank), None, None, TileOrder.ROTATED) for rank in range(n_ranks)],
        fabric.rank(0).barrier)
    ref, _ = _reference(*(torch.cat(f, dim=1) for f in full), n_ranks * local)
    for rank in range(n_ranks):
        expected = ref[:, rank * local : (rank + 1) * local]
        assert relative_error(outs[rank], expected) < TOLERANCE[torch.float32], f"rank {rank}"


def _check_loopback_norm_across_heads(device, dtype, n_ranks, seq_len, heads, head_dim):
    """Wan's q and k: one part each, normalised over a token's whole vector (every head) and rotated in the
    stores, against the model's order of operations (RMSNorm module, then the rotation) in float32."""
    from diffusers.models.embeddings import apply_rotary_emb

    batch, local = 2, -(-seq_len // n_ranks)
    fabric = LoopbackFabric(n_ranks, device, initialise=lambda t: t.fill_(float("nan")))
    full = [torch.randn(batch, seq_len, heads, head_dim, device=device, dtype=dtype) for _ in range(3)]
    weights = [1 + torch.randn(heads * head_dim, device=device, dtype=dtype) / 2 for _ in range(2)]
    angles = 10 * torch.rand(n_ranks * local, head_dim, device=device)
    cos, sin = angles.cos(), angles.sin()

    def chunk(x, rank):
        return F.pad(x, (0, 0, 0, 0, 0, n_ranks * local - x.shape[1]))[:, rank * local : (rank + 1) * local]

    tokens = [[JointTokens((chunk(t, rank),), NormRope((w,), (1e-6,), chunk(cos[None, :, None], rank)[0, :, 0],
                                                         chunk(sin[None, :, None], rank)[0, :, 0], across_heads=True))
               for rank in range(n_ranks)] for t, w in zip(full, weights)]
    tokens.append([JointTokens((chunk(full[2], rank),)) for rank in range(n_ranks)])
    outs = run_in_lockstep(
        [fused_steps(*(t[rank] for t in tokens), UlyssesLayout(0, seq_len, local, n_ranks, rank), fabric.rank(rank),
                     None, None, TileOrder.ROTATED) for rank in range(n_ranks)],
        fabric.rank(0).barrier)
    for which, weight in enumerate(weights):
        normed = F.rms_norm(full[which].flatten(2), weight.shape, weight, 1e-6).unflatten(2, (heads, head_dim))
        full[which] = apply_rotary_emb(normed.float(), (cos[:seq_len], sin[:seq_len]), sequence_dim=1).to(dtype)
    ref, _ = _reference(*full, seq_len)
    for rank in range(n_ranks):
        rows = min(local, seq_len - rank * local)
        out = outs[rank][:, :rows]
        assert not out.isnan().any(), f"rank {rank}: unwritten output rows"
        assert relative_error(out, ref[:, rank * local : rank * local + rows]) < TOLERANCE[dtype], f"rank {rank}"


@pytest.mark.parametrize("n_ranks, seq_len", [(2, 20), (3, 19)])
def test_fused_loopback_with_a_norm_across_heads_interpreted(n_ranks, seq_len):
    _check_loopback_norm_across_heads("cpu", torch.float32, n_ranks, seq_len, 2 * n_ranks, 64)


@pytest.mark.gpu
# the float64 reference holds every score: sequences of a few thousand tokens (the real sizes run in test_gpu.py)
@pytest.mark.parametrize("n_ranks, seq_len, heads", [(2, 4093, 12), (4, 4093, 12), (8, 4093, 40)])
def test_fused_loopback_with_a_norm_across_heads_on_gpu(n_ranks, seq_len, heads):
    _check_loopback_norm_across_heads("cuda", torch.bfloat16, n_ranks, seq_len, heads, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("n_ranks", [2, 4, 8])
@pytest.mark.parametrize("text_first", [True, False])
@pytest.mark.parametrize("order", list(TileOrder))
@pytest.mark.parametrize("text_queries", [True, False])
@pytest.mark.parametrize("norm_rope", [False, True])
def test_fused_loopback_on_gpu(n_ranks, text_first, order, text_queries, norm_rope):
    _check_loopback("cuda", torch.bfloat16, n_ranks, 2, 77, 4093, 3 * n_ranks, 128, text_first, order, text_queries,
                    norm_rope)


@pytest.mark.gpu
@pytest.mark.parametrize("n_ranks", [pytest.param(2, marks=pytest.mark.smoke), 8])
@pytest.mark.parametrize("text_first", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_loopback_in_fp8_on_gpu(n_ranks, text_first, head_dim):
    _check_loopback("cuda", torch.bfloat16, n_ranks, 2, 77, 4093, 3 * n_ranks, head_dim, text_first,
                    TileOrder.ROTATED, fp8=True)


def _one_key_per_query(batch, query_rows, key_rows, kv_len, heads, head_dim, device):
    """q, k, v (B, rows, H, D), bf16, on which attention is exact whichever kernel computes it: key j's code is
    e_(j // 64) + e_(64 + j % 64) (head_dim 128: 4096 codes), each query row 2048 times the code of one key drawn
    below kv_len, so that its score is 4096 and any other key's at most 2048, whose weight (2^-261 of the
    chosen key's) is 0 in float32: every output row is one value row, copied."""
    half = head_dim // 2
    assert head_dim == 128 and key_rows <= half * half
    keys = torch.arange(key_rows, device=device)
    codes = torch.zeros(key_rows, head_dim, device=device)
    codes[keys, keys // half] = 1
    codes[keys, half + keys % half] = 1
    chosen = torch.randint(0, kv_len, (batch, query_rows, heads), device=device)
    q = (2048 * codes[chosen]).to(torch.bfloat16)
    k = codes[None, :, None].expand(batch, key_rows, heads, head_dim).to(torch.bfloat16).contiguous()
    v = torch.randn(batch, key_rows, heads, head_dim, device=device, dtype=torch.bfloat16)
    return q, k, v


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Hopper kernel needs an sm_90 GPU")
@pytest.mark.parametrize("n_ranks", [2, 4, 8])
@pytest.mark.parametrize("text_first", [True, False])
@pytest.mark.parametrize("order", list(TileOrder))
@pytest.mark.parametrize("text_queries", [True, False])
@pytest.mark.parametrize("payload", [False, True])
def test_triton_and_gluon_scatter_epilogues_store_the_same_bytes(n_ranks, text_first, order, text_queries, payload):
    """The post-all-to-all of the fused backend from either kernel (flash_attention runs the Gluon one on Hopper,
    the Triton one elsewhere), N simulated ranks over a loopback fabric: on the same head-sharded inputs, on which
    both compute the same bits, every rank's output buffer holds the same bytes, every element written (`payload`:
    an FP8 payload, and its scale buffer too)."""
    batch, text_len, seq_len, head_dim = 2, 77, 1501, 128
    heads, local = 2 * n_ranks, -(-seq_len // n_ranks)
    layouts = [UlyssesLayout(text_len, seq_len, local, n_ranks, rank, text_first, text_queries)
               for rank in range(n_ranks)]
    first = layouts[0]
    q, k, v = _one_key_per_query(batch, first.query_gathered_len, first.gathered_len, first.key_len, heads,
                                 head_dim, "cuda")
    share = heads // n_ranks
    rows = (batch, first.query_text_len + local, heads)
    out_views = [View("out", (*rows, head_dim), PAYLOAD_DTYPE if payload else torch.bfloat16)]
    out_views += [View("scales", rows, SCALE_DTYPE)] if payload else []
    outs = {}
    for config in (TileConfig(tma=True), HopperConfig()):
        fabric = LoopbackFabric(n_ranks, "cuda", initialise=lambda t: t.fill_(float("nan")))
        for rank, layout in enumerate(layouts):
            mine = slice(rank * share, (rank + 1) * share)
            buffers = fabric.rank(rank).carve(out_views)
            out = buffers["out"]
            scales = PayloadScales.of(buffers["scales"].tensor, buffers["scales"].destinations) if payload else None
            flash_attention(*(t[:, :, mine].contiguous() for t in (q, k, v)), kv_len=layout.key_len,
                            epilogue=layout.output_scatter(out.tensor, out.destinations, share, order, scales),
                            config=config)
        outs[type(config)] = [fabric.tensors(out_views, view.name) for view in out_views]
    for triton_buffers, gluon_buffers in zip(outs[TileConfig], outs[HopperConfig]):
        for rank, (triton_out, gluon_out) in enumerate(zip(triton_buffers, gluon_buffers)):
            assert not triton_out.float().isnan().any(), f"rank {rank}: unwritten output"
            assert torch.equal(triton_out.view(torch.uint8), gluon_out.view(torch.uint8)), f"rank {rank}"


def _check_rotary(device, dtype, shape, sequence_dim, strided, tolerance):
    """Our RoPE kernel against diffusers' apply_rotary_emb on fresh random inputs."""
    from diffusers.models.embeddings import apply_rotary_emb

    from xstage_dit.kernels.rotary import rotary_interleaved

    x = torch.randn(*shape, device=device, dtype=dtype)
    if strided:  # a slice along the tokens, as HunyuanVideo rotates its image tokens: an offset view, strided
        x = x.narrow(sequence_dim, 1, shape[sequence_dim] - 2)  # where there is more than one batch
    tokens, head_dim = x.shape[sequence_dim], x.shape[-1]
    cos, sin = (torch.randn(tokens, head_dim, device=device) for _ in range(2))
    out = rotary_interleaved(x, cos, sin, sequence_dim)
    # the float32 result diffusers' code rounds once, as the kernel does
    ref = apply_rotary_emb(x.float(), (cos, sin), sequence_dim=sequence_dim)
    assert out.dtype == x.dtype and out.shape == x.shape
    error = ((out.float() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()
    assert error <= tolerance, f"max relative error {error:.2e}"


def _check_norm_rope(device, dtype, batch, lengths, heads, head_dim, strided, tolerance):
    """Our norm + RoPE kernel against torch's RMSNorm per part, concatenation and diffusers' apply_rotary_emb, on
    fresh random inputs (the norm's output rounded to the input dtype, as the modules' is)."""
    from diffusers.models.embeddings import apply_rotary_emb

    from xstage_dit.kernels.rotary import norm_rope_accepts, norm_rotate
    from xstage_dit.kernels.rotary_args import NormedTokens

    parts = []
    for i, length in enumerate(lengths):
        tokens = 3 * torch.randn(batch, length, heads * (2 if strided else 1), head_dim, device=device, dtype=dtype)
        if strided:  # every other head of a wider projection: strided along the heads
            tokens = tokens[:, :, ::2]
        weight = 1 + torch.randn(head_dim, device=device, dtype=dtype) / 2
        parts.append(NormedTokens(tokens, weight, eps=10.0 ** -(5 + i)))
    angles = 10 * torch.rand(sum(lengths), head_dim, device=device)
    cos, sin = angles.cos(), angles.sin()
    assert norm_rope_accepts(parts, cos, sin)
    out = norm_rotate(parts, cos, sin)
    normed = torch.cat([torch.nn.functional.rms_norm(p.tokens, (head_dim,), p.weight, p.eps) for p in parts], 1)
    ref = apply_rotary_emb(normed.float(), (cos, sin), sequence_dim=1)
    assert out.dtype == dtype and out.shape == (batch, sum(lengths), heads, head_dim)
    error = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert error <= tolerance, f"max error {error:.2e} of the largest value"


@pytest.mark.parametrize("lengths", [(37,), (5, 33), (1, 300)])
@pytest.mark.parametrize("strided", [False, True])
def test_norm_rope_interpreted(lengths, strided):
    _check_norm_rope("cpu", torch.float32, 2, lengths, 3, 16, strided, tolerance=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lengths, heads, head_dim", [((4608,), 24, 128), ((512, 2304), 12, 128), ((77, 4093), 3, 64)])
@pytest.mark.parametrize("strided", [False, True])
def test_norm_rope_on_gpu(dtype, lengths, heads, head_dim, strided):
    # both round the norm's output (where torch's RMSNorm and ours may differ by one rounding, which the rotation
    # carries into the result) and then the result: within one ulp of the largest value
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    _check_norm_rope("cuda", dtype, 1, lengths, heads, head_dim, strided, tolerance=ulp)


@pytest.mark.parametrize("shape, sequence_dim", [((2, 37, 3, 128), 1), ((2, 5, 19, 64), 2), ((1, 300, 4, 16), 1)])
@pytest.mark.parametrize("strided", [False, True])
def test_rotary_interpreted(shape, sequence_dim, strided):
    _check_rotary("cpu", torch.float32, shape, sequence_dim, strided, tolerance=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape, sequence_dim", [((1, 4608, 24, 128), 1), ((2, 24, 1001, 128), 2),
                                                 ((1, 4097, 3, 64), 1)])
@pytest.mark.parametrize("strided", [False, True])
def test_rotary_on_gpu(dtype, shape, sequence_dim, strided):
    # one rounding to bf16 / fp16 (half an ulp of the result), plus a margin for float32 reassociation
    half_ulp = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    _check_rotary("cuda", dtype, shape, sequence_dim, strided, tolerance=1.05 * half_ulp)
