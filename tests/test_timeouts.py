"""enable's timeout_s bounds every collective of its groups, also when the caller started the process group with
a longer timeout: a rank whose peer never arrives raises instead of waiting for the caller's timeout."""
from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import xstage_dit
import zoo
from dist_harness import run_on_ranks

TIMEOUT_S = 3.0


def _stalled_peer_worker(check_inputs: bool) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))  # the caller's own group and timeout
    pipe = zoo.build_pipeline("tiny-flux")
    xstage_dit.enable(pipe, backend="reference", timeout_s=TIMEOUT_S, check_inputs=check_inputs)
    if dist.get_rank() == 1:
        time.sleep(TIMEOUT_S + 6)  # never joins the pipeline call
        return
    entry = zoo.ZOO["tiny-flux"]
    kwargs = zoo.call_kwargs("tiny-flux", height=entry.height, width=entry.width, num_frames=1, steps=1,
                             guidance=3.0)
    start = time.monotonic()
    try:
        pipe(**kwargs, **zoo.text_embeddings("tiny-flux", 1, seed=0), output_type="latent")
    except RuntimeError as error:
        waited = time.monotonic() - start
        assert waited < TIMEOUT_S + 5, f"raised after {waited:.1f}s, timeout_s={TIMEOUT_S}"
        # the first collective of the forward is the first attention's all-to-all
        named = "rank 0" in str(error) and ("agree" in str(error) if check_inputs else "all-to-all" in str(error))
        assert named, f"the error does not say who waited for what: {error}"
        return
    raise AssertionError("rank 0 finished a forward pass without its peer")


@pytest.mark.parametrize("check_inputs", [True, False], ids=["stalled-at-the-call-check", "stalled-in-the-forward"])
def test_a_stalled_peer_raises_within_timeout_s_under_the_callers_group(check_inputs):
    run_on_ranks(2, _stalled_peer_worker, check_inputs, deadline_s=90)
