"""examples/step_timer.py: which steps of a call only replayed CUDA graphs (the benchmarks time those)."""
from __future__ import annotations

import torch

from step_timer import StepTimer
from xstage_dit.runtime.cuda_graphs import GraphUse


def test_a_step_counts_as_replayed_only_when_every_call_in_it_replayed() -> None:
    # per step: two warm-up calls; a capture then a replay; two replays; two replays
    uses = iter([GraphUse(0, 0), GraphUse(0, 2), GraphUse(1, 3), GraphUse(3, 3), GraphUse(5, 3)])
    timer = StepTimer(torch.device("cpu"), lambda: next(uses))
    timer.start()
    for step in range(4):
        timer(None, step, None, {})
    timer.finish()
    assert timer.replayed == [False, False, True, True]
    assert len(timer.step_seconds) == 4


def test_a_step_whose_block_calls_all_replayed_counts_as_replayed() -> None:
    # the forward runs eagerly (one other call per step); per step its blocks: two eager calls; a capture and a
    # replay; two replays
    uses = iter([GraphUse(0, 0, 0, 0), GraphUse(0, 1, 0, 2), GraphUse(0, 2, 1, 3), GraphUse(0, 3, 3, 3)])
    timer = StepTimer(torch.device("cpu"), lambda: next(uses))
    timer.start()
    for step in range(3):
        timer(None, step, None, {})
    timer.finish()
    assert timer.replayed == [False, False, True]


def test_without_graphs_no_step_is_marked() -> None:
    timer = StepTimer(torch.device("cpu"))
    timer.start()
    timer(None, 0, None, {})
    timer.finish()
    assert timer.replayed == []
