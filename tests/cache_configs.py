"""diffusers' caches as the cache tests configure them, per family."""
from __future__ import annotations

from typing import Any, Callable


STEPS = 3


EVERY_STEP = (-1, 1001)


def caches(pipe: Any, name: str) -> dict[str, tuple[float, Callable[[], Any]]]:
    """Each cache's guidance scale and config, made anew for every use (a config holds the cache's state)."""
    from diffusers import (FasterCacheConfig, FirstBlockCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig,
                           SeaCacheConfig, TaylorSeerCacheConfig)

    def timestep() -> Any:
        return pipe.current_timestep

    caches = {
        "FirstBlockCache": (1.0, lambda: FirstBlockCacheConfig(threshold=0.5)),
        "MagCache": (1.0, lambda: MagCacheConfig(threshold=0.5, num_inference_steps=STEPS,
                                                 mag_ratios=[1.0] + [0.98] * (STEPS - 1))),
        "TaylorSeer": (1.0, lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1)),
        "PyramidAttentionBroadcast": (1.0, lambda: PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=EVERY_STEP,
            current_timestep_callback=timestep)),
    }
    if name in SEA_CACHE_FAMILIES:  # its step, sigma and step count come from the pipeline's cache context
        caches["SeaCache"] = (1.0, lambda: SeaCacheConfig(threshold=1.0))
    if name in FASTER_CACHE_FORMATS:  # it skips the unconditional half of a batched CFG call: guidance on
        caches["FasterCache"] = (3.0, lambda: FasterCacheConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=EVERY_STEP,
            unconditional_batch_skip_range=2, unconditional_batch_timestep_skip_range=EVERY_STEP,
            current_timestep_callback=timestep, tensor_format=FASTER_CACHE_FORMATS[name]))
    return caches


# FasterCache splits the unconditional branch's latents by frequency: video latents in these layouts
FASTER_CACHE_FORMATS = {"tiny-cogvideox": "BFCHW"}


# SeaCache reads the whole input latents (its built-in adapter: Wan text-to-video) and the scheduler's step, sigma
# and step count, which only WanPipeline hands the transformer's cache context
SEA_CACHE_FAMILIES = {"tiny-wan"}
