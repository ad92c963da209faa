"""LoRA adapters with xstage_dit enabled equal stock diffusers with the same adapters (float32, CPU, real gloo
processes at 1 and 2 ranks): adapters loaded through the pipelines' `load_lora_weights` before and after `enable`,
two of them weighted with `set_adapters`, one hot-swapped (`hotswap=True`), `disable_lora`/`enable_lora`,
`fuse_lora`/`unfuse_lora`, unloading, and merging then unloading. The adapters train the layers xstage_dit computes itself from their weights (FLUX.1's split
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
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks, xstage_warnings
from lora_weights import ADAPTERS, RANK, generate_latents, lora_state_dict
from numerics import relative_error
from xstage_dit.fusions.plain import why_not_plain
from xstage_dit.patches.image import flux_mlp

# the library's CPU paths (conftest.py): these tests' subject is not our kernels, which their own tests run
pytestmark = pytest.mark.cpu_paths

TOLERANCE = 1e-4
SPLIT_PROJECTION = {"tiny-flux", "tiny-chroma"}
WARNED = {"tiny-flux": "FluxSingleTransformerBlock.proj_out in the split projection is a peft.tuners.lora.layer.Linear",
          "tiny-chroma": "ChromaSingleTransformerBlock.proj_out in the split projection is a peft",
          "tiny-hidream": "HiDream's grouped MoE: routed expert 1.w1 is a peft.tuners.lora.layer.Linear"}
# what each step of the sequence does to the pipeline (the first before enable)
STEPS: list[tuple[str, Callable]] = [
    ("load a", lambda pipe, adapters: pipe.load_lora_weights(adapters["a"], adapter_name="a")),
    ("load b, set_adapters a 0.7, b 0.3", lambda pipe, adapters: (
        pipe.load_lora_weights(adapters["b"], adapter_name="b"), pipe.set_adapters(["a", "b"], [0.7, 0.3]))),
    ("hotswap a", lambda pipe, adapters: pipe.load_lora_weights(adapters["a swapped"], adapter_name="a",
                                                                 hotswap=True)),
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
FLUX_PROJ_OUT_WRAPPED = {"load a", "load b, set_adapters a 0.7, b 0.3", "hotswap a", "disable_lora", "enable_lora", "fuse_lora",
                         "unfuse_lora"}


def _adapters(model: nn.Module, name: str) -> dict[str, dict[str, torch.Tensor]]:
    """The family's adapters by name, and "a swapped": other weights for a's layers."""
    adapters = {adapter: lora_state_dict(model, targets, seed)
                for seed, (adapter, targets) in enumerate(ADAPTERS[name].items())}
    adapters["a swapped"] = lora_state_dict(model, ADAPTERS[name]["a"], len(adapters))
    return adapters


def _fresh(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32):
    pipe = zoo.build_pipeline(name, device=device, dtype=dtype)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _adapters_worker(name: str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                     tolerance: float = TOLERANCE, cuda_graphs: bool | None = None, compiled: bool = False,
                     steps: list[str] | None = None, calls: int = 1, degrees: dict | None = None) -> None:
    """The sequence (or its `steps`) on stock, then enabled (with `degrees`, else Ulysses over every rank);
    `calls` pipeline calls after each step (with CUDA graphs the later ones replay graphs captured after the
    step)."""
    pipe = _fresh(name, device, dtype)
    sequence = [(what, step) for what, step in STEPS if steps is None or what in steps]
    stock = []
    adapters = _adapters(pipe.transformer, name)
    for _, step in sequence:
        step(pipe, adapters)
        stock.append(generate_latents(pipe, name))

    pipe = _fresh(name, device, dtype)
    adapters = _adapters(pipe.transformer, name)  # the same again: the model may hold, and a hot-swap write, them
    split_projections = []
    project_joined = flux_mlp.project_joined
    # the single-stream blocks the split projection computes (in Python: not in a compiled or replayed call)
    counts = name in SPLIT_PROJECTION and not compiled and not cuda_graphs
    if counts:
        flux_mlp.project_joined = lambda *args: split_projections.append(1) or project_joined(*args)
    with xstage_warnings() as warnings:
        for index, ((what, step), ref) in enumerate(zip(sequence, stock)):
            step(pipe, adapters)
            if index == 0:
                xstage_dit.enable(pipe, timeout_s=120, cuda_graphs=cuda_graphs, **(degrees or {}))
                if compiled:  # a graph break is an error; the eager backend keeps it fast
                    pipe.transformer.compile_repeated_blocks(fullgraph=True, backend="eager")
            for _ in range(calls):
                split_projections.clear()
                error = relative_error(generate_latents(pipe, name).float(), ref.float())
                assert error < tolerance, f"{name} after {what}: relative error {error:.2e}"
                if counts:
                    assert bool(split_projections) is (what not in FLUX_PROJ_OUT_WRAPPED), (what,
                                                                                           len(split_projections))
        flux_mlp.project_joined = project_joined
    if cuda_graphs:
        use = xstage_dit.cuda_graph_use(pipe)
        assert use.replays + use.block_replays > 0, use
    if name in WARNED:
        assert any(WARNED[name] in warning for warning in warnings), warnings
    # merged and unloaded: every layer the adapters trained is a plain Linear again
    layers = dict(pipe.transformer.named_modules())
    assert all(why_not_plain(layers[target], nn.Linear) is None for target in ADAPTERS[name]["a"])
    xstage_dit.disable(pipe)


# families without a split projection or grouped experts (HunyuanVideo's GELU epilogue acts on GPUs only): one
# run of them all at each world size
PLAIN_FAMILIES = ["tiny-flux2", "tiny-zimage", "tiny-hunyuan-video"]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", [name for name in ADAPTERS if name not in PLAIN_FAMILIES])
def test_adapters_equal_stock(name: str, world_size: int) -> None:
    run_on_ranks(world_size, _adapters_worker, name, deadline_s=600)


def _plain_family_worker(name: str) -> None:
    _adapters_worker(name, steps=["load a", "load b, set_adapters a 0.7, b 0.3", "hotswap a", "disable_lora",
                                  "fuse_lora, unload_lora_weights"])


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("name", PLAIN_FAMILIES)
def test_adapters_equal_stock_on_more_families(name: str, world_size: int) -> None:
    run_on_ranks(world_size, _plain_family_worker, name)


def _ring_worker(name: str) -> None:
    _adapters_worker(name, degrees={"ring_degree": 2})


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-zimage"])
def test_adapters_on_a_ring_equal_stock(name: str) -> None:
    """Every step of the sequence with the sequence split as a ring of two ranks: FLUX.1 (its split projection
    and the ring's joint text) and Z-Image (30 heads, which Ulysses over 4 or 8 ranks cannot split)."""
    run_on_ranks(2, _ring_worker, name)


def _sharded_experts_worker() -> None:
    pipe = _fresh("tiny-hidream")
    pipe.load_lora_weights(lora_state_dict(pipe.transformer, ADAPTERS["tiny-hidream"]["a"], 0), adapter_name="a")
    xstage_dit.enable(pipe, timeout_s=120, expert_parallel=True)
    with pytest.raises(NotImplementedError, match="routed expert 1.w1 is a peft.* expert_parallel=True cannot run"):
        generate_latents(pipe, "tiny-hidream")
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
    ref = generate_latents(pipe, "tiny-nucleusmoe")
    xstage_dit.enable(pipe, timeout_s=120)
    if os.environ["WORLD_SIZE"] == "1":
        error = relative_error(generate_latents(pipe, "tiny-nucleusmoe"), ref)
        assert error < TOLERANCE, f"NucleusMoE-Image with adapted experts: relative error {error:.2e}"
    else:
        with pytest.raises(NotImplementedError, match="routed-experts module is a peft.*ParamWrapper"):
            generate_latents(pipe, "tiny-nucleusmoe")
    xstage_dit.disable(pipe)


@pytest.mark.parametrize("world_size", [1, 2])
def test_adapters_on_packed_experts(world_size: int) -> None:
    run_on_ranks(world_size, _packed_experts_worker)


def _cast_flux():
    pipe = _fresh("tiny-flux")
    pipe.transformer.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)
    return pipe


def _falls_back_to_diffusers(build, what: str, warning: str) -> None:
    """The pipeline `build()` makes, enabled, equals it stock, with one warning containing `warning`: the layer it
    names runs diffusers' code."""
    ref = generate_latents(build(), "tiny-flux")
    pipe = build()
    xstage_dit.enable(pipe, timeout_s=120)
    with xstage_warnings() as warnings:
        error = relative_error(generate_latents(pipe, "tiny-flux"), ref)
    assert error < TOLERANCE, f"{what}: relative error {error:.2e}"
    assert any(warning in w for w in warnings), warnings
    xstage_dit.disable(pipe)


def _hooked_norms(pipe):
    attention = [pipe.transformer.transformer_blocks[0].attn, pipe.transformer.single_transformer_blocks[0].attn]
    for attn in attention:
        attn.norm_q.register_forward_hook(lambda module, args, output: output * 1.5)
    return pipe


def _hooked_layers_worker() -> None:
    # diffusers' layerwise casting (float8 storage, hooks that cast each Linear's weights on its call): the split
    # projection runs diffusers' block for a proj_out with those hooks, instead of multiplying by its float8 weights
    _falls_back_to_diffusers(_cast_flux, "layerwise-cast FLUX.1",
                             "FluxSingleTransformerBlock.proj_out in the split projection has hooks on its forward")
    # a q/k norm with a forward hook: the norm + RoPE processor, which reads the norms' weights, runs diffusers'
    # processor for that attention instead
    _falls_back_to_diffusers(lambda: _hooked_norms(_fresh("tiny-flux")), "FLUX.1 with hooked norms",
                             "FluxAttention.norm_q in the norm + RoPE pass has hooks on its forward")


@pytest.mark.parametrize("world_size", [1, 2])
def test_hooked_layers_run_diffusers_code(world_size: int) -> None:
    run_on_ranks(world_size, _hooked_layers_worker)


def test_adapters_equal_stock_compiled() -> None:
    """compile_repeated_blocks(fullgraph=True): the blocks compile with the adapters' layers in them, and again
    as those come and go."""
    run_on_ranks(1, _adapters_worker, "tiny-flux", "cpu", torch.float32, TOLERANCE, None, True)


@pytest.mark.gpu
def test_adapters_equal_stock_on_gpu() -> None:
    """bfloat16 on a GPU, where the GELU epilogue computes plain projections in one GEMM and calls the LoRA
    layers (CUDA graphs off: the test below has them on)."""
    run_on_ranks(1, _adapters_worker, "tiny-flux", "cuda", torch.bfloat16, 3e-2, False)


@pytest.mark.gpu
def test_adapter_changes_reach_cuda_graphs_on_gpu() -> None:
    """With CUDA graphs: each change of the adapters drops the graphs captured before it (their scales and
    layers are baked in), and the calls after it capture and replay the adapters as they are."""
    run_on_ranks(1, _adapters_worker, "tiny-flux", "cuda", torch.bfloat16, 3e-2, True, False, None, 3)


@pytest.mark.gpu
def test_gelu_epilogue_calls_adapter_layers_on_gpu(monkeypatch) -> None:
    """A projection that is a PEFT LoRA layer runs as diffusers' GELU runs it (the same bits), with one warning
    naming it; merged into a plain Linear again, it is one GEMM with the GELU in its epilogue."""
    from diffusers.models.activations import GELU
    from peft import LoraConfig, inject_adapter_in_model

    from xstage_dit.fusions.gelu import epilogue_gelus
    from xstage_dit.logging_utils import fresh_warnings

    torch.manual_seed(0)
    holder = nn.Sequential(GELU(64, 256, approximate="tanh"))
    inject_adapter_in_model(LoraConfig(r=RANK, target_modules=["proj"], init_lora_weights=False), holder)
    holder.to("cuda", torch.bfloat16)
    x = torch.randn(3, 17, 64, device="cuda", dtype=torch.bfloat16)
    epilogues = []
    addmm_activation = torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation",
                        lambda *args, **kwargs: epilogues.append(1) or addmm_activation(*args, **kwargs))
    with fresh_warnings(), torch.no_grad():
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
