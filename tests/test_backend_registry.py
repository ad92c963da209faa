"""The strategy registry loads its own list of modules: with Triton each one offers its choice, in the list's
order, and without Triton asking for the fused strategy says that it needs it. A strategy added to the list (a
dummy here) runs through the router, the custom op, the ring and the planner with nothing else edited."""
from __future__ import annotations

import subprocess
import sys
import types
from collections import Counter
from typing import Callable

import pytest
import torch

from dist_harness import run_on_ranks
from xstage_dit.runtime.distributed import build_groups, ensure_process_group
from xstage_dit.sp.attention.backends import (BACKEND_MODULES, BackendModule, RingBlocks, Strategy, Supports,
                                              available_backends, backends, costs_of, get_choice, load)
from xstage_dit.sp.attention.layout import WholeKeys
from xstage_dit.sp.attention.local import sdpa_bshd
from xstage_dit.sp.attention.ulysses import UlyssesAttention
from xstage_dit.sp.sharding import SequenceShard


def test_every_listed_module_offers_its_choice_in_the_lists_order():
    assert available_backends() == sorted(module.name for module in BACKEND_MODULES)
    assert [backend.name for backend in backends()] == ["reference", "overlap", "fused"]


# the registry in a process where Triton cannot be imported: prints why the fused backend is unavailable
WITHOUT_TRITON = """
import sys; sys.modules["triton"] = None
import torch
from xstage_dit.sp.attention.backends import available_backends, resolve_backend

assert available_backends() == ["auto", "overlap", "reference"], available_backends()
try:
    resolve_backend("fused", torch.device("cpu"))
except ValueError as error:
    print(error)
"""


def test_a_backend_whose_dependency_is_missing_says_what_it_needs():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("xstage_dit backend 'fused' needs triton: "), result.stdout


# -- a strategy added as the docs say (one module offering its entry, one line in the list), nothing else edited --
DUMMY_MODULE = "xstage_dit.sp.attention.dummy"


def _counted(calls: Counter, kind: str, function: Callable) -> Callable:
    def counting(*args, **kwargs):
        calls[kind] += 1
        return function(*args, **kwargs)

    return counting


def _load_with_dummy() -> Counter:
    """A registry with a dummy strategy listed last: the reference's functions, counted, and the cheapest cost
    the planner can predict. Returns the counts of its calls."""
    from xstage_dit.sp.attention.local import sdpa_bshd
    from xstage_dit.sp.attention.reference import reference_exchange, reference_ulysses

    calls: Counter = Counter()
    module = types.ModuleType(DUMMY_MODULE)
    module.CHOICE = Strategy("dummy", ulysses=_counted(calls, "ulysses", reference_ulysses),
                             local=_counted(calls, "local", sdpa_bshd), cost=lambda planner, shape: 0.0,
                             exchange=_counted(calls, "exchange", reference_exchange),
                             ring=RingBlocks.POINT_TO_POINT, supports=Supports(pair_bias=True))
    sys.modules[DUMMY_MODULE] = module
    load(BACKEND_MODULES + (BackendModule("dummy"),))
    return calls


def _unload_dummy() -> None:
    load()
    del sys.modules[DUMMY_MODULE]


def _strategy_worker(backend: str, ulysses: int, ring: int) -> None:
    """The router (UlyssesAttention), the custom op and the ring run strategy `backend` (the dummy's functions: its
    Ulysses call at ring degree 1, its exchange around the ring and around keys every rank holds whole); the output
    equals one process's."""
    calls = _load_with_dummy()
    ensure_process_group(60.0)
    groups = build_groups(1, ulysses, 60.0, ring)
    shard = SequenceShard(groups.sequence_degree, groups.sequence_rank, groups.sequence_group)
    attention = UlyssesAttention(shard, get_choice(backend), ulysses=groups.ulysses, ring=groups.ring)
    torch.manual_seed(0)
    text, heads = 3, 4
    q, k, v, whole_k, whole_v = (torch.randn(1, text + 10, heads, 8) for _ in range(5))  # 10 tokens: padded

    def mine(t: torch.Tensor) -> torch.Tensor:  # the text, then this rank's image tokens (tail-padded)
        return torch.cat([t[:, :text], shard.shard(t[:, text:], 1)], dim=1)

    def check(out: torch.Tensor, expected: torch.Tensor) -> None:
        rows = text + max(0, min(shard.local_len, 10 - shard.rank * shard.local_len))  # its true rows
        torch.testing.assert_close(out[:, :rows], mine(expected)[:, :rows], atol=1e-5, rtol=1e-5)

    check(attention(mine(q), mine(k), mine(v)), sdpa_bshd(q, k, v))
    whole = WholeKeys(whole_k[:, :5], whole_v[:, :5])
    check(attention.with_whole_keys(mine(q), mine(k), mine(v), whole),
          sdpa_bshd(q, torch.cat([k, whole.key], dim=1), torch.cat([v, whole.value], dim=1)))
    if backend != "dummy":
        assert not calls, calls
    elif ring == 1:  # its own Ulysses call, then its exchange around the whole keys' attention
        assert calls == Counter(ulysses=1, exchange=1), calls
    else:  # its exchange around the ring, twice
        assert calls == Counter(exchange=2), calls


@pytest.mark.parametrize("ulysses, ring", [(4, 1), (2, 2)])
def test_a_strategy_added_to_the_list_runs_through_the_router_the_op_and_the_ring(ulysses, ring):
    run_on_ranks(4, _strategy_worker, "dummy", ulysses, ring, deadline_s=300)


def test_the_overlap_strategy_runs_its_head_chunks_around_the_ring():
    """Each of the overlap exchange's head chunks runs the whole ring (and attends its heads of the whole keys)."""
    run_on_ranks(4, _strategy_worker, "overlap", 2, 2, deadline_s=300)


def test_a_strategy_added_to_the_list_is_planned_and_runs_at_degree_one():
    from xstage_dit.burst_gap.calibration import SHIPPED, SHIPPED_GPU, find_calibration
    from xstage_dit.burst_gap.planner import Planner
    from xstage_dit.burst_gap.ring_plan import Nodes
    from xstage_dit.burst_gap.ulysses_plan import AttentionShape
    from xstage_dit.sp.attention.auto import decide
    from xstage_dit.sp.attention.ops import local_attention

    calls = _load_with_dummy()
    try:
        assert "dummy" in available_backends() and backends()[-1].name == "dummy"
        planner = Planner.from_calibration(find_calibration(SHIPPED_GPU, 8, directory=SHIPPED))
        shape = AttentionShape(1, 8 * 4096, 0, 24, 128, 8)
        assert planner.predict(shape, costs_of(backends()))["dummy"] == 0.0
        assert decide(planner, shape, tuple(backends())).name == "dummy"  # what auto runs
        assert {s.backend for s in planner.layer_splits(shape, Nodes(8), costs_of(backends())) if s.ring == 1} \
            == {"reference", "overlap", "fused", "dummy"} & set(available_backends())
        q = torch.randn(1, 6, 2, 8)
        torch.testing.assert_close(local_attention(q, q, q, None, "dummy", None), sdpa_bshd(q, q, q))
        assert calls == Counter(local=1)
    finally:
        _unload_dummy()
    assert "dummy" not in available_backends()
