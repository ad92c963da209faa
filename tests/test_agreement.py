"""The ranks check at `enable`, in one small collective, that they got the same arguments and models: a rank
with other weights or another backend makes every rank raise an error naming it, instead of silently wrong
images or a hang in a collective the others never join. `check_inputs=False` skips the check."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import xstage_dit
import zoo
from dist_harness import run_on_ranks


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
        with pytest.raises(ValueError, match=f"the arguments of a FluxPipeline call: {message}"):
            call(**differ)
        dist.barrier()  # every rank raised and none is stuck in a collective
    call()  # the same arguments pass


def test_ranks_whose_pipeline_calls_differ_are_named():
    run_on_ranks(2, _call_worker, deadline_s=120)
