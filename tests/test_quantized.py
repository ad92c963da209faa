"""Models quantized the ways diffusers users quantize them run under `enable` as they run in one process: torchao's
`quantize_` (int8 weight-only, int8 dynamic, float8 weight-only on CPU; float8 dynamic rowwise and tensorwise on a
GPU of compute capability 8.9 or above), diffusers' `TorchAoConfig` at `from_pretrained`, and GGUF files. Each
case runs the same quantized pipeline stock first, then enabled on 1, 2 and 3 gloo ranks (float32, CPU: relative
error below 1e-4), and `disable` gives back the quantized weights exactly. Layers whose weights a fusion reads
(FLUX.1's split single-stream projection) run diffusers' code for a quantized weight, with one warning."""
from __future__ import annotations

import os
from typing import Any, Callable

import pytest
import torch
from torch import nn

import xstage_dit
import zoo
from dist_harness import run_on_ranks, xstage_warnings
from xstage_dit.runtime.agreement import stored_tensors

torchao_quantization = pytest.importorskip("torchao.quantization", reason="the quantized-model tests need torchao")

TOLERANCE = 1e-4
SIZES = {"tiny-flux": {"height": 20, "width": 28, "num_frames": 1},     # 5 x 7 image tokens
         "tiny-wan": {"height": 16, "width": 112, "num_frames": 17}}    # 5 frames x 1 x 7
# Dynamic activation quantization rounds each token's activations to 8 bits per call: an input that differs in its
# last bits (xstage_dit's attention is another SDPA kernel at one rank, and sums in another order on several) moves
# some values to the next step. One process shows it alone: prompt embeddings scaled by 1 + 1e-7 noise change tiny
# FLUX.1's latents by ~8e-3 under int8 dynamic, by ~3e-7 under int8 weight-only.
DYNAMIC_TOLERANCE = 3e-2
DYNAMIC = {"Int8DynamicActivationInt8WeightConfig", "float8 dynamic rowwise", "float8 dynamic tensorwise"}
SPLIT_PROJECTION_WARNING = "FluxSingleTransformerBlock.proj_out in the split projection holds its weight as"


def _config(name: str) -> type:
    """torchao's config class `name`."""
    found = getattr(torchao_quantization, name, None)
    if found is None:
        pytest.skip(f"torchao {torchao_quantization.__name__} has no {name}")
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


def generate(pipe, name: str) -> torch.Tensor:
    kwargs = zoo.call_kwargs(name, **SIZES[name], steps=2, guidance=3.0)
    embeddings = zoo.text_embeddings(name, 1, seed=1, device=pipe.device, dtype=torch.float32)
    return pipe(**kwargs, **embeddings, output_type="latent", generator=torch.Generator().manual_seed(7),
                return_dict=False)[0]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


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


def tolerance(config: str) -> float:
    """The error allowed to `config` (DYNAMIC_TOLERANCE says why)."""
    return DYNAMIC_TOLERANCE if config in DYNAMIC else TOLERANCE


def _torchao_worker(config: str, compiled: bool = False) -> None:
    _enabled_equals_stock(lambda: quantized("tiny-flux", config), "tiny-flux", compiled, tolerance(config),
                          warning=SPLIT_PROJECTION_WARNING)


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("config", CPU_CONFIGS)
def test_torchao_quantized_flux_equals_one_process(config: str, world_size: int) -> None:
    run_on_ranks(world_size, _torchao_worker, config)


def test_torchao_quantized_flux_compiled_equals_one_process() -> None:
    run_on_ranks(2, _torchao_worker, "Int8WeightOnlyConfig", True)


def _wan_worker(config: str) -> None:
    _enabled_equals_stock(lambda: quantized("tiny-wan", config), "tiny-wan")


@pytest.mark.parametrize("world_size", [1, 2])
def test_torchao_quantized_wan_equals_one_process(world_size: int) -> None:
    run_on_ranks(world_size, _wan_worker, "Float8WeightOnlyConfig")
