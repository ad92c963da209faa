"""What xstage_dit sees of a model changed after `enable` (runtime/model_changes.py): each way users change a
model's weights or adapters moves its key, or is the documented exception; a CUDA-graphed forward drops its graphs
when the key moved; and reading the key while nothing changed the model costs microseconds."""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from xstage_dit.testing import zoo
from lora_weights import ADAPTERS, lora_state_dict
from model_change_checks import assert_moves, flux_inputs
from xstage_dit.runtime.cuda_graphs import GraphedForward
from xstage_dit.runtime.agreement import Fingerprint
from xstage_dit.runtime.model_changes import ChangesSinceEnable, ModelChanges


def _scaled_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor * 1.5 for name, tensor in model.state_dict().items()}


def test_every_common_change_moves_the_key() -> None:
    """Both readers: the ranks' check (writes) and a CUDA-graphed forward (storage)."""
    pipe = zoo.build_pipeline("tiny-flux")
    model = pipe.transformer
    weight = model.transformer_blocks[0].attn.to_q.weight
    adapters = {name: lora_state_dict(model, ADAPTERS["tiny-flux"]["a"], seed) for name, seed in (("a", 0), ("b", 1))}
    # (what, the change, whether the check's key moves, whether the graphs' key moves)
    sequence: list[tuple[str, Callable[[], object], bool, bool]] = [
        ("nothing", lambda: None, False, False),
        ("a forward", lambda: model(**flux_inputs(model)), False, False),
        ("in place under no_grad", lambda: weight.mul_(2.0), True, False),
        ("load_state_dict", lambda: model.load_state_dict(_scaled_state(model)), True, False),
        ("load_state_dict(assign=True)", lambda: model.load_state_dict(_scaled_state(model), assign=True), True,
         True),
        ("param.data = another tensor", lambda: setattr(model.proj_out.weight, "data", model.proj_out.weight * 2),
         True, True),
        ("param.data.mul_", lambda: model.proj_out.weight.data.mul_(2), True, False),
        ("param[...] = ...", lambda: model.proj_out.bias.__setitem__(0, 1.0), True, False),
        ("param += ...", lambda: model.proj_out.bias.__iadd__(1.0), True, False),
        ("load_lora_weights", lambda: pipe.load_lora_weights(adapters["a"], adapter_name="a"), True, True),
        ("set_adapters", lambda: pipe.set_adapters(["a"], [0.5]), True, True),
        ("the same set_adapters again", lambda: pipe.set_adapters(["a"], [0.5]), False, False),
        ("hotswap (its scale replaces set_adapters' weight)",
         lambda: pipe.load_lora_weights(adapters["b"], adapter_name="a", hotswap=True), True, True),
        ("hotswap at the same scale (written through .data)",
         lambda: pipe.load_lora_weights(adapters["a"], adapter_name="a", hotswap=True), True, False),
        ("disable_lora", pipe.disable_lora, True, True),
        ("enable_lora", pipe.enable_lora, True, True),
        ("fuse_lora", pipe.fuse_lora, True, True),
        ("unfuse_lora", pipe.unfuse_lora, True, True),
        ("delete_adapters", lambda: pipe.delete_adapters("a"), True, True),
        ("load again", lambda: pipe.load_lora_weights(adapters["a"], adapter_name="a"), True, True),
        ("unload_lora_weights", pipe.unload_lora_weights, True, True),
    ]
    assert_moves(model, sequence)


def test_the_hooks_are_there_only_while_a_model_is_watched() -> None:
    """write_hooks.py's wrappers sit on `nn.Parameter` and PEFT's tuner layer classes from the first watcher to
    the last (removed or freed); writes to parameters of no watched model move nothing."""
    import gc

    from peft.tuners.lora.layer import Linear as LoraLinear
    from peft.tuners.lora.layer import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    classes = (nn.Parameter, LoraLinear, LoraLayer, BaseTunerLayer)
    before = {cls: dict(vars(cls)) for cls in classes}
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    first, second = ModelChanges(model, writes=True, storage=False), ModelChanges(model, writes=True, storage=False)
    assert "data" in vars(nn.Parameter) and vars(LoraLayer)["set_scale"] is not before[LoraLayer]["set_scale"]
    with torch.no_grad():
        other.weight.mul_(2.0)
        other.weight.data.mul_(2.0)
    assert not first.moved()
    first.remove()
    assert "data" in vars(nn.Parameter)  # the second still watches
    del second
    gc.collect()
    assert {cls: dict(vars(cls)) for cls in classes} == before


def test_a_changed_model_drops_its_graphs(monkeypatch) -> None:
    """The invalidation itself, without a GPU: the forward runs eagerly (its arguments are on the CPU), and the
    check before it drops the graphs exactly when the model moved."""
    pipe = zoo.build_pipeline("tiny-flux")
    model = pipe.transformer
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    graphed = GraphedForward(model, torch.device("cuda", 0))
    resets = []
    monkeypatch.setattr(graphed, "reset", lambda: resets.append(1))
    inputs = flux_inputs(model)
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


def _fastest_call_us(call: Callable[[], object]) -> float:
    """The fastest of 20 batches of 10 calls: the least disturbed by other work on the machine."""
    batches = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(10):
            call()
        batches.append((time.perf_counter() - start) / 10)
    return min(batches) * 1e6


def test_reading_a_model_costs_microseconds() -> None:
    """What a model of FLUX.1-dev's size (on the meta device) costs its readers while nothing changes it: the
    ranks' check before each pipeline call (`ChangesSinceEnable.add_to`) and a CUDA-graphed forward
    (`ModelChanges.moved`), without and with a LoRA on its attention and feed-forward projections; and the read
    after a change, which walks it."""
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig

    with torch.device("meta"):
        model = FluxTransformer2DModel(num_layers=19, num_single_layers=38)
    weight = model.proj_out.weight
    for lora in (False, True):
        if lora:
            model.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                              "add_k_proj", "add_v_proj", "to_add_out", "proj_mlp",
                                                              "proj_out", "ff.net.0.proj", "ff.net.2"]))
        watched = f"{len(list(model.parameters()))} parameters" + (", a LoRA" if lora else "")
        check = ChangesSinceEnable(model, "transformer")
        graphs = ModelChanges(model, writes=False, storage=True)
        costs = {"before each pipeline call": _fastest_call_us(lambda: check.add_to(Fingerprint())),
                 "before each CUDA-graphed forward": _fastest_call_us(graphs.moved),
                 "after a write": _fastest_call_us(lambda: (weight.data, graphs.moved()))}
        check.remove()
        graphs.remove()
        for reader, per_call_us in costs.items():
            print(f"\nFLUX.1-dev ({watched}), {reader}: {per_call_us:.1f} µs")
        assert costs["before each pipeline call"] < 500 and costs["before each CUDA-graphed forward"] < 500  # loose
