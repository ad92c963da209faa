"""The ranks check at `enable`, in one small collective, that they got the same arguments and models: a rank
with other weights or another backend makes every rank raise an error naming it, instead of silently wrong
images or a hang in a collective the others never join. `check_inputs=False` skips the check."""
from __future__ import annotations

import pytest
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
