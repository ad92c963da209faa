"""The fp8 knob: what it accepts and refuses (in words, before any collective), the step policy
(fp8_full_precision_steps), fp8="linear"'s choice of layers, its per-step switch, and `disable`'s exact
restoration.

No FP8 GEMM runs on a CPU, so the CPU tests give the production path one substitute (`fp8_on_cpu`): the layers
are quantized with torchao's float8 weight-only config (float8 weights, computed in bf16), which runs here;
everything else (the choice of layers, the quantization through torchao, the switch, the step callback, the
restoration) is what runs on a GPU. The GPU tests run the real FP8 GEMMs (torchao's rowwise float8 dynamic config),
compiled and in CUDA graphs."""
from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline
from torch import nn

import xstage_dit
from xstage_dit import api
from xstage_dit.precision import linear
from xstage_dit.precision.linear import SwitchedLinear, fp8_layers
from xstage_dit.precision.steps import runs_fp8
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks, share_one_gpu
from gpu_checks import SIZES
from numerics import relative_error

pytest.importorskip("torchao", reason="fp8='linear' runs torchao's FP8 weights")

STEPS = 4
# tiny FLUX.1 and Wan in bf16 on one GPU, FP8 GEMMs with rowwise scales against stock bf16, over STEPS steps
FP8_TOLERANCE = 0.1
# a call replayed from CUDA graphs against the same call run eagerly: the same kernels on the same inputs
GRAPHS_TOLERANCE = 1e-3


@pytest.fixture
def fp8_on_cpu(monkeypatch):
    """The layers quantized with torchao's float8 weight-only config, and the device check passed (the module
    docstring says why)."""
    from torchao.quantization import Float8WeightOnlyConfig

    monkeypatch.setattr(linear, "why_no_fp8_gemms", lambda device: None)
    monkeypatch.setattr(linear, "quantization_config", Float8WeightOnlyConfig)


def bf16_pipeline(name: str = "tiny-flux", device: str = "cpu"):
    pipe = zoo.build_pipeline(name, device=device, dtype=torch.bfloat16)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def latents(pipe, name: str = "tiny-flux", steps: int = STEPS, size: dict | None = None, **call) -> torch.Tensor:
    """The pipeline's latents for fixed prompt embeddings and noise."""
    kwargs = zoo.call_kwargs(name, **(size or SIZES["tiny-flux"]), steps=steps, guidance=3.0)
    embeddings = zoo.text_embeddings(name, 1, seed=0, device=pipe.device, dtype=torch.bfloat16)
    return pipe(**kwargs, **embeddings, output_type="latent", generator=torch.Generator().manual_seed(0),
                return_dict=False, **call)[0]


def test_the_first_and_last_k_steps_run_in_full_precision():
    def schedule(steps: int, k: int) -> str:
        return "".join("8" if runs_fp8(step, steps, k) else "-" for step in range(steps))

    assert schedule(4, 0) == "8888" and schedule(1, 0) == "8"
    assert schedule(4, 1) == "-88-" and schedule(3, 1) == "-8-" and schedule(28, 1) == "-" + "8" * 26 + "-"
    assert schedule(5, 2) == "--8--" and schedule(6, 2) == "--88--"
    # N <= 2k: every step in full precision
    assert schedule(2, 1) == "--" and schedule(1, 1) == "-" and schedule(4, 2) == "----" and schedule(3, 2) == "---"


@pytest.fixture
def two_ranks(monkeypatch):
    """Rank 0 of a two-rank job, without a group: every refusal must come before one is started."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")


def test_fp8_payloads_without_their_backend_and_fp8_linear_on_a_cpu_are_refused_in_words(two_ranks):
    pipe = zoo.build_pipeline("tiny-flux")
    for fp8 in ("linear", "all"):
        with pytest.raises(ValueError, match=r"fp8='linear' runs torchao's FP8 GEMMs, which need a CUDA GPU of "
                                             r"compute capability 8.9 or above; this rank runs on cpu"):
            xstage_dit.enable(pipe, fp8=fp8)
    with pytest.raises(ValueError, match=r"fp8=\"payloads\": backend 'reference' sends no FP8 payloads"):
        xstage_dit.enable(pipe, fp8="all", backend="reference")
    assert not torch.distributed.is_initialized()
    assert xstage_dit.installed_layers(pipe) == []


def test_what_fp8_linear_cannot_take_is_refused_in_words(two_ranks, fp8_on_cpu):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    float32 = zoo.build_pipeline("tiny-flux")
    with pytest.raises(ValueError, match=r"fp8='linear' runs a bfloat16 model's projections in FP8; "
                                         r"FluxTransformer2DModel is torch.float32"):
        xstage_dit.enable(float32, fp8="linear")
    quantized = bf16_pipeline()
    quantize_(quantized.transformer, Int8WeightOnlyConfig())
    with pytest.raises(ValueError, match=r"quantizes FluxTransformer2DModel's Linear layers itself, and "
                                         r"FluxTransformer2DModel is quantized already \(it holds its .*weight as a "
                                         r"torchao.*Int8Tensor"):
        xstage_dit.enable(quantized, fp8="linear")
    pipe = bf16_pipeline()
    with pytest.raises(ValueError, match=r"fp8_full_precision_steps=1 counts the steps of a pipeline call through "
                                         r"its callback_on_step_end; enable was given a bare transformer"):
        xstage_dit.enable(pipe.transformer, fp8="linear", fp8_full_precision_steps=1)
    with pytest.raises(ValueError, match=r"fp8=.linear. quantizes the experts. Linear layers, which "
                                         r"expert_parallel=True cannot shard"):
        xstage_dit.enable(pipe, fp8="linear", expert_parallel=True)
    assert not torch.distributed.is_initialized()


def test_an_activation_row_of_zeros_quantizes_to_zeros():
    """Padding tokens reach projections as rows of zeros (tiny Z-Image's attention projections see some): with
    torchao's default the row's scale is 0 and it quantizes to 0 / 0, NaN; fp8="linear"'s config floors the scale
    (torchao's own scale and quantization functions, as its dynamic activation quantization calls them)."""
    from torchao.quantization.quant_primitives import (_choose_scale_float8, _dequantize_affine_float8,
                                                       _quantize_affine_float8)

    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x[1] = 0

    def round_trip(config) -> torch.Tensor:
        scale = _choose_scale_float8(x, [1, x.shape[1]], hp_value_lb=config.activation_value_lb)
        return _dequantize_affine_float8(_quantize_affine_float8(x, scale), scale)

    assert round_trip(linear.quantization_config(floored=False))[1].isnan().all()
    floored = round_trip(linear.quantization_config())
    assert floored.isfinite().all() and (floored[1] == 0).all()
    torch.testing.assert_close(floored, x.float(), rtol=0.07, atol=0)  # e4m3: within 2^-4 of each value


def test_the_layers_that_run_fp8():
    """The projections of the blocks; not the modulation projections (diffusers' skip patterns), the layers
    outside the blocks, layers kept in float32, shapes FP8 GEMMs cannot take."""
    flux = bf16_pipeline().transformer
    flux.single_transformer_blocks[0].attn.to_q.float()
    flux.transformer_blocks[0].attn.to_k = nn.Linear(192, 200, dtype=torch.bfloat16)  # 200: not a multiple of 16
    choice = fp8_layers(flux)
    block = "transformer_blocks.0."
    assert sorted(choice.chosen) == sorted(
        [f"{block}attn.{n}" for n in ("to_q", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                                      "to_add_out")]
        + [f"{block}{ff}.{n}" for ff in ("ff", "ff_context") for n in ("net.0.proj", "net.2")]
        + [f"single_{block}{n}" for n in ("proj_mlp", "proj_out", "attn.to_k", "attn.to_v")])
    assert choice.skipped == {
        "outside the repeated blocks": [
            *(f"time_text_embed.{e}.linear_{i}" for e in ("timestep_embedder", "guidance_embedder", "text_embedder")
              for i in (1, 2)), "context_embedder", "x_embedder", "proj_out"],
        "diffusers' layerwise-casting skip patterns": [f"{block}norm1.linear", f"{block}norm1_context.linear",
                                                       f"single_{block}norm.linear", "norm_out.linear"],
        "features not a multiple of 16": [f"{block}attn.to_k"],
        "kept in float32": [f"single_{block}attn.to_q"]}
    wan = bf16_pipeline("tiny-wan").transformer
    wan.blocks[1].ffn.net[0].proj.float()
    wan_choice = fp8_layers(wan)
    assert len(wan_choice.chosen) == 2 * 10 - 1 and "blocks.0.ffn.net.0.proj" in wan_choice.chosen  # 8 + 2 a block
    assert wan_choice.skipped["kept in float32"] == [  # Wan's _keep_in_fp32_modules names its time embedder
        "condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2",
        "blocks.1.ffn.net.0.proj"]
    assert all(name.startswith("condition_embedder") or name == "proj_out"
               for reason, names in wan_choice.skipped.items() if reason != "kept in float32" for name in names)


def module_states(model: nn.Module) -> list[tuple]:
    """Each module's class, instance attributes and non-persistent buffers' names, and each parameter and buffer:
    the object, its class, dtype, device and values."""
    return [(name, type(module), sorted(module.__dict__.keys() - {api._STATE_ATTR, "_xstage_dit_layers"}),
             sorted(module._non_persistent_buffers_set),
             [(key, id(t), type(t), t.dtype, t.device, t.detach().clone())
              for key, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]])
            for name, module in model.named_modules()]


def assert_same_states(now: list[tuple], then: list[tuple]) -> None:
    assert len(now) == len(then)
    for a, b in zip(now, then):
        assert a[:4] == b[:4], (a[:4], b[:4])
        assert [t[:5] for t in a[4]] == [t[:5] for t in b[4]], a[0]
        assert all(torch.equal(x[5], y[5]) for x, y in zip(a[4], b[4])), a[0]


@pytest.mark.parametrize("full_precision_steps", [0, 1])
def test_fp8_linear_runs_torchao_weights_and_disable_restores_exactly(fp8_on_cpu, full_precision_steps):
    """k = 0: the chosen layers hold torchao's float8 weights (the originals on the host), and the pipeline computes
    what it computes quantized by torchao's `quantize_` alone, bit for bit; k = 1 over 2 steps: every step in full
    precision, bit for bit the unquantized result. `disable` gives back every parameter object with its values,
    dtype and device, and every module its class and attributes."""
    from torchao.quantization import Float8Tensor, Float8WeightOnlyConfig, quantize_

    pipe = bf16_pipeline()
    stock = latents(pipe, steps=2)  # diffusers' first call adds its hook registry
    before = module_states(pipe.transformer)
    chosen = set(fp8_layers(pipe.transformer).chosen)
    reference = bf16_pipeline()  # the same seeded weights
    if not full_precision_steps:
        quantize_(reference.transformer, Float8WeightOnlyConfig(), filter_fn=lambda module, name: name in chosen)
    xstage_dit.enable(reference, fuse_mlp=False)
    expected = latents(reference, steps=2)
    xstage_dit.disable(reference)  # an enabled model keeps diffusers' names rebound for every later test

    xstage_dit.enable(pipe, fp8="linear", fp8_full_precision_steps=full_precision_steps, fuse_mlp=False)
    assert "FP8 linear" in xstage_dit.installed_layers(pipe)
    layers = dict(pipe.transformer.named_modules())
    assert {name for name in chosen if isinstance(layers[name].weight, Float8Tensor)} == chosen
    assert all(type(layers[name]) is (SwitchedLinear if full_precision_steps else nn.Linear) for name in chosen)
    assert torch.equal(latents(pipe, steps=2), expected)
    xstage_dit.disable(pipe)
    assert_same_states(module_states(pipe.transformer), before)
    assert torch.equal(latents(pipe, steps=2), stock)


def test_a_switched_linear_runs_the_weight_its_step_says(fp8_on_cpu):
    pipe = bf16_pipeline()
    original = pipe.transformer.transformer_blocks[0].ff.net[2].weight.detach().clone()
    xstage_dit.enable(pipe, fp8="linear", fp8_full_precision_steps=1)
    layer = pipe.transformer.transformer_blocks[0].ff.net[2]
    record = getattr(pipe.transformer, api._STATE_ATTR).precision
    x = torch.randn(3, layer.in_features, dtype=torch.bfloat16)
    assert not record.full_precision_now  # outside a pipeline call
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    record.full_precision_now = True
    assert torch.equal(layer(x), nn.functional.linear(x, original, layer.bias))
    assert not torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
    record.full_precision_now = False
    xstage_dit.disable(pipe)


@pytest.mark.parametrize("steps, expected", [(4, [False, True, True, False]), (2, [False, False]),
                                             (3, [False, True, False])])
def test_a_pipeline_call_switches_the_precision_at_the_right_steps(fp8_on_cpu, steps, expected):
    """fp8_full_precision_steps=1: each transformer call reads the precision its step gets; the caller's own step
    callback still runs at every step and what it returns reaches the pipeline; after the call, FP8 is on."""
    pipe = bf16_pipeline()
    xstage_dit.enable(pipe, fp8="linear", fp8_full_precision_steps=1)
    record = getattr(pipe.transformer, api._STATE_ATTR).precision
    seen, their_steps = [], []
    handle = pipe.transformer.register_forward_pre_hook(lambda module, args: seen.append(record.fp8("linear")))

    def theirs(pipe, step, timestep, callback_kwargs):
        their_steps.append(step)
        return {"latents": callback_kwargs["latents"] * 0}

    try:
        out = latents(pipe, steps=steps, callback_on_step_end=theirs)
        calls = len(seen) // steps  # a step's transformer calls (true CFG: 2) all read the step's precision
        assert seen == [fp8 for fp8 in expected for _ in range(calls)] and their_steps == list(range(steps))
        assert not out.any()  # the last step's latents, zeroed by their callback
        assert record.fp8("linear")
        seen.clear()
        latents(pipe, steps=steps)  # without a callback of theirs
        assert seen == [fp8 for fp8 in expected for _ in range(calls)]
    finally:
        handle.remove()
        xstage_dit.disable(pipe)
    assert type(pipe) is FluxPipeline


def test_compiled_blocks_compile_once_per_precision(fp8_on_cpu):
    """Under compile_repeated_blocks the switch recompiles a block at most once per precision: a second pipeline
    call compiles nothing."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    pipe = bf16_pipeline()
    xstage_dit.enable(pipe, fp8="linear", fp8_full_precision_steps=1)
    counter = CompileCounterWithBackend("aot_eager")
    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend=counter)
    try:
        first = latents(pipe)
        compiled = counter.frame_count
        assert compiled == 2 * 2  # two block classes, two precisions
        assert torch.equal(latents(pipe), first)
        assert counter.frame_count == compiled
    finally:
        xstage_dit.disable(pipe)
        torch._dynamo.reset()


def _gpu_worker(name: str) -> None:
    """fp8="linear" with fp8_full_precision_steps=1 (bf16 and FP8 steps in every call), compiled blocks and CUDA
    graphs (in one process: gloo's collectives cannot be captured), against stock bf16. The third call, which
    only replays, equals the first, which ran eagerly: a graph captured at one precision and replayed for a step
    of the other would move it by about the FP8 error. `disable` restores the model exactly."""
    from torchao.quantization import Float8Tensor

    share_one_gpu()
    torch.distributed.init_process_group("gloo")
    pipe = bf16_pipeline(name, device="cuda")
    size = SIZES[name]
    stock = latents(pipe, name, size=size)
    before = module_states(pipe.transformer)
    xstage_dit.enable(pipe, fp8="linear", fp8_full_precision_steps=1, cuda_graphs=True, timeout_s=120)
    assert any(isinstance(module.weight, Float8Tensor) for module in pipe.transformer.modules()
               if type(module) is SwitchedLinear)
    pipe.transformer.compile_repeated_blocks(fullgraph=True)
    outs = [latents(pipe, name, size=size) for _ in range(3)]  # eager, captures (a graph per precision), replays
    for call, out in enumerate(outs):
        error = relative_error(out, stock)
        assert 0 < error < FP8_TOLERANCE, f"{name}, call {call}: relative error {error:.2e} against stock bf16"
    assert relative_error(outs[2], outs[0]) < GRAPHS_TOLERANCE
    use = xstage_dit.cuda_graph_use(pipe)
    assert torch.distributed.get_world_size() > 1 or use.replays + use.block_replays > 0, use
    xstage_dit.disable(pipe)
    for module in pipe.transformer.modules():  # compile_repeated_blocks undone
        module.__dict__.pop("_compiled_call_impl", None)
    assert_same_states(module_states(pipe.transformer), before)


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", [pytest.param("tiny-flux", marks=pytest.mark.smoke), "tiny-wan", "tiny-zimage"])
def test_fp8_linear_on_gpu_stays_near_bf16(name: str, world_size: int) -> None:
    if torch.cuda.get_device_capability() < linear.FP8_GEMM_CAPABILITY:
        pytest.skip("FP8 GEMMs need compute capability 8.9 or above")
    run_on_ranks(world_size, _gpu_worker, name, deadline_s=600)
