"""diffusers' caches with xstage_dit, enabled before `enable` and after it, on every family they act on: the parallel
result equals one process's with the same cache. (FirstBlockCache at a threshold between the ranks' own statistics:
tests/test_parallel_pipelines.py; cache-dit's caches: tests/test_cache_dit.py.)"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

import xstage_dit
from xstage_dit.testing import zoo
from cache_configs import STEPS, caches
from compile_checks import CACHE_FIRST, CACHE_LAST, check_cache_under_compile, order_id
from dist_harness import run_on_ranks
from numerics import relative_error
from pipeline_checks import SIZES, TOLERANCE, local_statistics, seeded_latents

# the library's CPU paths (conftest.py): these tests' subject is not our kernels, which their own tests run
pytestmark = pytest.mark.cpu_paths


def _stock_with(pipe: Any, make: Callable[[], Any], generate: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """One process's result with the cache, or None where diffusers' cache does not take this family."""
    try:
        pipe.transformer.enable_cache(make())
        return generate()
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError):
        return None
    finally:
        if getattr(pipe.transformer, "is_cache_enabled", False):
            pipe.transformer.disable_cache()


def _stock_where_it_acts(pipe: Any, make: Callable[[], Any], guidance: float,
                         generate: Callable[[float], torch.Tensor], uncached: dict[float, torch.Tensor]
                         ) -> torch.Tensor | None:
    """One process's result with the cache, or None where diffusers' cache refuses this family or changes nothing
    here; `uncached` keeps the result without a cache at each guidance scale, computed once."""
    stock = _stock_with(pipe, make, lambda: generate(guidance))
    if guidance not in uncached:
        uncached[guidance] = generate(guidance)
    return None if stock is None or torch.equal(stock, uncached[guidance]) else stock


def _caches_worker(name: str, size: str, degrees: dict | None = None) -> None:
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)

    def generate(guidance: float) -> torch.Tensor:
        return seeded_latents(pipe, name, size, steps=STEPS, guidance=guidance)()

    uncached = {1.0: generate(1.0)}
    for cache, (guidance, make) in caches(pipe, name).items():
        stock = _stock_where_it_acts(pipe, make, guidance, generate, uncached)
        if stock is None:
            continue
        pipe.transformer.enable_cache(make())  # before enable
        xstage_dit.enable(pipe, backend="reference", timeout_s=60, **(degrees or {}))
        before = generate(guidance)
        xstage_dit.disable(pipe)
        pipe.transformer.disable_cache()
        xstage_dit.enable(pipe, backend="reference", timeout_s=60, **(degrees or {}))  # after enable
        pipe.transformer.enable_cache(make())
        after = generate(guidance)
        pipe.transformer.disable_cache()
        xstage_dit.disable(pipe)
        for order, out in (("before", before), ("after", after)):
            error = relative_error(out, stock)
            assert error < TOLERANCE, f"{name}, {cache} enabled {order} xstage_dit: relative error {error:.2e}"
    assert torch.equal(generate(1.0), uncached[1.0]), f"{name}: a cache or xstage_dit left something behind"


# every family, split over two ranks (token counts that divide) and three ("uneven": tail padding)
FAMILIES = {
    (2, "even"): ["tiny-flux", "tiny-wan", "tiny-hunyuan-video", "tiny-qwenimage", "tiny-sd3.5", "tiny-hidream",
                  "tiny-flux2", "tiny-ltx2"],
    (3, "uneven"): ["tiny-ltx", "tiny-cogvideox", "tiny-nucleusmoe", "tiny-wan-vace", "tiny-zimage", "tiny-chroma",
                    "tiny-hunyuan-video15", "tiny-qwenimage21"],
}


@pytest.mark.parametrize("world_size, size, name",
                         [(world_size, size, name) for (world_size, size), names in FAMILIES.items() for name in names])
def test_caches_before_and_after_enable_equal_one_process(world_size: int, size: str, name: str) -> None:
    """Every cache that acts on a family in one process (some refuse a family: no block metadata, no cache
    context, no `enable_cache`; SD3, HiDream, Z-Image and Qwen-Image 2.1 take none of them) gives the same result
    with xstage_dit, whichever was enabled first; none leaves anything behind."""
    run_on_ranks(world_size, _caches_worker, name, size, deadline_s=600)


def test_every_cache_acts_on_some_family_in_one_process() -> None:
    """The per-family test above checks the caches that act on each family: each cache acts on one of them at
    least, so that none of them is checked on no family at all."""
    names = [name for names in FAMILIES.values() for name in names]
    acted: set[str] = set()
    for name in names:
        pipe = zoo.build_pipeline(name)
        pipe.set_progress_bar_config(disable=True)
        uncached: dict[float, torch.Tensor] = {}
        for cache, (guidance, make) in caches(pipe, name).items():
            if cache not in acted and _stock_where_it_acts(
                    pipe, make, guidance, lambda g: seeded_latents(pipe, name, "even", steps=STEPS, guidance=g)(),
                    uncached) is not None:
                acted.add(cache)
    assert acted == {cache for name in names for cache in caches(None, name)}, acted


@pytest.mark.parametrize("name", ["tiny-flux", "tiny-wan"])
def test_caches_before_and_after_enable_on_a_ring_equal_one_process(name: str) -> None:
    """The same on a ring of two ranks (the token split of ring ranks, a cache's decision over the ring group)."""
    run_on_ranks(2, _caches_worker, name, "uneven", {"ring_degree": 2}, deadline_s=600)


def _first_block_cache_between(name: str, generate: Callable[[Any], torch.Tensor]) -> float:
    """A FirstBlockCache threshold between the whole sequence's statistic at its first comparison (below it: the
    remaining blocks skipped) and the nearest above it of one rank's own tokens (that rank alone would compute)."""
    pipe = _built(name)
    xstage_dit.enable(pipe, backend="reference", timeout_s=60)
    statistics = local_statistics(pipe, lambda: generate(pipe))
    xstage_dit.disable(pipe)
    whole = statistics.whole[0]
    above = min(alone for alone in statistics.alone[0] if alone > whole)
    assert above > whole * (1 + 1e-4), (whole, above)
    return (whole + above) / 2


def _built(name: str) -> Any:
    pipe = zoo.build_pipeline(name)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _compiled_cache_worker(name: str, mode: str, order: tuple[str, ...], cache: str) -> None:
    """FirstBlockCache at a threshold where ranks deciding alone would decide differently."""
    from diffusers import FirstBlockCacheConfig

    guidance = caches(None, name)[cache][0]

    def generate(pipe: Any) -> torch.Tensor:
        kwargs = zoo.call_kwargs(name, **SIZES[name]["even"], steps=STEPS, guidance=guidance)
        return pipe(**kwargs, **zoo.text_embeddings(name, 1, seed=2), output_type="latent",
                    generator=torch.Generator().manual_seed(8), return_dict=False)[0]

    threshold = _first_block_cache_between(name, generate) if cache == "FirstBlockCache" else None

    def enable_cache(pipe: Any) -> None:
        # the configs of the caches that read the step take it from this pipeline
        make = caches(pipe, name)[cache][1]
        pipe.transformer.enable_cache(make() if threshold is None else FirstBlockCacheConfig(threshold=threshold))

    check_cache_under_compile(lambda: _built(name), mode, order, enable_cache, generate, f"{name}, {cache}")


@pytest.mark.parametrize("name, mode, order, cache", [
    # the shared decision (xstage_dit's, in the head block's hook) inside compiled blocks, the split at the model's
    # input (FLUX.1) and at the first block (Wan)
    ("tiny-flux", "blocks", CACHE_LAST, "FirstBlockCache"), ("tiny-wan", "blocks", CACHE_FIRST, "FirstBlockCache"),
    # a compiled whole model with a cache's graph breaks between the split's hooks: FirstBlockCache's (CogVideoX
    # names no repeated blocks), MagCache's (a step-decided cache)
    ("tiny-cogvideox", "whole", CACHE_LAST, "FirstBlockCache"), ("tiny-wan", "whole", CACHE_FIRST, "MagCache")],
    ids=order_id)
def test_caches_under_compile_equal_one_process(name: str, mode: str, order: tuple[str, ...], cache: str) -> None:
    """diffusers' cache with the transformer compiled (Dynamo, not fullgraph: the caches decide on the host), two
    ranks: one process's result with the same cache and compile, and no more graphs or recompiles of diffusers'
    and the cache's code than there (test_compile.check_cache_under_compile)."""
    run_on_ranks(2, _compiled_cache_worker, name, mode, order, cache, deadline_s=300)
