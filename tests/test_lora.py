"""LoRA adapters with xstage_dit enabled equal stock diffusers with the same adapters (float32, CPU, real gloo
processes at 1 and 2 ranks): adapters loaded through the pipelines' `load_lora_weights` before and after `enable`,
two of them weighted with `set_adapters`, `disable_lora`/`enable_lora`, `fuse_lora`/`unfuse_lora`, unloading, and
merging then unloading. The adapters train the layers xstage_dit computes itself from their weights (FLUX.1's split
single-stream projection, the GELU epilogue's projections) and those its processors call (the attention
projections): a layer that is an adapter's runs diffusers' code that call (fusions/plain.py), with one warning.

Every rank runs the sequence on the stock pipeline first, then on a fresh copy of it (the same seeded weights)
with xstage_dit enabled after the first adapter is loaded."""
from __future__ import annotations

import os
from typing import Callable

import pytest
import torch
from torch import nn

import xstage_dit
import zoo
from dist_harness import run_on_ranks, xstage_warnings
from xstage_dit.fusions.plain import why_not_plain
from xstage_dit.patches.image import flux_mlp

TOLERANCE = 1e-4
RANK = 4
SIZES = {"tiny-flux": {"height": 20, "width": 28, "num_frames": 1},      # 5 x 7 image tokens
         "tiny-wan": {"height": 16, "width": 112, "num_frames": 17},     # 5 frames x 1 x 7
         "tiny-qwenimage": {"height": 40, "width": 56, "num_frames": 1},  # 5 x 7
         "tiny-hidream": {"height": 32, "width": 32, "num_frames": 1},
         "tiny-nucleusmoe": {"height": 40, "width": 56, "num_frames": 1}}
SIZES["tiny-chroma"] = SIZES["tiny-flux"]
# adapter "a" (loaded before enable) trains every layer named; "b" (loaded after) some of them, none of FLUX.1's
# proj_out: with "b" alone the split projection computes its block again
ADAPTERS = {
    "tiny-flux": {
        "a": ["single_transformer_blocks.0.proj_out", "single_transformer_blocks.0.proj_mlp",
              "single_transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_k",
              "single_transformer_blocks.0.attn.to_v", "transformer_blocks.0.ff.net.0.proj",
              "transformer_blocks.0.ff_context.net.0.proj", "transformer_blocks.0.attn.to_q",
              "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v", "transformer_blocks.0.attn.to_out.0",
              "transformer_blocks.0.attn.add_q_proj"],
        "b": ["single_transformer_blocks.0.proj_mlp", "single_transformer_blocks.0.attn.to_v",
              "transformer_blocks.0.ff.net.0.proj", "transformer_blocks.0.attn.to_out.0"],
    },
    "tiny-wan": {
        "a": ["blocks.0.attn1.to_q", "blocks.0.attn1.to_k", "blocks.0.attn1.to_v", "blocks.0.attn1.to_out.0",
              "blocks.0.attn2.to_k", "blocks.0.ffn.net.0.proj", "blocks.1.ffn.net.0.proj"],
        "b": ["blocks.0.attn1.to_q", "blocks.1.attn1.to_out.0", "blocks.1.ffn.net.0.proj"],
    },
    "tiny-qwenimage": {
        "a": ["transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_k", "transformer_blocks.0.attn.to_v",
              "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.attn.add_q_proj",
              "transformer_blocks.0.img_mlp.net.0.proj", "transformer_blocks.0.txt_mlp.net.0.proj"],
        "b": ["transformer_blocks.0.attn.to_q", "transformer_blocks.1.img_mlp.net.0.proj"],
    },
    # routed experts, whose weights the grouped MoE stacks, and a shared one
    "tiny-hidream": {
        "a": ["double_stream_blocks.0.block.ff_i.experts.1.w1", "double_stream_blocks.0.block.ff_i.experts.2.w2",
              "double_stream_blocks.0.block.ff_i.experts.3.w3", "double_stream_blocks.0.block.ff_i.shared_experts.w1",
              "double_stream_blocks.0.block.attn1.to_q", "single_stream_blocks.0.block.attn1.to_v"],
        "b": ["single_stream_blocks.0.block.ff_i.experts.0.w1", "double_stream_blocks.0.block.ff_i.experts.1.w1"],
    },
}
ADAPTERS["tiny-chroma"] = ADAPTERS["tiny-flux"]  # the same blocks; its padded prompts bring a text mask
SPLIT_PROJECTION = {"tiny-flux", "tiny-chroma"}
WARNED = {"tiny-flux": "FluxSingleTransformerBlock.proj_out in the split projection is a peft.tuners.lora.layer.Linear",
          "tiny-chroma": "ChromaSingleTransformerBlock.proj_out in the split projection is a peft",
          "tiny-hidream": "HiDream's grouped MoE: routed expert 1.w1 is a peft.tuners.lora.layer.Linear"}
# what each step of the sequence does to the pipeline (the first before enable)
STEPS: list[tuple[str, Callable]] = [
    ("load a", lambda pipe, adapters: pipe.load_lora_weights(adapters["a"], adapter_name="a")),
    ("load b, set_adapters a 0.7, b 0.3", lambda pipe, adapters: (
        pipe.load_lora_weights(adapters["b"], adapter_name="b"), pipe.set_adapters(["a", "b"], [0.7, 0.3]))),
    ("disable_lora", lambda pipe, adapters: pipe.disable_lora()),
    ("enable_lora", lambda pipe, adapters: pipe.enable_lora()),
    ("fuse_lora", lambda pipe, adapters: pipe.fuse_lora()),
    ("unfuse_lora", lambda pipe, adapters: pipe.unfuse_lora()),
    ("unload_lora_weights", lambda pipe, adapters: pipe.unload_lora_weights()),
    ("load b again", lambda pipe, adapters: pipe.load_lora_weights(adapters["b"], adapter_name="b")),
    ("fuse_lora, unload_lora_weights", lambda pipe, adapters: (pipe.fuse_lora(), pipe.unload_lora_weights())),
]
# FLUX.1's and Chroma's steps whose single-stream proj_out is a PEFT layer (merged, disabled or not): its block runs diffusers'
# forward; after the others the split projection computes it again
FLUX_PROJ_OUT_WRAPPED = {"load a", "load b, set_adapters a 0.7, b 0.3", "disable_lora", "enable_lora", "fuse_lora",
                         "unfuse_lora"}


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


def lora_state_dict(model: nn.Module, targets: list[str], seed: int) -> dict[str, torch.Tensor]:
    """A rank-`RANK` LoRA for the Linear layers `targets` of `model`, in the diffusers naming that the pipelines'
    `load_lora_weights` takes; random A and B (B is zero in a fresh adapter: then it would change nothing)."""
    generator = torch.Generator().manual_seed(seed)
    layers = dict(model.named_modules())
    state = {}
    for target in targets:
        layer = layers[target]
        state[f"transformer.{target}.lora_A.weight"] = torch.randn(RANK, layer.in_features, generator=generator) * 0.2
        state[f"transformer.{target}.lora_B.weight"] = torch.randn(layer.out_features, RANK, generator=generator) * 0.2
    return state


def _generate(pipe, name: str) -> torch.Tensor:
    kwargs = zoo.call_kwargs(name, **SIZES[name], steps=2, guidance=3.0)
    embeddings = zoo.text_embeddings(name, 1, seed=1, device=pipe.device, dtype=pipe.transformer.dtype)
    return pipe(**kwargs, **embeddings, output_type="latent", generator=torch.Generator().manual_seed(7),
                return_dict=False)[0]


def _fresh(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    pipe = zoo.build_pipeline(name, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _adapters_worker(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                     tolerance: float = TOLERANCE, cuda_graphs: bool | None = None, compiled: bool = False) -> None:
    pipe = _fresh(name, device, dtype)
    adapters = {adapter: lora_state_dict(pipe.transformer, targets, seed)
                for seed, (adapter, targets) in enumerate(ADAPTERS[name].items())}
    stock = []
    for _, step in STEPS:
        step(pipe, adapters)
        stock.append(_generate(pipe, name))

    pipe = _fresh(name, device, dtype)
    split_projections = []
    project_joined = flux_mlp.project_joined
    counts = name in SPLIT_PROJECTION and not compiled  # the single-stream blocks the split projection computes
    if counts:
        flux_mlp.project_joined = lambda *args: split_projections.append(1) or project_joined(*args)
    with xstage_warnings() as warnings:
        for index, ((what, step), ref) in enumerate(zip(STEPS, stock)):
            step(pipe, adapters)
            if index == 0:
                xstage_dit.enable(pipe, timeout_s=120, cuda_graphs=cuda_graphs)
                if compiled:  # a graph break is an error; the eager backend keeps it fast
                    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
            split_projections.clear()
            error = _relative_error(_generate(pipe, name).float(), ref.float())
            assert error < tolerance, f"{name} after {what}: relative error {error:.2e}"
            if counts:
                assert bool(split_projections) is (what not in FLUX_PROJ_OUT_WRAPPED), (what, len(split_projections))
        flux_mlp.project_joined = project_joined
    if name in WARNED:
        assert any(WARNED[name] in warning for warning in warnings), warnings
    # merged and unloaded: every layer the adapters trained is a plain Linear again
    layers = dict(pipe.transformer.named_modules())
    assert all(why_not_plain(layers[target], nn.Linear) is None for target in ADAPTERS[name]["a"])
    xstage_dit.disable(pipe)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", list(ADAPTERS))
def test_adapters_equal_stock(name: str, world_size: int) -> None:
    run_on_ranks(world_size, _adapters_worker, name, deadline_s=600)


def _sharded_experts_worker() -> None:
    pipe = _fresh("tiny-hidream")
    pipe.load_lora_weights(lora_state_dict(pipe.transformer, ADAPTERS["tiny-hidream"]["a"], 0), adapter_name="a")
    xstage_dit.enable(pipe, timeout_s=120, expert_parallel=True)
    with pytest.raises(NotImplementedError, match="routed expert 1.w1 is a peft.* expert_parallel=True cannot run"):
        _generate(pipe, "tiny-hidream")
    xstage_dit.disable(pipe)


def test_adapters_on_sharded_experts_are_refused() -> None:
    """With expert_parallel=True a rank holds only its own experts' weights: experts with an adapter's layers
    cannot run diffusers' loop over all of them, and the call says so."""
    run_on_ranks(2, _sharded_experts_worker)


def _packed_experts_worker() -> None:
    """NucleusMoE-Image's packed experts with a PEFT adapter on their parameters (`target_parameters`; diffusers
    has no LoRA loader for the family): one process runs diffusers' forward for those layers; across ranks,
    whose whole-sequence expert choice only xstage_dit's grouped path makes, the call is refused."""
    from peft import LoraConfig

    pipe = _fresh("tiny-nucleusmoe")
    config = LoraConfig(r=RANK, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"],
                        init_lora_weights=False)  # a random B: the adapter changes the experts
    pipe.transformer.add_adapter(config, adapter_name="experts")
    ref = _generate(pipe, "tiny-nucleusmoe")
    xstage_dit.enable(pipe, timeout_s=120)
    if os.environ["WORLD_SIZE"] == "1":
        error = _relative_error(_generate(pipe, "tiny-nucleusmoe"), ref)
        assert error < TOLERANCE, f"NucleusMoE-Image with adapted experts: relative error {error:.2e}"
    else:
        with pytest.raises(NotImplementedError, match="routed-experts module is a peft.*ParamWrapper"):
            _generate(pipe, "tiny-nucleusmoe")
    xstage_dit.disable(pipe)


@pytest.mark.parametrize("world_size", [1, 2])
def test_adapters_on_packed_experts(world_size: int) -> None:
    run_on_ranks(world_size, _packed_experts_worker)


def _cast_flux():
    pipe = _fresh("tiny-flux")
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return pipe


def _layerwise_casting_worker() -> None:
    """diffusers' layerwise casting (float8 storage, hooks that cast each Linear's weights on its call): the split
    projection runs diffusers' block for a proj_out with those hooks, instead of multiplying by its float8
    weights."""
    ref = _generate(_cast_flux(), "tiny-flux")
    pipe = _cast_flux()
    xstage_dit.enable(pipe, timeout_s=120)
    with xstage_warnings() as warnings:
        error = _relative_error(_generate(pipe, "tiny-flux"), ref)
    assert error < TOLERANCE, f"layerwise-cast FLUX.1: relative error {error:.2e}"
    assert any("FluxSingleTransformerBlock.proj_out in the split projection has hooks on its forward" in warning
               for warning in warnings), warnings
    xstage_dit.disable(pipe)


@pytest.mark.parametrize("world_size", [1, 2])
def test_layerwise_casting_runs_the_stock_projection(world_size: int) -> None:
    run_on_ranks(world_size, _layerwise_casting_worker)


def test_adapters_equal_stock_compiled() -> None:
    """compile_repeated_blocks(fullgraph=True): the blocks compile with the adapters' layers in them, and again
    as those come and go."""
    run_on_ranks(1, _adapters_worker, "tiny-flux", "cpu", torch.float32, TOLERANCE, None, True)


@pytest.mark.gpu
def test_adapters_equal_stock_on_gpu() -> None:
    """bfloat16 on a GPU, where the GELU epilogue computes plain projections in one GEMM and calls the LoRA
    layers (CUDA graphs off: a captured graph replays the adapters' state at its capture)."""
    run_on_ranks(1, _adapters_worker, "tiny-flux", "cuda", torch.bfloat16, 3e-2, False)


@pytest.mark.gpu
def test_gelu_epilogue_calls_adapter_layers_on_gpu(monkeypatch) -> None:
    """A projection that is a PEFT LoRA layer runs as diffusers' GELU runs it (the same bits), with one warning
    naming it; merged into a plain Linear again, it is one GEMM with the GELU in its epilogue."""
    from diffusers.models.activations import GELU
    from peft import LoraConfig, inject_adapter_in_model

    from xstage_dit import logging_utils
    from xstage_dit.fusions.gelu import epilogue_gelus

    torch.manual_seed(0)
    holder = nn.Sequential(GELU(64, 256, approximate="tanh"))
    inject_adapter_in_model(LoraConfig(r=RANK, target_modules=["proj"], init_lora_weights=False), holder)
    holder.to("cuda", torch.bfloat16)
    x = torch.randn(3, 17, 64, device="cuda", dtype=torch.bfloat16)
    epilogues = []
    addmm_activation = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation",
                        lambda *args, **kwargs: epilogues.append(1) or addmm_activation(*args, **kwargs))
    monkeypatch.setattr(logging_utils, "_already_warned", set())
    with torch.no_grad():
        stock = holder(x)
        swap = epilogue_gelus(holder)
        with xstage_warnings() as warnings:
            adapted = holder(x)
        assert torch.equal(adapted, stock) and not epilogues
        assert any("GELU.proj in the GELU epilogue is a peft.tuners.lora.layer.Linear" in w for w in warnings)
        holder[0].proj.merge()
        holder[0].proj = holder[0].proj.get_base_layer()
        merged = holder(x)
        swap.remove()
        merged_stock = holder(x)
    assert epilogues == [1]
    error = ((merged.float() - merged_stock.float()).abs().max() / merged_stock.float().abs().max()).item()
    assert error <= 2 * 2.0**-7, f"max error {error:.2e} of the largest value"  # as tests/test_flux_mlp.py's
