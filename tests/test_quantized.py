"""Models quantized the ways diffusers users quantize them run under `enable` as they run in one process: torchao's
`quantize_` (int8 weight-only, int8 dynamic, float8 weight-only on CPU; float8 dynamic rowwise and tensorwise on a
GPU of compute capability 8.9 or above), diffusers' `TorchAoConfig` at `from_pretrained`, GGUF files, and
bitsandbytes' 4-bit (NF4) and 8-bit layers. Each
case runs the same quantized pipeline stock first, then enabled on 1, 2 or 3 gloo ranks (float32, CPU: relative
error below 1e-4; dynamic activation quantization within DYNAMIC_TOLERANCE, which says why), and `disable` gives
back the quantized weights exactly. Layers whose weights xstage_dit reads (FLUX.1's split single-stream projection,
HiDream's grouped experts) run diffusers' code for a quantized weight, with one warning; sharding quantized experts
is refused. The ranks' checks see quantized weights: written after `enable` (on one rank only: refused), or
quantized otherwise on one rank. LoRA adapters load after `enable` on a quantized model.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
from torch import nn

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks, share_one_gpu, xstage_warnings
from gpu_checks import PIPELINE_TOLERANCE
from lora_weights import generate_latents as generate
from model_change_checks import assert_moves, flux_inputs
from xstage_dit.runtime.agreement import stored_tensors
from xstage_dit.testing.numerics import relative_error

# the library's CPU paths (conftest.py): these tests' subject is not our kernels, which their own tests run
pytestmark = pytest.mark.cpu_paths

torchao = pytest.importorskip("torchao", reason="the quantized-model tests need torchao")
torchao_quantization = pytest.importorskip("torchao.quantization", reason="the quantized-model tests need torchao")

TOLERANCE = 1e-4
# Dynamic activation quantization rounds each token's activations to 8 bits per call: an input that differs in its
# last bits (xstage_dit's attention is another SDPA kernel at one rank, and sums in another order on several) moves
# some values to the next step. One process shows it alone: prompt embeddings scaled by 1 + 1e-7 noise change tiny
# FLUX.1's latents by ~8e-3 under int8 dynamic, by ~3e-7 under int8 weight-only.
DYNAMIC_TOLERANCE = 3e-2
# A tensorwise activation scale is the largest |x| of the whole tensor: at N ranks each rank's tensor is its shard of
# the tokens, whose scale is its own, so every value rounds on another e4m3 grid than in one process (e4m3 steps
# are 2^-4 of a value): the outputs differ by about FP8's own error, not by last-bit noise. Rowwise scales (one per
# token) do not depend on the sharding.
TENSORWISE_TOLERANCE = 1e-1
DYNAMIC = {"Int8DynamicActivationInt8WeightConfig", "float8 dynamic rowwise", "float8 dynamic tensorwise"}
SPLIT_PROJECTION_WARNING = "FluxSingleTransformerBlock.proj_out in the split projection holds its weight as"


def _config(name: str) -> type:
    """torchao's config class `name`; skips the test where this torchao has none (asked in the test's process
    before its ranks start)."""
    found = getattr(torchao_quantization, name, None)
    if found is None:
        pytest.skip(f"torchao {torchao.__version__} has no {name}")
    return found


def _per_row():
    return _config("Float8DynamicActivationFloat8WeightConfig")(granularity=torchao_quantization.PerRow())


def _per_tensor():
    return _config("Float8DynamicActivationFloat8WeightConfig")(granularity=torchao_quantization.PerTensor())


# what `quantize_` is given, by test id; the float8 dynamic ones need a GPU (torchao refuses them elsewhere)
CPU_CONFIGS = ["Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig", "Float8WeightOnlyConfig"]
GPU_CONFIGS = {"float8 dynamic rowwise": _per_row, "float8 dynamic tensorwise": _per_tensor}


def quantized(name: str, config: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The tiny pipeline `name` with its transformer quantized by torchao's `config` (a CPU_CONFIGS name, or a
    GPU_CONFIGS id)."""
    from torchao.quantization import quantize_

    pipe = zoo.build_pipeline(name, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    quantize_(pipe.transformer, GPU_CONFIGS[config]() if config in GPU_CONFIGS else _config(config)())
    return pipe


def weights_of(model: nn.Module) -> dict[str, tuple[type, list[torch.Tensor]]]:
    """Each parameter's class and a copy of what it stores (a quantized weight's data and scales)."""
    return {name: (type(p), [t.clone() for t in stored_tensors(p)]) for name, p in model.named_parameters()}


def assert_same_weights(model: nn.Module, before: dict[str, tuple[type, list[torch.Tensor]]]) -> None:
    after = weights_of(model)
    assert after.keys() == before.keys()
    for name, (kind, tensors) in before.items():
        assert after[name][0] is kind, (name, after[name][0], kind)
        assert all(torch.equal(a, b) for a, b in zip(after[name][1], tensors, strict=True)), name


def _enabled_equals_stock(build: Callable[[], Any], name: str, compiled: bool = False, tolerance: float = TOLERANCE,
                          warning: str | None = None, **knobs: Any) -> None:
    """The pipeline `build()` makes: enabled (compiled after, where asked) equals it stock, `warning` said where
    given, and `disable` leaves its weights as they were."""
    pipe = build()
    before = weights_of(pipe.transformer)
    ref = generate(pipe, name)
    with xstage_warnings() as warnings:
        xstage_dit.enable(pipe, timeout_s=120, **knobs)
        if compiled:  # fullgraph: a graph break is an error; aot_eager traces the quantized tensors' operators
            pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="aot_eager")
        for call in range(2):
            error = relative_error(generate(pipe, name), ref)
            assert error < tolerance, f"{name}, call {call}: relative error {error:.2e}"
    if warning is not None:
        assert sum(warning in w for w in warnings) == 1, warnings
    xstage_dit.disable(pipe)
    assert_same_weights(pipe.transformer, before)
    assert relative_error(generate(pipe, name), ref) < tolerance


def tolerance_of(config: str) -> float:
    """The error allowed to `config` (DYNAMIC_TOLERANCE and TENSORWISE_TOLERANCE say why)."""
    if config == "float8 dynamic tensorwise":
        return TENSORWISE_TOLERANCE
    return DYNAMIC_TOLERANCE if config in DYNAMIC else TOLERANCE


def _torchao_worker(config: str, compiled: bool = False, **knobs: Any) -> None:
    _enabled_equals_stock(lambda: quantized("tiny-flux", config), "tiny-flux", compiled, tolerance_of(config),
                          warning=SPLIT_PROJECTION_WARNING, **knobs)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("config", CPU_CONFIGS)
def test_torchao_quantized_flux_equals_one_process(config: str, world_size: int) -> None:
    _config(config)
    run_on_ranks(world_size, _torchao_worker, config)


def test_torchao_quantized_flux_compiled_equals_one_process() -> None:
    run_on_ranks(2, _torchao_worker, "Int8WeightOnlyConfig", True)


def _ring_worker() -> None:
    _torchao_worker("Float8WeightOnlyConfig", ring_degree=2)


def test_torchao_quantized_flux_on_a_ring_equals_one_process() -> None:
    run_on_ranks(2, _ring_worker)


def _wan_worker(config: str) -> None:
    _enabled_equals_stock(lambda: quantized("tiny-wan", config), "tiny-wan")


@pytest.mark.parametrize("world_size", [1, 2])
def test_torchao_quantized_wan_equals_one_process(world_size: int) -> None:
    run_on_ranks(world_size, _wan_worker, "Float8WeightOnlyConfig")


def test_writes_to_quantized_weights_move_the_key() -> None:
    """Both readers of runtime/model_changes.py see a quantized weight written in place (torchao's tensors are
    parameters by a flag, not `nn.Parameter`s: write_hooks.py wraps their class too, and only while watched),
    loaded, swapped through `.data`, or quantized again; a forward moves neither."""
    from torchao.quantization import Int8Tensor, quantize_

    model = quantized("tiny-flux", "Int8WeightOnlyConfig").transformer
    layer = model.transformer_blocks[0].attn.to_q
    before, swap_tensors = dict(vars(Int8Tensor)), torch.utils.swap_tensors
    other = quantized("tiny-flux", "Int8WeightOnlyConfig").transformer  # the same seeded weights
    with torch.no_grad():
        other.transformer_blocks[0].attn.to_q.weight.qdata.neg_()
    sequence: list[tuple[str, Callable[[], object], bool, bool]] = [
        ("nothing", lambda: None, False, False),
        ("a forward", lambda: model(**flux_inputs(model)), False, False),
        ("copy_ into a quantized weight", lambda: layer.weight.copy_(other.transformer_blocks[0].attn.to_q.weight),
         True, False),
        ("load_state_dict", lambda: model.load_state_dict(other.state_dict()), True, False),
        ("load_state_dict(assign=True)", lambda: model.load_state_dict(other.state_dict(), assign=True), True, True),
        # counted as a write; a torchao tensor keeps its inner tensors through it (its values too)
        ("weight.data = another quantized tensor",
         lambda: setattr(layer.weight, "data", other.transformer_blocks[0].attn.to_q.weight.detach().clone()),
         True, False),
        # how `module.to()` moves a quantized weight to another device or dtype
        ("torch.utils.swap_tensors", lambda: torch.utils.swap_tensors(layer.weight, layer.weight.detach().clone()),
         True, True),
        ("quantize_ again (a dequantized weight, quantized anew)", lambda: (
            setattr(layer, "weight", nn.Parameter(layer.weight.dequantize(), requires_grad=False)),
            quantize_(layer, torchao_quantization.Int8WeightOnlyConfig())), True, True),
    ]
    assert_moves(model, sequence)
    after = dict(vars(Int8Tensor))
    changed = {name for name in {*after, *before} if after.get(name) is not before.get(name)}
    assert changed <= {"__slotnames__"}, changed  # copyreg caches that at a class's first copy
    assert torch.utils.swap_tensors is swap_tensors


def _one_rank_writes_worker() -> None:
    """A quantized weight written on every rank runs as one process with the same write; written on one rank only,
    the next call is refused on every rank, naming what differs."""
    pipe = quantized("tiny-flux", "Int8WeightOnlyConfig")
    weight = pipe.transformer.transformer_blocks[0].attn.to_q.weight
    ref = generate(pipe, "tiny-flux")
    with torch.no_grad():
        weight.qdata.neg_()  # through the inner tensor: not seen, and the ranks agree on it anyway
        written = generate(pipe, "tiny-flux")
        weight.qdata.neg_()
    xstage_dit.enable(pipe, timeout_s=120)
    assert relative_error(generate(pipe, "tiny-flux"), ref) < TOLERANCE
    negated = weight.detach().clone()
    negated.qdata.neg_()
    with torch.no_grad():
        weight.copy_(negated)
    assert relative_error(generate(pipe, "tiny-flux"), written) < TOLERANCE
    if torch.distributed.get_rank() == 1:
        with torch.no_grad():
            weight.copy_(_scaled(negated))
    with pytest.raises(ValueError, match="the ranks disagree on .*weights"):
        generate(pipe, "tiny-flux")
    xstage_dit.disable(pipe)


def _scaled(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (an Int8Tensor) with its scales doubled."""
    scaled = weight.detach().clone()
    scaled.scale.mul_(2)
    return scaled


def test_a_quantized_weight_written_on_one_rank_is_refused() -> None:
    run_on_ranks(2, _one_rank_writes_worker)


def _pipeline_quantization_worker(directory: str) -> None:
    """diffusers' PipelineQuantizationConfig with a TorchAoConfig, at `from_pretrained` of a saved tiny FLUX.1."""
    from diffusers import FluxPipeline, PipelineQuantizationConfig, TorchAoConfig

    def load():
        quantization = PipelineQuantizationConfig(
            quant_mapping={"transformer": TorchAoConfig(torchao_quantization.Int8WeightOnlyConfig())})
        pipe = FluxPipeline.from_pretrained(directory, text_encoder=None, text_encoder_2=None, tokenizer=None,
                                            tokenizer_2=None, torch_dtype=torch.float32,
                                            quantization_config=quantization)
        pipe.set_progress_bar_config(disable=True)
        assert type(pipe.transformer.transformer_blocks[0].attn.to_q.weight).__name__ == "Int8Tensor"
        return pipe

    _enabled_equals_stock(load, "tiny-flux", warning=SPLIT_PROJECTION_WARNING)


@pytest.mark.parametrize("world_size", [1, 2])
def test_torchao_config_at_from_pretrained_equals_one_process(world_size: int, tmp_path) -> None:
    zoo.build_pipeline("tiny-flux").save_pretrained(tmp_path)
    run_on_ranks(world_size, _pipeline_quantization_worker, str(tmp_path))


def write_gguf(model: nn.Module, path: str) -> None:
    """`model`'s weights as a GGUF file in diffusers' naming: Q8_0 for the matrices whose rows split into its
    blocks of 32, float32 for the rest."""
    gguf = pytest.importorskip("gguf", reason="the GGUF test writes its file with the gguf package")
    writer = gguf.GGUFWriter(path, arch="flux")
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if array.ndim == 2 and array.shape[1] % 32 == 0:
            packed = gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, packed, raw_shape=packed.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_worker(directory: str) -> None:
    """diffusers' GGUFQuantizationConfig at `from_single_file` (GGUFLinear layers, GGUFParameter weights)."""
    from diffusers import FluxTransformer2DModel, GGUFQuantizationConfig

    def load():
        pipe = zoo.build_pipeline("tiny-flux")
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer = FluxTransformer2DModel.from_single_file(
            os.path.join(directory, "transformer.gguf"), config=directory, subfolder="transformer",
            quantization_config=GGUFQuantizationConfig(compute_dtype=torch.float32), torch_dtype=torch.float32)
        assert type(pipe.transformer.transformer_blocks[0].attn.to_q).__name__ == "GGUFLinear"
        return pipe

    _enabled_equals_stock(load, "tiny-flux",
                          warning="FluxSingleTransformerBlock.proj_out in the split projection is a "
                                  "diffusers.quantizers.gguf.utils.GGUFLinear")


@pytest.mark.parametrize("world_size", [1, 2])
def test_gguf_equals_one_process(world_size: int, tmp_path) -> None:
    transformer = zoo.build_pipeline("tiny-flux").transformer
    write_gguf(transformer, str(tmp_path / "transformer.gguf"))
    transformer.save_pretrained(tmp_path / "transformer")  # its config
    run_on_ranks(world_size, _gguf_worker, str(tmp_path))


def bitsandbytes_quantized(name: str, bits: int):
    """The tiny pipeline `name` with its transformer's Linear layers as bitsandbytes' NF4 `Linear4bit` or int8
    `Linear8bitLt` with `Params4bit` / `Int8Params` weights: the modules diffusers' `BitsAndBytesConfig` makes at
    `from_pretrained`, which loads only onto a GPU; bitsandbytes itself runs them on CPU."""
    import bitsandbytes

    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    for parent in list(pipe.transformer.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            shape = (child.in_features, child.out_features)
            layer = (bitsandbytes.nn.Linear4bit(*shape, bias=child.bias is not None, compute_dtype=torch.float32,
                                                quant_type="nf4") if bits == 4 else
                     bitsandbytes.nn.Linear8bitLt(*shape, bias=child.bias is not None, has_fp16_weights=False))
            layer.load_state_dict(child.state_dict())
            setattr(parent, child_name, layer.to("cpu"))  # the move quantizes the weight
    assert pipe.transformer.transformer_blocks[0].attn.to_q.weight.dtype == (torch.uint8 if bits == 4 else torch.int8)
    return pipe


def bitsandbytes_warning(bits: int) -> str:
    """What `enable` says once of FLUX.1's split projection over a bitsandbytes layer."""
    kind = "Linear4bit" if bits == 4 else "Linear8bitLt"
    return f"FluxSingleTransformerBlock.proj_out in the split projection is a bitsandbytes.nn.modules.{kind}"


def _bitsandbytes_worker(bits: int, compiled: bool = False) -> None:
    _enabled_equals_stock(lambda: bitsandbytes_quantized("tiny-flux", bits), "tiny-flux", compiled,
                          warning=bitsandbytes_warning(bits))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_equals_one_process(bits: int, world_size: int) -> None:
    pytest.importorskip("bitsandbytes", reason="the bitsandbytes tests need bitsandbytes")
    run_on_ranks(world_size, _bitsandbytes_worker, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_bitsandbytes_compiled_equals_one_process(bits: int) -> None:
    pytest.importorskip("bitsandbytes", reason="the bitsandbytes tests need bitsandbytes")
    run_on_ranks(2, _bitsandbytes_worker, bits, True)


HIDREAM_WARNING = "HiDream's grouped MoE: 2 of 2 MoE layers hold quantized experts"


def _hidream_worker() -> None:
    """Quantized routed experts cannot be stacked for the grouped matmuls: their layers run diffusers' code, and
    sharding them is refused at enable, in words."""
    build = lambda: quantized("tiny-hidream", "Int8WeightOnlyConfig")  # noqa: E731
    _enabled_equals_stock(build, "tiny-hidream", warning=HIDREAM_WARNING)
    pipe = build()
    before = weights_of(pipe.transformer)
    with pytest.raises(ValueError, match="expert_parallel=True cannot shard HiDream's .*Int8Tensor"):
        xstage_dit.enable(pipe, timeout_s=120, expert_parallel=True)
    assert_same_weights(pipe.transformer, before)


def test_torchao_quantized_hidream_experts_run_diffusers_code() -> None:
    run_on_ranks(2, _hidream_worker)


def test_sharding_quantized_hidream_experts_is_refused_before_any_collective(monkeypatch) -> None:
    """Rank 0 of a two-rank job alone, without a group: the refusal must come before one is started."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    pipe = quantized("tiny-hidream", "Int8WeightOnlyConfig")
    with pytest.raises(ValueError, match="expert_parallel=True cannot shard HiDream's .*Int8Tensor"):
        xstage_dit.enable(pipe, timeout_s=120, expert_parallel=True)
    assert not torch.distributed.is_initialized()
    assert xstage_dit.installed_layers(pipe) == []


# the layers the adapter trains: FLUX.1's split single-stream projection, attention projections, a feed-forward
LORA_TARGETS = ["single_transformer_blocks.0.proj_out", "single_transformer_blocks.0.attn.to_q",
                "transformer_blocks.0.attn.to_k", "transformer_blocks.0.ff.net.0.proj"]
# each step of the sequence on a quantized pipeline; PEFT cannot fuse an adapter into a weight that torchao
# quantized after loading (it needs the config from a TorchAoConfig load to quantize it again), stock or not
LORA_STEPS: list[tuple[str, Callable]] = [
    ("load", lambda pipe, adapter: pipe.load_lora_weights(adapter, adapter_name="a")),
    ("set_adapters 0.5", lambda pipe, adapter: pipe.set_adapters(["a"], [0.5])),
    ("disable_lora", lambda pipe, adapter: pipe.disable_lora()),
    ("enable_lora", lambda pipe, adapter: pipe.enable_lora()),
    ("unload_lora_weights", lambda pipe, adapter: pipe.unload_lora_weights()),
]


def _lora_worker() -> None:
    """A LoRA adapter loaded after enable on a quantized FLUX.1 (PEFT's torchao LoRA layers) equals the same
    sequence stock, step by step."""
    from lora_weights import lora_state_dict

    pipe = quantized("tiny-flux", "Int8WeightOnlyConfig")
    adapter = lora_state_dict(pipe.transformer, LORA_TARGETS, seed=0)
    stock = []
    for _, step in LORA_STEPS:
        step(pipe, adapter)
        stock.append(generate(pipe, "tiny-flux"))
    pipe = quantized("tiny-flux", "Int8WeightOnlyConfig")
    before = weights_of(pipe.transformer)
    xstage_dit.enable(pipe, timeout_s=120)
    for (what, step), ref in zip(LORA_STEPS, stock):
        step(pipe, adapter)
        error = relative_error(generate(pipe, "tiny-flux"), ref)
        assert error < TOLERANCE, f"after {what}: relative error {error:.2e}"
    xstage_dit.disable(pipe)
    assert_same_weights(pipe.transformer, before)


def test_lora_after_enable_on_a_quantized_model_equals_one_process() -> None:
    pytest.importorskip("peft", reason="LoRA adapters need peft")
    run_on_ranks(2, _lora_worker)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [pytest.param(name, marks=pytest.mark.smoke) if "rowwise" in name else name
                                    for name in GPU_CONFIGS])
def test_torchao_float8_dynamic_on_gpu_equals_one_process(config: str) -> None:
    """torchao's float8 dynamic configs (compute capability 8.9 or above), bfloat16, CUDA graphs on, two ranks
    sharing one GPU; the split projection and the GELU epilogue run diffusers' code for their quantized layers."""
    _config("Float8DynamicActivationFloat8WeightConfig")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torchao's float8 dynamic quantization needs compute capability 8.9 or above")
    run_on_ranks(2, _gpu_worker, config)


def _gpu_worker(config: str) -> None:
    share_one_gpu()
    _enabled_equals_stock(lambda: quantized("tiny-flux", config, "cuda", torch.bfloat16), "tiny-flux",
                          tolerance=tolerance_of(config), warning=SPLIT_PROJECTION_WARNING, cuda_graphs=True)


def _bitsandbytes_config_worker(directory: str, bits: int) -> None:
    """diffusers' BitsAndBytesConfig at `from_pretrained` (the GPU load path), bfloat16, enable's defaults (CUDA
    graphs on)."""
    from diffusers import BitsAndBytesConfig, FluxTransformer2DModel

    share_one_gpu()
    config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
              if bits == 4 else BitsAndBytesConfig(load_in_8bit=True))

    def load():
        pipe = zoo.build_pipeline("tiny-flux", device="cuda", dtype=torch.bfloat16)
        pipe.set_progress_bar_config(disable=True)
        pipe.transformer = FluxTransformer2DModel.from_pretrained(directory, quantization_config=config,
                                                                  torch_dtype=torch.bfloat16)
        return pipe

    # bfloat16 on a GPU: our attention and fused layers round in another order than diffusers' (gpu_checks.py)
    _enabled_equals_stock(load, "tiny-flux", tolerance=PIPELINE_TOLERANCE, warning=bitsandbytes_warning(bits))


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("bits", [pytest.param(4, marks=pytest.mark.smoke), 8])
def test_bitsandbytes_config_on_gpu_equals_one_process(bits: int, world_size: int, tmp_path) -> None:
    """The load path users take: a transformer saved, then loaded with BitsAndBytesConfig (4-bit NF4, 8-bit), at
    one rank and at two ranks sharing the GPU, against the same quantized pipeline in one process."""
    pytest.importorskip("bitsandbytes", reason="the bitsandbytes tests need bitsandbytes")
    zoo.build_pipeline("tiny-flux").transformer.save_pretrained(tmp_path)
    run_on_ranks(world_size, _bitsandbytes_config_worker, str(tmp_path), bits, deadline_s=300)


def _quantized_otherwise_worker() -> None:
    """A model quantized otherwise on one rank (float8 instead of int8 weight-only) is refused at enable."""
    config = "Float8WeightOnlyConfig" if os.environ["RANK"] == "1" else "Int8WeightOnlyConfig"
    with pytest.raises(ValueError, match="rank 1's FluxTransformer2DModel weights"):
        xstage_dit.enable(quantized("tiny-flux", config), timeout_s=120)


def test_a_model_quantized_otherwise_on_one_rank_is_refused() -> None:
    run_on_ranks(2, _quantized_otherwise_worker)
