"""GPU checks (marked `gpu`, skipped without CUDA; run on the device machine with .ci/device.sh).

bf16 tolerances: SDPA in bf16 against a float32 reference lands near 1e-3..1e-2 relative; a pipeline whose
attention kernel changes (cuDNN here, whatever SDPA picks in stock diffusers) drifts a little more over steps."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks, share_one_gpu
from gpu_checks import PIPELINE_TOLERANCE, SIZES, generate, same_gpu_worker
from numerics import relative_error
from xstage_dit.sp.attention.local import sdpa_bshd

pytestmark = pytest.mark.gpu
ATTENTION_TOLERANCE = 1e-2


@pytest.mark.parametrize("q_len, kv_len, heads, head_dim", [(4096, 4096, 24, 128), (1000, 777, 5, 64)])
def test_best_sdpa_matches_float32(q_len, kv_len, heads, head_dim):
    q = torch.randn(1, q_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, kv_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, kv_len, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    ref = torch.softmax(torch.einsum("bqhd,bkhd->bhqk", q.double(), k.double()) / head_dim**0.5, dim=-1)
    ref = torch.einsum("bhqk,bkhd->bqhd", ref, v.double())
    assert relative_error(sdpa_bshd(q, k, v), ref) < ATTENTION_TOLERANCE


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.smoke) for name in [
    "tiny-flux", "tiny-wan", "tiny-nucleusmoe", "tiny-flux2", "tiny-zimage", "tiny-chroma", "tiny-ltx2",
    "tiny-hunyuan-video15", "tiny-wan2.2-ti2v", "tiny-wan-vace", "tiny-qwenimage-edit-2511", "tiny-qwenimage21",
    "tiny-flux-multi-controlnet", "tiny-flux2-klein-kv", "tiny-qwenimage-controlnet", "tiny-zimage-controlnet"]])
def test_degree_one_on_gpu_matches_stock(name):
    pipe = zoo.build_pipeline(name, device="cuda", dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    stock = generate(pipe, name, SIZES[name])
    xstage_dit.enable(pipe)
    try:
        assert relative_error(generate(pipe, name, SIZES[name]), stock) < PIPELINE_TOLERANCE
    finally:
        xstage_dit.disable(pipe)


@pytest.mark.parametrize(
    "name, backend, world_size",
    [pytest.param("tiny-flux", "reference", 2, marks=pytest.mark.smoke)]
    + [(name, "reference", 2) for name in ("tiny-wan", "tiny-hunyuan-video")]
    + [pytest.param("tiny-flux", "overlap", 2, marks=pytest.mark.smoke), ("tiny-wan", "overlap", 4)]
    # head_dim 64 runs the fused kernels; head_dim 16 (tiny-hunyuan-video) checks the fallback to reference
    + [pytest.param("tiny-flux-d64", "fused", 2, marks=pytest.mark.smoke), ("tiny-flux-d64", "fused", 4)]
    + [(name, "fused", n) for name in ("tiny-wan-d64", "tiny-hunyuan-video") for n in (2, 4)]
    # keys-only text (queries are the image tokens), grouped-query attention and exact expert choice
    + [("tiny-nucleusmoe", "reference", 2), ("tiny-nucleusmoe-d64", "fused", 2)]
    # image-only refiner attention, then [image, caption] with the captions' padding masks (batch 2)
    + [("tiny-zimage", "reference", 2), ("tiny-zimage-d64", "fused", 3)]
    # pair-bias masks: the fused choice runs the reference backend, with one warning
    + [("tiny-chroma", "fused", 2)]
    # a video and an audio stream; video-to-audio attention over the gathered video keys
    + [("tiny-ltx2", "reference", 2)]
    # ControlNets (the residuals handed over split; fused kernels at head_dim 64), FLUX.2's reference KV cache
    + [("tiny-flux-multi-controlnet-d64", "fused", 2), ("tiny-qwenimage-controlnet", "reference", 3),
       ("tiny-zimage-controlnet", "reference", 3), ("tiny-flux2-klein-kv", "reference", 2)],
)
def test_ranks_on_one_gpu_match_single_process(name, backend, world_size):
    run_on_ranks(world_size, same_gpu_worker, name, backend, deadline_s=150)


@pytest.mark.parametrize("world_size", [2, 4])
def test_expert_stores_on_one_gpu_match_single_process(world_size):
    """NucleusMoE with its experts sharded over the fused backend's fabric: the X-Stage dispatch and combine
    stores, batch 2 (CFG), against the single process."""
    run_on_ranks(world_size, same_gpu_worker, "tiny-nucleusmoe-d64", "fused", None, True, deadline_s=150)


@pytest.mark.smoke
def test_auto_follows_the_planner_on_one_gpu(tmp_path, monkeypatch):
    """A same-GPU calibration (synthetic costs: for tiny layers the fused path's few launches win) makes auto
    choose fused for every layer, and the result still equals the single process."""
    from xstage_dit.burst_gap import BurstGapModel, Calibration, KernelCosts

    rates = {64: [(4096, 300.0)], 128: [(4096, 500.0)]}
    costs = KernelCosts(rates, rates, copy_rate=2e12, alltoall_rate=2e12, launch=5e-6, sms=132)
    model = BurstGapModel(1e-6, 20e9, 2e12, 1e12, 8 * 2**20)
    Calibration(torch.cuda.get_device_name(), "same-gpu", 2, model, costs, {}).save(tmp_path)
    monkeypatch.setenv("XSTAGE_CALIBRATION_DIR", str(tmp_path))
    run_on_ranks(2, same_gpu_worker, "tiny-flux-d64", "auto", "fused", deadline_s=150)


def _qwenimage21_gpu_worker(backend: str) -> None:
    """Qwen-Image 2.1's transformer (head_dim 64) in bf16, with its KV cache's two calls, against the stock model
    on this GPU: at degree 1 in one process, split where ranks share the GPU."""
    from diffusers import QwenImage21Transformer2DModel
    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
    from pipeline_checks import QWENIMAGE21_CONFIG, qwenimage21_inputs

    if "RANK" in os.environ:  # one of run_on_ranks' processes
        share_one_gpu()
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = QwenImage21Transformer2DModel(**{**QWENIMAGE21_CONFIG, "attention_head_dim": 64,
                                             "axes_dims_rope": (16, 24, 24)}).to("cuda", torch.bfloat16).eval()
    inputs = {k: v.to("cuda", torch.bfloat16 if v.is_floating_point() else v.dtype) if torch.is_tensor(v) else v
              for k, v in qwenimage21_inputs(64, 48, torch.Generator().manual_seed(5)).items()}

    def run() -> list[torch.Tensor]:
        cache = QwenImage21KVCache(len(model.transformer_blocks))
        return [model(**inputs, kv_cache=cache, kv_cache_mode="extract")[0],
                model(**inputs, kv_cache=cache, kv_cache_mode="cached")[0]]

    with torch.no_grad():
        refs = run()
        xstage_dit.enable(model, backend=backend, timeout_s=60)
        outs = run()
        xstage_dit.disable(model)
    for mode, out, ref in zip(("prefill", "cached"), outs, refs):
        error = relative_error(out, ref)
        assert error < ATTENTION_TOLERANCE, f"Qwen-Image 2.1 {backend} {mode}: relative error {error:.2e}"


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_qwenimage21_transformer_on_gpu_degree_one(backend):
    _qwenimage21_gpu_worker(backend)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_qwenimage21_transformer_ranks_on_one_gpu(backend):
    run_on_ranks(2, _qwenimage21_gpu_worker, backend, deadline_s=150)


def _fused_layer_worker(batch: int, text_len: int, seq_len: int, heads: int, head_dim: int) -> None:
    """One real-size attention layer through the fused backend, against float32 SDPA of the whole sequence."""
    share_one_gpu()
    dist.init_process_group("gloo")
    from xstage_dit.sp.fabric import open_fabric
    from xstage_dit.sp.attention.fused import fused_ulysses
    from xstage_dit.sp.attention.layout import UlyssesLayout

    rank, n_ranks = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator(device="cuda").manual_seed(11)
    full = [torch.randn(batch, text_len + seq_len, heads, head_dim, device="cuda", dtype=torch.bfloat16,
                        generator=generator) for _ in range(3)]
    local = -(-seq_len // n_ranks)
    layout = UlyssesLayout(text_len, seq_len, local, n_ranks, rank)
    mine = [torch.cat([t[:, :text_len], torch.nn.functional.pad(t[:, text_len:], (0, 0, 0, 0, 0, local * n_ranks
                       - seq_len))[:, rank * local : (rank + 1) * local]], dim=1) for t in full]
    open_fabric(dist.group.WORLD, torch.device("cuda"), timeout_s=60)
    out = fused_ulysses(*mine, layout, dist.group.WORLD, None, None)
    ref = sdpa_bshd(*(t.float() for t in full))
    rows = min(local, seq_len - rank * local)
    expected = torch.cat([ref[:, :text_len], ref[:, text_len + rank * local : text_len + rank * local + rows]], 1)
    error = relative_error(out[:, : text_len + rows], expected)
    assert error < ATTENTION_TOLERANCE, f"rank {rank}/{n_ranks}: relative error {error:.2e}"


@pytest.mark.parametrize("shape", [(1, 512, 4096, 24, 128), (1, 0, 75600, 40, 128)], ids=["flux-1024", "wan14b-720p"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_fused_real_size_layer_on_one_gpu(shape, world_size):
    run_on_ranks(world_size, _fused_layer_worker, *shape, deadline_s=200)


def _joint_op_worker(backend: str, family: str) -> None:
    """A real-size layer with q and k handed over before their prologue (xstage::ulysses_attention with tables),
    against the same op on the tensors joined first: Flux's (text and image parts, a norm per head vector) and
    Wan's (one part, a norm over every head). The reference backend joins them that way itself (bit-equal), the
    fused one in its stores (within bf16 rounding of the norm)."""
    share_one_gpu()
    dist.init_process_group("gloo")
    from xstage_dit.kernels.rotary import norm_rotate, rotary_interleaved
    from xstage_dit.kernels.rotary_args import JointTokens, NormedTokens, NormRope
    from xstage_dit.sp.attention import ops
    from xstage_dit.sp.fabric import open_fabric
    from xstage_dit.sp.attention.layout import UlyssesLayout

    rank, n_ranks = dist.get_rank(), dist.get_world_size()
    flux = family == "flux"
    text_len, local, heads, head_dim = (512, 2048, 24, 128) if flux else (0, 16380, 12, 128)
    generator = torch.Generator(device="cuda").manual_seed(21 + rank)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    rows = (text_len, local) if flux else (local,)
    q_parts, k_parts, v_parts = ([randn(1, n, heads, head_dim) for n in rows] for _ in range(3))
    width = head_dim if flux else heads * head_dim
    weights = [1 + randn(width) / 2 for _ in range(2 * len(rows))]
    eps = [1e-6] * len(rows) + [1e-5] * len(rows)
    angles = 10 * torch.rand(text_len + local, head_dim, device="cuda", generator=generator)
    cos, sin = angles.cos(), angles.sin()
    layout = UlyssesLayout(text_len, local * n_ranks, local, n_ranks, rank)
    open_fabric(dist.group.WORLD, torch.device("cuda"), timeout_s=60)
    common = dict(text_mask=None, backend=backend, group=dist.group.WORLD, scale=None, attention_backend=None)

    def prologue(parts, first):
        return JointTokens(tuple(parts), NormRope(tuple(weights[first:first + len(rows)]),
                                                  tuple(eps[first:first + len(rows)]), cos, sin,
                                                  across_heads=not flux))

    out = ops.ulysses_attention(prologue(q_parts, 0), prologue(k_parts, len(rows)), JointTokens(tuple(v_parts)),
                                layout, **common)

    def joined(parts, first):
        if flux:
            return norm_rotate([NormedTokens(t, w, e) for t, w, e in zip(parts, weights[first:], eps[first:])],
                               cos, sin)
        normed = torch.nn.functional.rms_norm(parts[0].flatten(2), (width,), weights[first], eps[first])
        return rotary_interleaved(normed.unflatten(2, (heads, head_dim)), cos, sin, 1)

    q, k = joined(q_parts, 0), joined(k_parts, len(rows))
    expected = ops.ulysses_attention(JointTokens((q,)), JointTokens((k,)), JointTokens((torch.cat(v_parts, dim=1),)),
                                     layout, **common)
    if backend == "reference":
        assert torch.equal(out, expected), f"rank {rank}: differs from the joined tensors' call"
    else:
        error = relative_error(out, expected)
        assert error < 2e-3, f"rank {rank}/{n_ranks}: relative error {error:.2e}"


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("family", ["flux", "wan"])
def test_joint_attention_op_on_one_gpu(backend, family):
    run_on_ranks(2, _joint_op_worker, backend, family, deadline_s=200)


def _graph_replay_worker(text_len: int, seq_len: int, heads: int) -> None:
    """The fused backend captured in a CUDA graph on one input and replayed on fresh ones: every replay equals
    the eager call on the same input bit for bit (its barriers wait anew on every replay: the epochs advance on
    the device)."""
    share_one_gpu()
    dist.init_process_group("gloo")
    from xstage_dit.sp.fabric import open_fabric
    from xstage_dit.sp.attention.fused import fused_ulysses
    from xstage_dit.sp.attention.layout import UlyssesLayout

    rank, n_ranks = dist.get_rank(), dist.get_world_size()
    local = -(-seq_len // n_ranks)
    layout = UlyssesLayout(text_len, seq_len, local, n_ranks, rank)
    generator = torch.Generator(device="cuda").manual_seed(100 + rank)

    def fresh() -> list[torch.Tensor]:
        return [torch.randn(1, text_len + local, heads, 128, device="cuda", dtype=torch.bfloat16,
                            generator=generator) for _ in range(3)]

    open_fabric(dist.group.WORLD, torch.device("cuda"), timeout_s=60)
    static = fresh()

    def call(tensors: list[torch.Tensor]) -> torch.Tensor:
        return fused_ulysses(*tensors, layout, dist.group.WORLD, None, None).clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
        call(static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        captured = call(static)
    for trial in range(3):
        inputs = fresh()
        for target, source in zip(static, inputs):
            target.copy_(source)
        graph.replay()
        replayed = captured.clone()
        expected = call(inputs)
        torch.cuda.synchronize()
        assert torch.equal(replayed, expected), f"rank {rank}, replay {trial}: differs from the eager call"


@pytest.mark.parametrize("text_len, seq_len", [pytest.param(512, 4096, marks=pytest.mark.smoke), (77, 4093)],
                         ids=["flux-1024", "uneven"])
def test_fused_backend_replays_in_a_cuda_graph(text_len, seq_len):
    run_on_ranks(2, _graph_replay_worker, text_len, seq_len, 24, deadline_s=200)

