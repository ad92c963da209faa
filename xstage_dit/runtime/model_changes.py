"""What changed a model, asked cheaply before each call. A model changes in three ways that matter here: its
modules or parameters are replaced (PEFT injects and removes LoRA layers, `load_state_dict(assign=True)`), its
parameters are written in place or given other storage (`copy_` under no_grad, `load_state_dict`, `.to()`,
`param.data = ...`), or its adapters' Python state moves (`set_adapters` scales, `disable_lora`/`enable_lora`,
`fuse_lora`/`unfuse_lora`, a hot-swapped adapter's scale). The first is counted by torch's global registration
hooks (filtered to this model's modules), the second read from the parameters' version counters or storage
pointers, the third from PEFT's tuner layers. Reading them is a pass over the parameters with no host sync and
nothing walked; the model is walked again only after a registration.

Not counted by version: writes through `param.data` (`param.data.mul_(2)`, `param.data = ...`: `.data` has a
version counter of its own), which PEFT's merges and hot-swaps use; those are seen through the adapter state they
change with, or the layers PEFT removes afterwards. Inference tensors and tensor subclasses count only when
replaced."""
from __future__ import annotations

import functools
import weakref
from operator import attrgetter
from typing import Any, Hashable, NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from .agreement import Fingerprint, tensors_checksum

_VERSION = attrgetter("_version")
_PLAIN = (nn.Parameter, torch.Tensor)


class ModelKey(NamedTuple):
    """A model's state as far as the checks see it: equal keys, nothing they see changed in between."""

    registrations: int  # modules, parameters and buffers registered on the model's modules
    versions: int  # the sum of the parameters' version counters (each only grows), or 0 where not read
    storages: int  # the sum of the parameters' data pointers, or 0 where not read
    adapters: tuple[Hashable, ...]  # each PEFT tuner layer's active, disabled and merged adapters and scales


def _tuner_layer_type() -> type | None:
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no PEFT, no adapters
        return None
    return BaseTunerLayer


def _scale(value: Any) -> Hashable:
    # a tensor scale (PEFT's compiled hot-swap) is filled in place: read from memory, as the weights are
    return "tensor" if isinstance(value, torch.Tensor) else value


def _adapter_state(layer: Any) -> Hashable:
    return (tuple(layer.active_adapters), layer.disable_adapters, tuple(layer.merged_adapters),
            tuple((name, _scale(value)) for name, value in getattr(layer, "scaling", {}).items()))


class ModelChanges:
    """Watches `model` from construction until `remove()`: `key()` is its state now, `moved()` says whether that
    changed since the last time it was asked. Each reader reads half of the parameters' pass: the one that compares
    values, their version counters (`versions`); the one that reads their memory, which sees writes into it anyway
    (a CUDA graph), their storage (`storage`), which `.to()` and offloading move without changing a value."""

    def __init__(self, model: nn.Module, versions: bool, storage: bool) -> None:
        self.model = model
        self._versions, self._storage = versions, storage
        self._registrations = 0
        self._walked_at = -1
        # torch keeps the hooks globally: they hold this object weakly, so that a model nobody uses is freed
        registered = functools.partial(_count_registration, weakref.ref(self))
        self._hooks = [torch_module.register_module_module_registration_hook(registered),
                       torch_module.register_module_parameter_registration_hook(registered),
                       torch_module.register_module_buffer_registration_hook(registered)]
        weakref.finalize(self, _remove_hooks, list(self._hooks))
        self._walk()
        self.last = self.key()  # as of the last `moved()`

    def _walk(self) -> None:
        modules = list(self.model.modules())
        self._module_ids = {id(module) for module in modules}
        self._tracked = [p for p in self.model.parameters() if type(p) in _PLAIN and not p.is_inference()]
        tuner = _tuner_layer_type()
        self._tuners = [module for module in modules if tuner is not None and isinstance(module, tuner)]
        self._walked_at = self._registrations

    def key(self) -> ModelKey:
        if self._walked_at != self._registrations:  # walked again only after a registration
            self._walk()
        return ModelKey(self._registrations, sum(map(_VERSION, self._tracked)) if self._versions else 0,
                        sum(map(torch.Tensor.data_ptr, self._tracked)) if self._storage else 0,
                        tuple(_adapter_state(layer) for layer in self._tuners))

    def moved(self) -> bool:
        """Whether the model changed since the last `moved()` (or construction)."""
        key = self.key()
        moved, self.last = key != self.last, key
        return moved

    def remove(self) -> None:
        _remove_hooks(self._hooks)


def _count_registration(changes: weakref.ref[ModelChanges], module: nn.Module, name: str, value: Any) -> None:
    watching = changes()
    if watching is not None and id(module) in watching._module_ids:
        watching._registrations += 1


def _remove_hooks(hooks: list[Any]) -> None:
    for hook in hooks:
        hook.remove()  # a second time does nothing


class ChangesSinceEnable:
    """What the ranks compare about one model before each call: its adapters' state, and how much its parameters'
    float64 sum moved since construction (a difference, so that parameters that differ between ranks by design,
    such as sharded experts, agree while nobody changes them). The sum is taken again only when the model moved."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.model, self.name = model, name
        self._changes = ModelChanges(model, versions=True, storage=False)
        self._baseline = tensors_checksum(model.parameters())
        self._moved_by = 0.0

    def add_to(self, fingerprint: Fingerprint) -> None:
        if self._changes.moved():
            self._moved_by = tensors_checksum(self.model.parameters()) - self._baseline
        fingerprint.add(f"{self.name}'s adapters (active, disabled, merged, scales)",
                        repr(self._changes.last.adapters))
        fingerprint.add(f"{self.name}'s weights (their sum's change since enable)", self._moved_by)

    def remove(self) -> None:
        self._changes.remove()
