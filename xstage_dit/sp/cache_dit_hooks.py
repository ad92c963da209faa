"""cache-dit's caches (`cache_dit.enable_cache(pipe)`: DBCache, its TaylorSeer calibrator, DBPrune) under the token
split, made to decide as one process would.

cache-dit wraps a model's block lists in blocks of its own that run the first Fn blocks, compare their residual
with the previous step's (`similarity`: mean |r_prev - r| / mean |r_prev| against a threshold) and either run the
rest or add the cached residual. Under the split each rank holds a shard: cache-dit's own reduction averages the
ranks' means over the whole world (every rank's shard weighted alike, padding rows counted, other CFG groups
mixed in), so ranks can decide differently and the collectives of the blocks one rank skips are never joined.
Here the statistic is the whole sequence's (`SequenceShard.relative_l1`, over the sequence group), and where the
split happens inside the wrapped blocks (at the first block's input, as for Wan), the wrapper's whole input is
split like its output before the residual is taken.

cache-dit's own parallelism (`parallelism_config`: its context or tensor parallel) and diffusers' context
parallelism split the same tokens over the same ranks as xstage_dit: one of them, not both."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..hooks.module_forward import ReplacedForward
from .sharding import SequenceShard


def other_sequence_parallelism(model: nn.Module) -> str | None:
    """Who else parallelises `model` (cache-dit's or diffusers' own parallelism), or None."""
    if getattr(model, "_is_parallelized", False):
        return "cache-dit's parallelism (cache_dit.enable_cache(..., parallelism_config=...))"
    if getattr(model, "_parallel_config", None) is not None:
        return "diffusers' context parallelism (model.enable_parallelism(...))"
    return None


def refuse_other_sequence_parallelism(model: nn.Module, when: str) -> None:
    """A clear error where `model` is already split by another sequence parallelism."""
    other = other_sequence_parallelism(model)
    if other is not None:
        raise ValueError(f"xstage_dit: {type(model).__name__} is parallelised by {other}, {when}; it would split "
                         f"the same tokens over the same ranks as xstage_dit: use one of them (cache-dit's caches "
                         f"without its parallelism_config work with xstage_dit)")


def cache_dit_manager(model: nn.Module) -> Any | None:
    """The context manager of a cache-dit cache on `model` (what holds its decisions), or None."""
    if not getattr(model, "_is_cached", False):
        return None
    manager = getattr(model, "_context_manager", None)
    return manager if callable(getattr(manager, "similarity", None)) else None


def whole_sequence_similarity(manager: Any, shard: SequenceShard, batch_group: dist.ProcessGroup | None
                              ) -> Callable[..., bool]:
    """`manager.similarity` deciding on the whole sequence's (and the whole batch's: `relative_l1`) statistic. The
    calls that compute none (thresholds that always or never cache, shapes that differ, a CFG step reusing the
    conditional step's statistic) stay cache-dit's own, without its reduction."""
    own = manager.similarity

    @torch.compiler.disable
    def similarity(t1: torch.Tensor, t2: torch.Tensor, *, threshold: float, parallelized: bool = False,
                   prefix: str = "Fn") -> bool:
        if not 0.0 < threshold < 1.0 or t1.shape != t2.shape or _reuses_conditional_statistic(manager):
            return own(t1, t2, threshold=threshold, parallelized=False, prefix=prefix)
        diff = shard.relative_l1(t1, t2, manager.get_important_condition_threshold(), batch_group)
        manager.add_residual_diff(diff)
        return diff < threshold

    return similarity


def _reuses_conditional_statistic(manager: Any) -> bool:
    """cache-dit's separate-CFG step that takes the conditional step's statistic instead of computing one."""
    return (manager.enable_separate_cfg() and manager.is_separate_cfg_step()
            and not manager.cfg_diff_compute_separate() and manager.get_current_step_residual_diff() is not None)


def wrapped_blocks(model: nn.Module) -> list[nn.Module]:
    """cache-dit's block wrappers that stand in `model`'s block lists during one of its forwards. A cache enabled on
    a pipeline whose transformer is `torch.compile(model)` holds that compiled wrapper as its transformer."""
    return [blocks[0] for blocks in model.children()
            if isinstance(blocks, nn.ModuleList) and len(blocks) == 1
            and _uncompiled(getattr(blocks[0], "transformer", None)) is model
            and callable(getattr(blocks[0], "_get_Fn_residual", None))]


def _uncompiled(module: Any) -> Any:
    return module._orig_mod if isinstance(module, torch._dynamo.eval_frame.OptimizedModule) else module


def residual_on_shard(wrapper: nn.Module, shard: SequenceShard) -> ReplacedForward:
    """The wrapper's Fn residual taken on this rank's tokens where the split happened inside its first blocks (its
    input whole, their output this rank's chunk)."""
    own = wrapper._get_Fn_residual

    @torch.compiler.disable
    def fn_residual(original: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        if (original.dim() == hidden_states.dim() == 3 and original.shape[1] == shard.seq_len
                and hidden_states.shape[1] == shard.local_len != shard.seq_len):
            original = shard.shard(original, 1)
        return own(original, hidden_states)

    return ReplacedForward(wrapper, fn_residual, attribute="_get_Fn_residual")
