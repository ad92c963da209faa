"""Cache hooks whose decision reads the hidden states, made to decide as one process would: diffusers' and
cache-dit's (cache_dit_hooks.py).

diffusers' FirstBlockCache skips the remaining blocks when the first block's residual changed little since the last
step: sum |r - r_prev| / sum |r_prev| against a threshold. On a sharded sequence each rank would compute that ratio
on its own tokens, the ranks could decide differently, and the collectives of the blocks one rank skips would
never be joined. Here the ratio is the whole sequence's (`SequenceShard.relative_l1`), so every rank takes the
single-process decision."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..hooks.module_forward import ReplacedForward
from .cache_dit_hooks import (cache_dit_manager, refuse_other_sequence_parallelism, residual_on_shard,
                              whole_sequence_similarity, wrapped_blocks)
from .sharding import SequenceShard

_FBC_HEAD_HOOK = "fbc_leader_block_hook"  # diffusers.hooks.first_block_cache's name for the head block's hook


@dataclass(frozen=True)
class CfgBranches:
    """How the CFG split shares a model's calls out: `batch_group`, the ranks holding the other parts of a batched
    call's batch (the conditional and unconditional halves); `paired`, each rank runs one of each step's two calls."""

    batch_group: dist.ProcessGroup | None = None
    paired: bool = False


class SharedCacheDecisions:
    """Makes the caches on an enabled model decide as one process would, whether they were enabled before or after
    xstage_dit: on the whole sequence (the sequence group's tokens) and the whole batch (where the CFG split halves
    it: `cfg`). Before every forward: a FirstBlockCache head hook (on the first block of one of the model's block
    lists, where tokens or the batch are split) and a cache-dit cache's statistic (always: cache-dit's own
    reduction would average over every rank of the world); while a cache-dit cache is on a split model, its wrapper
    around a block list whose first block splits the tokens (`split_blocks`), when that block runs (the wrapper
    stands in for the list only during a forward). cache-dit under paired CFG calls, and a model that another
    sequence parallelism took over since `enable`, are refused at the call. `remove()` gives the caches their own
    decisions back."""

    def __init__(self, model: nn.Module, shard: SequenceShard, split_blocks: list[nn.Module],
                 cfg: CfgBranches = CfgBranches()) -> None:
        self.model = model
        self.shard = shard
        self.cfg = cfg
        self._split_blocks = split_blocks
        self._patched: dict[Any, ReplacedForward] = {}  # head hook or cache-dit wrapper -> its decision, replaced
        self._statistic: ReplacedForward | None = None  # cache-dit's, replaced for one forward
        self._wrapper_handles: list[torch.utils.hooks.RemovableHandle] = []  # on split_blocks, while cache-dit is on
        self._handles = [model.register_forward_pre_hook(self._share),
                         model.register_forward_hook(self._give_back_statistic, always_call=True)]

    @torch.compiler.disable
    def _share(self, model: nn.Module, args: tuple) -> None:
        refuse_other_sequence_parallelism(model, "since xstage_dit.enable")
        heads = [blocks[0] for blocks in model.children() if isinstance(blocks, nn.ModuleList) and len(blocks)]
        for module in heads if self.shard.degree > 1 or self.cfg.batch_group is not None else []:
            registry = getattr(module, "_diffusers_hook", None)
            hook = registry.get_hook(_FBC_HEAD_HOOK) if registry is not None else None
            if hook is not None and hook not in self._patched:
                self._patched[hook] = ReplacedForward(hook, _whole_sequence_decision(hook, self.shard, self.cfg),
                                                      attribute="_should_compute_remaining_blocks")
        manager = cache_dit_manager(model)
        if manager is not None and self.cfg.paired:
            raise ValueError("xstage_dit: cache-dit's caches take a pipeline's conditional and unconditional calls "
                             "in turn, and under cfg_degree=2 each rank makes only one of them: enable xstage_dit "
                             "with cfg_degree=1 to use cache-dit")
        if manager is not None:  # shared by a pipeline's transformers, each with its own split: for this forward
            self._statistic = ReplacedForward(manager, whole_sequence_similarity(manager, self.shard,
                                                                                 self.cfg.batch_group),
                                              attribute="similarity")
        if (manager is not None and self.shard.degree > 1) != bool(self._wrapper_handles):
            self._watch_wrappers(manager is not None)

    def _watch_wrappers(self, on: bool) -> None:
        for handle in self._wrapper_handles:
            handle.remove()
        self._wrapper_handles = [block.register_forward_pre_hook(self._share_wrappers)
                                 for block in self._split_blocks] if on else []

    @torch.compiler.disable
    def _give_back_statistic(self, model: nn.Module, args: tuple, output: Any) -> None:
        if self._statistic is not None:
            self._statistic.restore()
            self._statistic = None

    @torch.compiler.disable
    def _share_wrappers(self, block: nn.Module, args: tuple) -> None:
        for wrapper in wrapped_blocks(self.model):
            if wrapper not in self._patched:
                self._patched[wrapper] = residual_on_shard(wrapper, self.shard)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._watch_wrappers(False)
        self._give_back_statistic(self.model, (), None)
        for decision in self._patched.values():
            decision.restore()
        self._patched.clear()


def _whole_sequence_decision(hook: Any, shard: SequenceShard, cfg: CfgBranches):
    @torch.compiler.disable
    def should_compute_remaining_blocks(residual: torch.Tensor) -> bool:
        previous = hook.state_manager.get_state().head_block_residual
        if previous is None:
            return True
        return shard.relative_l1(previous, residual, batch_group=cfg.batch_group) > hook.threshold

    return should_compute_remaining_blocks


def stateful_hooks(model: nn.Module) -> str | None:
    """The caches on `model` that keep state from call to call and decide on the host (diffusers' stateful hooks,
    a cache-dit cache): named, or None. A CUDA graph would freeze their first decision."""
    found = sorted({name for module in model.modules() if hasattr(module, "_diffusers_hook")
                    for name, hook in module._diffusers_hook.hooks.items() if getattr(hook, "_is_stateful", False)})
    if cache_dit_manager(model) is not None:
        found.append("cache-dit's cache")
    return ", ".join(found) or None
