"""The layer registry (xstage_dit/layers.py): every registered layer is installed by some test job here, and taking
each one off, last first, restores exactly what the model and the pipeline were before it: classes, instance
forwards and attributes, hooks, processors, parameters and buffers, the names routing rebinds; once every layer is
off, the pipeline computes the stock result bit for bit."""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import pytest
import torch
from torch import nn

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks
from pipeline_checks import seeded_latents
from xstage_dit import api, patches
from xstage_dit.hooks.layers import stack_of
from xstage_dit.layers import MODEL_LAYERS, PIPELINE_LAYERS, layer_names
from xstage_dit.sp.plan import FAMILY_LAYERS, SequenceParallelPlan

# install only where there is a GPU (tests/test_cuda_graphs.py checks the graphs' removal, tests/test_fp8.py the
# FP8 layers')
GPU_ONLY = {"CUDA graphs", "FP8 linear", "FP8 steps"}
BOOKKEEPING = {"_xstage_dit_applied", "_xstage_dit_layers"}  # enable's own records, gone after disable


def _module_state(root: nn.Module) -> list[tuple]:
    """What a layer may change in a module tree, module by module."""
    return [(name, type(module), sorted(set(module.__dict__) - BOOKKEEPING), id(module.__dict__.get("forward")),
             list(module._forward_pre_hooks.values()), list(module._forward_hooks.values()),
             type(getattr(module, "processor", None)),
             [(key, t.data_ptr(), t.dtype, t.device, t.requires_grad) for key, t in
              [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]])
            for name, module in root.named_modules()]


def _rebound_names(model: nn.Module) -> list[Any]:
    """The library names the plan's routing rebinds, as they are bound now."""
    plan = patches.plan_for(model)
    module_name, kind = plan.call_site
    bound = [importlib.import_module(module_name).__dict__[kind]]
    if plan.rotary_site is not None:
        bound.append(importlib.import_module(plan.rotary_site).__dict__["apply_rotary_emb"])
    return bound


def _model_state(model: nn.Module) -> tuple:
    return _module_state(model), _rebound_names(model)


def _pipeline_state(pipe: Any) -> tuple:
    vae = getattr(pipe, "vae", None)
    return (type(pipe), dict(getattr(pipe, "_progress_bar_config", {})),
            _module_state(vae) if vae is not None else None)


def _first_difference(now: Any, then: Any) -> str:
    if isinstance(now, (tuple, list)) and isinstance(then, (tuple, list)) and len(now) == len(then):
        return next(_first_difference(a, b) for a, b in zip(now, then) if a != b)
    return f"{now!r} instead of {then!r}"


def _recording(layers: tuple, before: dict[tuple[int, str], tuple]) -> tuple:
    """`layers` with each install recording the state of its target first (under the target's id)."""

    def record(layer):
        def install(job):
            target = getattr(job, "model", None) or job.pipe
            state = _model_state(target) if isinstance(target, nn.Module) else _pipeline_state(target)
            before[id(target), layer.name] = state
            return layer.install(job)

        return dataclasses.replace(layer, install=install)

    return tuple(record(layer) for layer in layers)


def _take_off_one_by_one(target: Any, state_of, before: dict[tuple[int, str], tuple]) -> list[str]:
    stack = stack_of(target)
    removed = []
    while stack.installed:
        installed = stack.installed.pop()
        installed.remove()
        now, then = state_of(target), before[id(target), installed.layer]
        assert now == then, f"removing {installed.layer!r} left changes: {_first_difference(now, then)}"
        removed.append(installed.layer)
    return removed


def _registry_worker(names: list[str], cfg_degree: int) -> set[str]:
    before: dict[tuple[int, str], tuple] = {}
    api.MODEL_LAYERS, api.PIPELINE_LAYERS = _recording(MODEL_LAYERS, before), _recording(PIPELINE_LAYERS, before)
    seen = set()
    for name in names:
        pipe = zoo.build_pipeline(name)
        pipe.set_progress_bar_config(disable=True)
        generate = seeded_latents(pipe, name, "even", steps=2, guidance=3.0)
        stock = generate()
        xstage_dit.enable(pipe, backend="reference", cfg_degree=cfg_degree, timeout_s=120)
        installed = xstage_dit.installed_layers(pipe)
        generate()
        removed = _take_off_one_by_one(pipe, _pipeline_state, before)
        removed += _take_off_one_by_one(pipe.transformer, _model_state, before)
        assert sorted(removed) == sorted(installed), (removed, installed)
        xstage_dit.disable(pipe)
        assert xstage_dit.installed_layers(pipe) == []
        assert torch.equal(generate(), stock), f"{name}: the stock result differs once every layer is off"
        seen.update(installed)
    return seen


def _every_layer_worker() -> None:
    seen = _registry_worker(["tiny-flux", "tiny-nucleusmoe"], cfg_degree=2)
    seen |= _registry_worker(["tiny-hunyuan-video15", "tiny-sd3.5"], cfg_degree=1)
    missing = set(layer_names()) - seen - GPU_ONLY
    if torch.distributed.get_rank() == 0:
        missing.discard("main-rank progress")  # rank 0 shows progress: the layer is on the other ranks
    assert not missing, f"registered layers no test job here installs: {sorted(missing)}"


def test_every_layer_comes_off_exactly() -> None:
    """Four ranks as CFG 2 x Ulysses 2 (FLUX.1: norm + RoPE processors, GELU epilogue, split projection, parallel
    VAE; NucleusMoE-Image: its family changes and MoE experts), then HunyuanVideo 1.5 (its own processors) and SD3.5
    (input checks) over Ulysses 4."""
    run_on_ranks(4, _every_layer_worker, deadline_s=600)


def test_installed_layers_names_them_in_order() -> None:
    """One process: the layers that apply at degree 1, in the table's order."""
    flux_pipe = zoo.build_pipeline("tiny-flux")
    xstage_dit.enable(flux_pipe)
    installed = xstage_dit.installed_layers(flux_pipe)
    xstage_dit.disable(flux_pipe)
    order = layer_names()
    assert installed == sorted(installed, key=order.index)
    assert {"attention routing", "fused RoPE", "GELU epilogue", "split projection"} <= set(installed)
    assert not {"token split", "cache decisions", "CFG split", "pipeline call", "parallel VAE"} & set(installed)
    assert xstage_dit.installed_layers(flux_pipe) == []


def test_a_plan_installs_only_into_the_layers_a_family_fills() -> None:
    """A family plan's installs are keyed by the names of `enable`'s layers; a name that is no such layer (a typo, or
    a layer the library fills itself) is refused when the plan is made, naming the layers it could use."""
    assert set(FAMILY_LAYERS) <= set(layer_names())
    with pytest.raises(ValueError, match="token split.*not layers a family fills"):
        SequenceParallelPlan(family="made-up", call_site=("m", "dispatch"), attention_modules=lambda model: [],
                             cfg=None, installs={"token split": lambda model, context: []})
