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

import xstage_dit
import zoo
from dist_harness import run_on_ranks
from test_parallel_pipelines import SIZES, TOLERANCE, _relative_error

STEPS = 3


@pytest.fixture(autouse=True)
def _quiet_cache_dit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CACHE_DIT_LOG_LEVEL", "error")  # read when cache_dit is imported, in the ranks


def _generator(name: str, size: str, pipe: Any) -> Callable[[], torch.Tensor]:
    # guidance off: one transformer call per step, so consecutive calls are the ones the cache compares
    kwargs = zoo.call_kwargs(name, **SIZES[name][size], steps=STEPS, guidance=1.0)

    def generate() -> torch.Tensor:
        return pipe(**kwargs, **zoo.text_embeddings(name, 1, seed=2), output_type="latent",
                    generator=torch.Generator().manual_seed(8), return_dict=False)[0]

    return generate


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


def _threshold_between_ranks(pipe: Any, generate: Callable[[], torch.Tensor], ranks: int
                             ) -> tuple[float, torch.Tensor]:
    """A threshold at DBCache's first comparison between the whole sequence's statistic (below it: cached) and
    the nearest statistic above it of one rank's tokens alone (that rank alone would compute), recorded in one
    process with a threshold that never caches; and that run's result (the uncached one)."""
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
    previous, current = compared[0]
    whole = _relative_l1(previous, current)
    chunk = math.ceil(previous.shape[1] / ranks)
    alone = [_relative_l1(previous[:, start:start + chunk], current[:, start:start + chunk])
             for start in range(0, previous.shape[1], chunk)]
    above = min(statistic for statistic in alone if statistic > whole)
    assert above > whole * (1 + 1e-4), (whole, alone)  # far enough apart for rounding not to move a decision
    return (whole + above) / 2, uncached


def _cache_dit_worker(names: list[str], size: str) -> None:
    import cache_dit

    for name in names:
        pipe = zoo.build_pipeline(name)
        pipe.set_progress_bar_config(disable=True)
        generate = _generator(name, size, pipe)
        threshold, uncached = _threshold_between_ranks(pipe, generate, int(os.environ["WORLD_SIZE"]))
        for cache, options in _caches(threshold).items():
            cache_dit.enable_cache(pipe, **options)
            stock = generate()
            assert not torch.equal(stock, uncached), f"{name}: {cache} changed nothing"
            xstage_dit.enable(pipe, backend="reference", timeout_s=60)  # after cache-dit
            before = generate()
            xstage_dit.disable(pipe)
            cache_dit.disable_cache(pipe)
            xstage_dit.enable(pipe, backend="reference", timeout_s=60)  # before cache-dit
            cache_dit.enable_cache(pipe, **_caches(threshold)[cache])
            after = generate()
            cache_dit.disable_cache(pipe)
            xstage_dit.disable(pipe)
            for order, out in (("before", before), ("after", after)):
                error = _relative_error(out, stock)
                assert error < TOLERANCE, (f"{name}, {cache} (threshold {threshold:.4f}) enabled {order} "
                                           f"xstage_dit: relative error {error:.2e}")
        assert torch.equal(generate(), uncached), f"{name}: cache-dit or xstage_dit left something behind"
    if torch.distributed.get_world_size() == 2:
        _refuses_cache_dits_parallelism()


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


@pytest.mark.parametrize("world_size, size", [(2, "even"), (3, "uneven")])
def test_cache_dit_before_and_after_enable_equals_one_process(world_size: int, size: str) -> None:
    """At two ranks, cache-dit's own parallelism is also refused whichever comes first."""
    run_on_ranks(world_size, _cache_dit_worker, FAMILIES, size, deadline_s=600)


def test_diffusers_context_parallelism_is_refused_before_any_collective() -> None:
    from diffusers import ContextParallelConfig

    pipe = zoo.build_pipeline("tiny-flux")
    pipe.transformer._parallel_config = ContextParallelConfig(ulysses_degree=2)  # what enable_parallelism leaves
    with pytest.raises(ValueError, match="diffusers' context parallelism .* use one of them"):
        xstage_dit.enable(pipe)
