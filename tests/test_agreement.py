"""The ranks check at `enable`, in one small collective, that they got the same arguments and models, and before
each pipeline call that they got the same arguments and changed their models the same way since: a rank with
other weights, another backend or other arguments makes every rank raise an error naming it, instead of silently
wrong images or a hang in a collective the others never join. `check_inputs=False` skips the check."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks
from lora_weights import ADAPTERS, lora_state_dict


def _worker(differ: str, check: bool) -> None:
    rank = int(__import__("os").environ["RANK"])
    pipe = zoo.build_pipeline("tiny-flux", seed=rank if differ == "weights" else 0)
    backend = "overlap" if differ == "backend" and rank == 1 else "reference"
    if not check:
        xstage_dit.enable(pipe, backend=backend, timeout_s=60, check_inputs=False)
        return
    what = {"weights": "rank 1's FluxTransformer2DModel weights differs", "backend": "rank 1's backend differs"}
    with pytest.raises(ValueError, match=what[differ]):
        xstage_dit.enable(pipe, backend=backend, timeout_s=60)
    assert not hasattr(pipe.transformer, "_xstage_dit_applied")
    dist.barrier()  # both ranks raised and neither is stuck in a collective


@pytest.mark.parametrize("differ", ["weights", "backend"])
def test_ranks_that_disagree_are_named(differ):
    run_on_ranks(2, _worker, differ, True, deadline_s=120)


def test_the_check_can_be_turned_off():
    run_on_ranks(2, _worker, "weights", False, deadline_s=120)


def _call_worker() -> None:
    """Before every pipeline call the ranks compare its arguments: a rank with another seed, other prompt
    embeddings, another size, or an argument the others do not pass makes every rank raise an error naming it."""
    rank = int(__import__("os").environ["RANK"])
    name = "tiny-flux"
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    xstage_dit.enable(pipe, backend="reference", timeout_s=60)

    def call(seed: int = 0, embeddings_seed: int = 0, height: int = 32, **extra) -> None:
        kwargs = zoo.call_kwargs(name, height=height, width=48, num_frames=1, steps=1, guidance=1.0)
        pipe(**kwargs, **zoo.text_embeddings(name, 1, seed=embeddings_seed), output_type="latent",
             generator=torch.Generator().manual_seed(seed), **extra)

    mine = 1 if rank == 1 else 0
    cases = [({"seed": mine}, "rank 1's generator \\(state\\) differs"),
             ({"embeddings_seed": mine}, "rank 1's prompt_embeds \\(sum\\) differs"),
             ({"height": 32 + 16 * mine}, "rank 1's height differs"),
             ({"latents": None} if rank == 0 else {"latents": torch.zeros(1, 24, 64)},
              "rank 1 passes other arguments than rank 0")]
    for differ, message in cases:
        with pytest.raises(ValueError, match=f"the arguments and models of a FluxPipeline call: {message}"):
            call(**differ)
        dist.barrier()  # every rank raised and none is stuck in a collective
    call()  # the same arguments pass


def test_ranks_whose_pipeline_calls_differ_are_named():
    run_on_ranks(2, _call_worker, deadline_s=120)


def _changed_model_worker() -> None:
    """After `enable`, before every pipeline call the ranks also compare what changed their transformer since:
    a rank that changed it alone (weights scaled in place, directly or through `.data`, given other memory through
    `.data`, a state dict loaded, a LoRA loaded and fused, and then unloaded with its weights left merged) makes
    every rank raise an error naming it; the same change on every rank passes and equals stock diffusers with that
    change."""
    rank = int(__import__("os").environ["RANK"])
    name, alone = "tiny-flux", rank == 2
    pipe, stock = zoo.build_pipeline(name), zoo.build_pipeline(name)
    xstage_dit.enable(pipe, backend="reference", timeout_s=60)
    model = pipe.transformer
    weight = model.transformer_blocks[0].attn.to_q.weight

    def call(target) -> torch.Tensor:
        target.set_progress_bar_config(disable=True)
        kwargs = zoo.call_kwargs(name, height=32, width=48, num_frames=1, steps=1, guidance=1.0)
        return target(**kwargs, **zoo.text_embeddings(name, 1, seed=0), output_type="latent",
                      generator=torch.Generator().manual_seed(0), return_dict=False)[0]

    def refused(what: str) -> None:
        transformer = "transformer \\(FluxTransformer2DModel\\)"
        with pytest.raises(ValueError, match=f"models of a FluxPipeline call: rank 2's {transformer}'s {what}"):
            call(pipe)
        dist.barrier()  # every rank raised and none is stuck in a collective

    with torch.no_grad():
        weight.mul_(2.0 if alone else 1.0)
        refused("weights")
        weight.div_(2.0 if alone else 1.0)
        call(pipe)  # as it was again
        saved = {key: value.clone() for key, value in model.state_dict().items()}
        if alone:
            model.load_state_dict({key: value * 0.5 for key, value in saved.items()})
        refused("weights")
        model.load_state_dict(saved)
        call(pipe)
        weight.data.mul_(2.0 if alone else 1.0)  # through `.data`, which torch's version counters miss
        refused("weights")
        weight.data.div_(2.0 if alone else 1.0)
        call(pipe)
        if alone:
            weight.data = weight.data * 2.0  # other memory
        refused("weights")
        weight.data = weight.data / (2.0 if alone else 1.0)
        call(pipe)

    for target in (pipe, stock):  # written through `.data` on every rank
        written = target.transformer.transformer_blocks[0].attn.to_q
        written.weight.data = written.weight.data * 1.5
        written.bias.data.mul_(0.5)
    error = ((call(pipe) - call(stock)).norm() / call(stock).norm()).item()
    assert error < 1e-4, f"weights written through .data on every rank: relative error {error:.2e}"

    for target in (pipe, stock):  # the same on every rank
        target.load_lora_weights(lora_state_dict(model, ADAPTERS[name]["a"], 0), adapter_name="a")
        target.set_adapters(["a"], [0.6])
    error = ((call(pipe) - call(stock)).norm() / call(stock).norm()).item()
    assert error < 1e-4, f"a weighted LoRA on every rank: relative error {error:.2e}"
    for target in (pipe, stock):
        target.fuse_lora()
        target.unload_lora_weights()
    error = ((call(pipe) - call(stock)).norm() / call(stock).norm()).item()
    assert error < 1e-4, f"a LoRA fused on every rank: relative error {error:.2e}"

    if alone:
        pipe.load_lora_weights(lora_state_dict(model, ADAPTERS[name]["b"], 1), adapter_name="b")
        pipe.fuse_lora()
    refused("adapters")
    if alone:
        pipe.unload_lora_weights()  # its weights stay merged
    refused("weights")
    xstage_dit.disable(pipe)


def test_a_model_changed_on_one_rank_is_named():
    run_on_ranks(3, _changed_model_worker, deadline_s=180)
