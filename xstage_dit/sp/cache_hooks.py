"""diffusers cache hooks whose decision reads the hidden states, made to decide as one process would.

FirstBlockCache skips the remaining blocks when the first block's residual changed little since the last step:
sum |r - r_prev| / sum |r_prev| against a threshold. On a sharded sequence each rank would compute that ratio on
its own tokens, the ranks could decide differently, and the collectives of the blocks one rank skips would never
be joined. Here the two sums are reduced over the Ulysses group (padding rows left out), so every rank takes the
single-process decision."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..hooks.module_forward import ReplacedForward
from .sharding import SequenceShard

_FBC_HEAD_HOOK = "fbc_leader_block_hook"  # diffusers.hooks.first_block_cache's name for the head block's hook


class SharedCacheDecisions:
    """Before every forward of an enabled model, makes a FirstBlockCache head hook (on the first block of one of
    its block lists) decide over the whole sequence: the model's cache may be enabled before or after xstage_dit.
    `remove()` gives the hooks their own decisions back."""

    def __init__(self, model: nn.Module, shard: SequenceShard) -> None:
        self.shard = shard
        self._patched: dict[Any, ReplacedForward] = {}  # head hook -> its decision, replaced
        self._handle = model.register_forward_pre_hook(self._share)

    @torch.compiler.disable
    def _share(self, model: nn.Module, args: tuple) -> None:
        heads = [blocks[0] for blocks in model.children() if isinstance(blocks, nn.ModuleList) and len(blocks)]
        for module in heads:
            registry = getattr(module, "_diffusers_hook", None)
            hook = registry.get_hook(_FBC_HEAD_HOOK) if registry is not None else None
            if hook is not None and hook not in self._patched:
                self._patched[hook] = ReplacedForward(hook, _whole_sequence_decision(hook, self.shard),
                                                      attribute="_should_compute_remaining_blocks")

    def remove(self) -> None:
        self._handle.remove()
        for decision in self._patched.values():
            decision.restore()
        self._patched.clear()


def _whole_sequence_decision(hook: Any, shard: SequenceShard):
    @torch.compiler.disable
    def should_compute_remaining_blocks(residual: torch.Tensor) -> bool:
        previous = hook.state_manager.get_state().head_block_residual
        if previous is None:
            return True
        valid = max(0, min(shard.local_len, shard.seq_len - shard.rank * shard.local_len))  # rows on dim 1
        change = (residual - previous)[:, :valid].abs().sum(dtype=torch.float64)
        size = previous[:, :valid].abs().sum(dtype=torch.float64)
        sums = torch.stack([change, size])
        with torch.no_grad():
            dist.all_reduce(sums, group=shard.group)
        return (sums[0] / sums[1]).item() > hook.threshold

    return should_compute_remaining_blocks


def stateful_hooks(model: nn.Module) -> str | None:
    """The diffusers hooks on `model` that keep state from call to call (the caches), whose decisions are made on
    the host: named, or None. A CUDA graph would freeze their first decision."""
    found = sorted({name for module in model.modules() if hasattr(module, "_diffusers_hook")
                    for name, hook in module._diffusers_hook.hooks.items() if getattr(hook, "_is_stateful", False)})
    return ", ".join(found) or None
