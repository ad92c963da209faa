"""What xstage_dit sees of a model changed after `enable` (runtime/model_changes.py): each way users change a
model's weights or adapters moves its key, or is the documented exception; a CUDA-graphed forward drops its graphs
when the key moved; and reading the key costs tens of microseconds for a model of FLUX.1-dev's size."""
from __future__ import annotations

import time
from typing import Callable

import pytest
import torch
from torch import nn

import zoo
from test_lora import ADAPTERS, lora_state_dict
from xstage_dit.runtime.cuda_graphs import GraphedForward
from xstage_dit.runtime.model_changes import ModelChanges


def _inputs(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """A FLUX.1 transformer call on 4 image and 3 text tokens."""
    return {"hidden_states": torch.randn(1, 4, model.config.in_channels),
            "encoder_hidden_states": torch.randn(1, 3, model.config.joint_attention_dim),
            "pooled_projections": torch.randn(1, model.config.pooled_projection_dim),
            "timestep": torch.tensor([0.5]), "img_ids": torch.zeros(4, 3), "txt_ids": torch.zeros(3, 3),
            "guidance": torch.tensor([3.0]) if model.config.guidance_embeds else None}


def _scaled_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor * 1.5 for name, tensor in model.state_dict().items()}


def test_every_common_change_moves_the_key() -> None:
    """Both readers: the ranks' check (version counters) and a CUDA-graphed forward (storage)."""
    pipe = zoo.build_pipeline("tiny-flux")
    model = pipe.transformer
    weight = model.transformer_blocks[0].attn.to_q.weight
    adapters = {name: lora_state_dict(model, ADAPTERS["tiny-flux"]["a"], seed) for name, seed in (("a", 0), ("b", 1))}
    check = ModelChanges(model, versions=True, storage=False)
    graphs = ModelChanges(model, versions=False, storage=True)
    # (what, the change, whether the check's key moves, whether the graphs' key moves)
    sequence: list[tuple[str, Callable[[], object], bool, bool]] = [
        ("nothing", lambda: None, False, False),
        ("a forward", lambda: model(**_inputs(model)), False, False),
        ("in place under no_grad", lambda: weight.mul_(2.0), True, False),
        ("load_state_dict", lambda: model.load_state_dict(_scaled_state(model)), True, False),
        ("load_state_dict(assign=True)", lambda: model.load_state_dict(_scaled_state(model), assign=True), True,
         True),
        ("param.data = another tensor", lambda: setattr(model.proj_out.weight, "data", model.proj_out.weight * 2),
         False, True),
        ("param.data.mul_ (not counted by torch)", lambda: model.proj_out.weight.data.mul_(2), False, False),
        ("load_lora_weights", lambda: pipe.load_lora_weights(adapters["a"], adapter_name="a"), True, True),
        ("set_adapters", lambda: pipe.set_adapters(["a"], [0.5]), True, True),
        ("the same set_adapters again", lambda: pipe.set_adapters(["a"], [0.5]), False, False),
        ("hotswap (its scale replaces set_adapters' weight)",
         lambda: pipe.load_lora_weights(adapters["b"], adapter_name="a", hotswap=True), True, True),
        ("hotswap at the same scale (written through .data)",
         lambda: pipe.load_lora_weights(adapters["a"], adapter_name="a", hotswap=True), False, False),
        ("disable_lora", pipe.disable_lora, True, True),
        ("enable_lora", pipe.enable_lora, True, True),
        ("fuse_lora", pipe.fuse_lora, True, True),
        ("unfuse_lora", pipe.unfuse_lora, True, True),
        ("delete_adapters", lambda: pipe.delete_adapters("a"), True, True),
        ("load again", lambda: pipe.load_lora_weights(adapters["a"], adapter_name="a"), True, True),
        ("unload_lora_weights", pipe.unload_lora_weights, True, True),
    ]
    for what, change, check_moves, graphs_move in sequence:
        with torch.no_grad():
            change()
        assert (check.moved(), graphs.moved()) == (check_moves, graphs_move), what
    check.remove()
    graphs.remove()


def test_a_changed_model_drops_its_graphs(monkeypatch) -> None:
    """The invalidation itself, without a GPU: the forward runs eagerly (its arguments are on the CPU), and the
    check before it drops the graphs exactly when the model moved."""
    pipe = zoo.build_pipeline("tiny-flux")
    model = pipe.transformer
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphed = GraphedForward(model, torch.device("cuda", 0))
    resets = []
    monkeypatch.setattr(graphed, "reset", lambda: resets.append(1))
    inputs = _inputs(model)
    with torch.no_grad():
        model(**inputs)
        model(**inputs)
        assert resets == []
        pipe.load_lora_weights(lora_state_dict(model, ADAPTERS["tiny-flux"]["b"], 0), adapter_name="b")
        model(**inputs)
        assert resets == [1]
        pipe.set_adapters(["b"], [0.3])
        model(**inputs)
        model(**inputs)
        assert resets == [1, 1]
    graphed.remove()


def test_reading_a_model_costs_microseconds() -> None:
    """The key of a model of FLUX.1-dev's size (on the meta device), read as the pipeline-call check and a
    CUDA-graphed forward read it."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=19, num_single_layers=38)
    for versions, reader in ((True, "before each pipeline call"), (False, "before each CUDA-graphed forward")):
        changes = ModelChanges(model, versions=versions, storage=not versions)
        batches = []  # the fastest batch: the least disturbed by other work on the machine
        for _ in range(20):
            start = time.perf_counter()
            for _ in range(10):
                changes.moved()
            batches.append((time.perf_counter() - start) / 10)
        per_call_us = min(batches) * 1e6
        changes.remove()
        print(f"\nModelChanges.moved() {reader}, FLUX.1-dev's {len(list(model.parameters()))} parameters: "
              f"{per_call_us:.0f} µs")
        assert per_call_us < 5000  # loose: shared CI machines; docs/performance.md has the number
