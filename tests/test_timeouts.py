"""enable's timeout_s bounds every collective of its groups, also when the caller started the process group with
a longer timeout: a rank whose peer stalls or dies (before the call, inside a step, between steps, before the
decode) raises within timeout_s, naming itself and what it waited for, instead of waiting for the caller's
timeout."""
from __future__ import annotations

import os
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

import xstage_dit
from xstage_dit.testing import zoo
from dist_harness import run_on_ranks

TIMEOUT_S = 3.0


# where rank 1 stops taking part: (check_inputs, steps, output type, what rank 0's error must name)
POINTS = {
    "stalled-at-the-call-check": (True, 1, "latent", "agree"),
    "stalled-in-the-forward": (False, 1, "latent", "all-to-all"),  # the forward's first attention
    "killed-between-steps": (False, 2, "latent", "all-to-all"),  # the second step's first attention
    "stalled-before-the-decode": (False, 1, "pt", "parallel VAE decode"),
}


def _stop(point: str, step: int, steps: int) -> None:
    """Rank 1 leaving the call at `point`: asleep past the timeout, or dead without a word."""
    if point == "killed-between-steps" and step == 0:
        os._exit(0)
    if point == "stalled-before-the-decode" and step == steps - 1:
        time.sleep(TIMEOUT_S + 2)
        os._exit(0)


def _stalled_peer_worker(point: str) -> None:
    check_inputs, steps, output_type, named = POINTS[point]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # the caller's own group and timeout
    pipe = zoo.build_pipeline("tiny-flux")
    xstage_dit.enable(pipe, backend="reference", timeout_s=TIMEOUT_S, check_inputs=check_inputs)
    if dist.get_rank() == 1 and point in ("stalled-at-the-call-check", "stalled-in-the-forward"):
        time.sleep(TIMEOUT_S + 2)  # never joins the pipeline call
        return
    entry = zoo.ZOO["tiny-flux"]
    kwargs = zoo.call_kwargs("tiny-flux", height=entry.height, width=entry.width, num_frames=1, steps=steps,
                             guidance=3.0)

    def on_step_end(pipe, step: int, timestep, outputs: dict) -> dict:
        if dist.get_rank() == 1:
            _stop(point, step, steps)
        return outputs

    start = time.monotonic()
    try:
        pipe(**kwargs, **zoo.text_embeddings("tiny-flux", 1, seed=0), output_type=output_type,
             callback_on_step_end=on_step_end)
    except RuntimeError as error:
        waited = time.monotonic() - start
        assert waited < TIMEOUT_S + 5, f"raised after {waited:.1f}s, timeout_s={TIMEOUT_S}"
        assert "rank 0" in str(error) and named in str(error), f"the error does not say who waited for what: {error}"
        return
    raise AssertionError(f"rank 0 finished the call without its peer ({point})")


@pytest.mark.parametrize("point", list(POINTS))
def test_a_stopped_peer_raises_within_timeout_s_under_the_callers_group(point):
    run_on_ranks(2, _stalled_peer_worker, point, deadline_s=90)


def _enable_on_some_ranks_worker(caller_starts_the_group: bool) -> None:
    if caller_starts_the_group:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if os.environ["RANK"] == "1":
        return  # never calls enable
    pipe = zoo.build_pipeline("tiny-flux")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"^xstage_dit: rank 0 waited {TIMEOUT_S:g} s for all 2 ranks of the job "
                                           r"to call xstage_dit.enable and gave up: every rank must call it"):
        xstage_dit.enable(pipe, backend="reference", timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S + 5


@pytest.mark.parametrize("caller_starts_the_group", [False, True], ids=["enable-starts-it", "caller-started-it"])
def test_enable_on_some_ranks_only_says_so_within_timeout_s(caller_starts_the_group):
    run_on_ranks(2, _enable_on_some_ranks_worker, caller_starts_the_group, deadline_s=90)


def _call_after_the_group_is_gone_worker() -> None:
    pipe = zoo.build_pipeline("tiny-flux")
    xstage_dit.enable(pipe, backend="reference", timeout_s=TIMEOUT_S)
    dist.destroy_process_group()
    kwargs = zoo.call_kwargs("tiny-flux", height=16, width=16, num_frames=1, steps=1, guidance=1.0)
    with pytest.raises(RuntimeError, match=r"^xstage_dit: the process group is gone \(torch.distributed."
                                           r"destroy_process_group was called after xstage_dit.enable\)"):
        pipe(**kwargs, **zoo.text_embeddings("tiny-flux", 1, seed=0), output_type="latent")


def test_a_call_after_the_process_group_is_destroyed_says_so():
    run_on_ranks(2, _call_after_the_group_is_gone_worker, deadline_s=90)
