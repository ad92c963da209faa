"""cache-dit's caches (`cache_dit.enable_cache(pipe)`: DBCache, alone and with its TaylorSeer calibrator) with
xstage_dit, enabled before `enable` and after it: the parallel result equals one process's with the same cache, at
a threshold where ranks deciding on their own tokens would decide differently (tested to hang then: the ranks
that compute the remaining blocks wait for the others). cache-dit's own parallelism is refused, whichever comes
first."""
from __future__ import annotations

import math
import os
from typing import Any, Callable

import pytest
import torch

pytest.importorskip("cache_dit", reason="cache-dit is not installed (the test extra has it)")

import xstage_dit
from xstage_dit.testing import zoo
from compile_checks import CACHE_FIRST, CACHE_LAST, check_cache_under_compile, order_id
from dist_harness import run_on_ranks
from numerics import relative_error
from pipeline_checks import TOLERANCE, seeded_latents

# the library's CPU paths (conftest.py): these tests' subject is not our kernels, which their own tests run
pytestmark = pytest.mark.cpu_paths

STEPS = 3


@pytest.fixture(autouse=True)
def _quiet_cache_dit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_DIT_LOG_LEVEL", "error")  # read when cache_dit is imported, in the ranks


def _generator(name: str, size: str, pipe: Any, guidance: float = 1.0) -> Callable[[], torch.Tensor]:
    # guidance off by default: one transformer call per step, consecutive calls are the ones the cache compares
    return seeded_latents(pipe, name, size, steps=STEPS, guidance=guidance)


def _db_cache(threshold: float) -> dict[str, Any]:
    """DBCache on the tiny models (1 or 2 blocks per list): one block computed before the decision, none after,
    the first step computed whole."""
    from cache_dit import DBCacheConfig

    return {"cache_config": DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0, max_warmup_steps=1,
                                          residual_diff_threshold=threshold, num_inference_steps=STEPS)}


def _caches(threshold: float) -> dict[str, dict[str, Any]]:
    from cache_dit import TaylorSeerCalibratorConfig

    return {"DBCache": _db_cache(threshold),
            "DBCache + TaylorSeer": {**_db_cache(threshold),
                                     "calibrator_config": TaylorSeerCalibratorConfig(taylorseer_order=1)}}


def _relative_l1(previous: torch.Tensor, current: torch.Tensor) -> float:
    return ((current - previous).abs().sum() / previous.abs().sum()).item()


def _compared(pipe: Any, generate: Callable[[], torch.Tensor], dim: int = 1
              ) -> tuple[list[float], list[list[float]], torch.Tensor]:
    """DBCache's statistics in one process with a threshold that never caches, per comparison: the whole
    sequence's, and those of each rank's part alone (split over this job's ranks along `dim`: tokens, or the
    batch); and that run's (uncached) result."""
    import cache_dit

    cache_dit.enable_cache(pipe, **_db_cache(1e-9))
    manager = pipe.transformer._context_manager
    compared = []
    own = manager.similarity

    def recorded(t1: torch.Tensor, t2: torch.Tensor, **kwargs: Any) -> bool:
        compared.append((t1.clone(), t2.clone()))
        return own(t1, t2, **kwargs)

    manager.similarity = recorded
    uncached = generate()
    cache_dit.disable_cache(pipe)
    chunk = math.ceil(compared[0][0].shape[dim] / int(os.environ["WORLD_SIZE"]))
    alone = [[_relative_l1(previous.narrow(dim, start, min(chunk, previous.shape[dim] - start)),
                           current.narrow(dim, start, min(chunk, previous.shape[dim] - start)))
              for start in range(0, previous.shape[dim], chunk)] for previous, current in compared]
    return [_relative_l1(previous, current) for previous, current in compared], alone, uncached


def _between(low: float, high: float) -> float:
    assert high > low * (1 + 1e-4), (low, high)  # far enough apart for rounding not to move a decision
    return (low + high) / 2


def _equal_to_one_process(name: str, pipe: Any, generate: Callable[[], torch.Tensor], threshold: float,
                          uncached: torch.Tensor, **knobs: Any) -> None:
    """Each cache enabled before and after xstage_dit gives one process's result with the same cache."""
    import cache_dit

    for cache, options in _caches(threshold).items():
        cache_dit.enable_cache(pipe, **options)
        stock = generate()
        assert not torch.equal(stock, uncached), f"{name}: {cache} changed nothing"
        xstage_dit.enable(pipe, backend="reference", timeout_s=60, **knobs)  # after cache-dit
        before = generate()
        xstage_dit.disable(pipe)
        cache_dit.disable_cache(pipe)
        xstage_dit.enable(pipe, backend="reference", timeout_s=60, **knobs)  # before cache-dit
        cache_dit.enable_cache(pipe, **_caches(threshold)[cache])
        after = generate()
        cache_dit.disable_cache(pipe)
        xstage_dit.disable(pipe)
        for order, out in (("before", before), ("after", after)):
            error = relative_error(out, stock)
            assert error < TOLERANCE, (f"{name}, {cache} (threshold {threshold:.4f}, {knobs}) enabled {order} "
                                       f"xstage_dit: relative error {error:.2e}")
    assert torch.equal(generate(), uncached), f"{name}: cache-dit or xstage_dit left something behind"


def _cache_dit_worker(name: str, size: str) -> None:
    """The threshold lies between the whole sequence's statistic at DBCache's first comparison (below it: cached)
    and the nearest above it of one rank's tokens alone (that rank alone would compute)."""
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    generate = _generator(name, size, pipe)
    (whole, *_), (alone, *_), uncached = _compared(pipe, generate)
    threshold = _between(whole, min(statistic for statistic in alone if statistic > whole))
    _equal_to_one_process(name, pipe, generate, threshold, uncached)
    if torch.distributed.get_world_size() == 2 and name in ("tiny-flux", "tiny-wan"):
        # the same split of the tokens as a ring of two (cache-dit's hooks at the input, and in its wrapper)
        _equal_to_one_process(name, pipe, generate, threshold, uncached, ring_degree=2)


def _cfg_split_and_parallelism_worker() -> None:
    _cfg_split()
    _refuses_cache_dits_parallelism()


def _cfg_split() -> None:
    """CFG split over the two ranks (tokens whole). Batched (CogVideoX: each rank one half of the batch): the
    threshold lies between the whole batch's statistic and one half's, as between a sequence's and a rank's. In
    pairs of calls (Qwen-Image: each rank one of each step's two calls), which cache-dit counts in turn: refused."""
    import cache_dit

    name = "tiny-cogvideox"
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    generate = _generator(name, "even", pipe, guidance=3.0)
    (whole, *_), (alone, *_), uncached = _compared(pipe, generate, dim=0)
    threshold = _between(whole, min(statistic for statistic in alone if statistic > whole))
    _equal_to_one_process(name, pipe, generate, threshold, uncached, cfg_degree=2)

    name = "tiny-qwenimage"
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    cache_dit.enable_cache(pipe, **_db_cache(0.5))
    xstage_dit.enable(pipe, backend="reference", timeout_s=60, cfg_degree=2)
    with pytest.raises(ValueError, match="cache-dit's caches take a pipeline's conditional and unconditional"):
        _generator(name, "even", pipe, guidance=3.0)()


def _refuses_cache_dits_parallelism() -> None:
    """cache-dit's own parallelism splits the tokens too: refused by `enable`, and at the call where it came
    after `enable`."""
    import cache_dit
    import cache_dit.distributed.dispatch
    from cache_dit import ParallelismConfig

    cache_dit.distributed.dispatch.maybe_empty_cache = lambda: None  # sleeps 2 s to free GPU memory
    parallelism = {**_db_cache(0.1), "parallelism_config": ParallelismConfig(ulysses_size=2)}
    pipe = zoo.build_pipeline("tiny-flux")
    cache_dit.enable_cache(pipe, **parallelism)
    with pytest.raises(ValueError, match="cache-dit's parallelism .* use one of them"):
        xstage_dit.enable(pipe, backend="reference", timeout_s=60)
    pipe = zoo.build_pipeline("tiny-flux")  # cache-dit's parallelism stays after its `disable_cache`
    pipe.set_progress_bar_config(disable=True)
    xstage_dit.enable(pipe, backend="reference", timeout_s=60)
    cache_dit.enable_cache(pipe, **parallelism)
    with pytest.raises(ValueError, match="cache-dit's parallelism .* since xstage_dit.enable"):
        _generator("tiny-flux", "even", pipe)()


# FLUX.1 and Qwen-Image split at the model's input, Wan and CogVideoX inside cache-dit's wrapper (at the first
# block): two ranks with token counts that divide, three with tail padding
FAMILIES = ["tiny-flux", "tiny-wan", "tiny-qwenimage", "tiny-cogvideox"]


@pytest.mark.parametrize("world_size, size, name",
                         [(world_size, size, name) for world_size, size in [(2, "even"), (3, "uneven")]
                          for name in FAMILIES])
def test_cache_dit_before_and_after_enable_equals_one_process(world_size: int, size: str, name: str) -> None:
    """At two ranks FLUX.1 and Wan also as a ring of two."""
    run_on_ranks(world_size, _cache_dit_worker, name, size, deadline_s=600)


def test_cache_dit_on_a_cfg_split_equals_one_process_and_its_parallelism_is_refused() -> None:
    """Two ranks: CFG split (batched, and refused in pairs of calls); cache-dit's own parallelism refused whichever
    comes first."""
    run_on_ranks(2, _cfg_split_and_parallelism_worker, deadline_s=600)


def test_diffusers_context_parallelism_is_refused_before_any_collective() -> None:
    from diffusers import ContextParallelConfig

    pipe = zoo.build_pipeline("tiny-flux")
    pipe.transformer._parallel_config = ContextParallelConfig(ulysses_degree=2)  # what enable_parallelism leaves
    with pytest.raises(ValueError, match="diffusers' context parallelism .* use one of them"):
        xstage_dit.enable(pipe)


def _compiled_cache_dit_worker(name: str, mode: str, order: tuple[str, ...]) -> None:
    """DBCache at a threshold where ranks deciding alone would decide differently."""
    import cache_dit

    def built() -> Any:
        pipe = zoo.build_pipeline(name)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    pipe = built()
    (whole, *_), (alone, *_), _ = _compared(pipe, _generator(name, "even", pipe))
    threshold = _between(whole, min(statistic for statistic in alone if statistic > whole))
    check_cache_under_compile(built, mode, order, lambda pipe: cache_dit.enable_cache(pipe, **_db_cache(threshold)),
                              lambda pipe: _generator(name, "even", pipe)(), f"{name}, DBCache")


@pytest.mark.parametrize("name, mode, order", [
    # blocks compiled fullgraph inside cache-dit's wrapper (its decisions lie between them): the split at the
    # model's input (FLUX.1), at the first block (Wan)
    ("tiny-flux", "fullgraph blocks", CACHE_FIRST), ("tiny-wan", "fullgraph blocks", CACHE_LAST),
    # the whole model compiled around the wrapper (CogVideoX names no repeated blocks); cache-dit given
    # torch.compile(transformer), which its wrapper then holds as its transformer (Wan: the split in the wrapper)
    ("tiny-cogvideox", "whole", CACHE_FIRST), ("tiny-wan", "wrapped", CACHE_LAST)], ids=order_id)
def test_cache_dit_under_compile_equals_one_process(name: str, mode: str, order: tuple[str, ...]) -> None:
    """cache-dit's DBCache with the transformer compiled, two ranks (test_compile.check_cache_under_compile)."""
    run_on_ranks(2, _compiled_cache_dit_worker, name, mode, order, deadline_s=300)
