"""What changed a model, asked cheaply before each call. A model changes in three ways that matter here: its
modules or parameters are replaced (PEFT injects and removes LoRA layers, `load_state_dict(assign=True)`), its
parameters are written in place or given other storage (`copy_` under no_grad, `load_state_dict`, `.to()`,
`param.data = ...`, `param.data.mul_(2)`), or its adapters' Python state moves (`set_adapters` scales,
`disable_lora`/`enable_lora`, `fuse_lora`/`unfuse_lora`, a hot-swapped adapter's scale). The first is counted by
torch's global registration hooks (filtered to this model's modules), the others by the hooks of write_hooks.py.
Asking costs a comparison of these counters; the model is read again (its parameters' storage, its PEFT tuner
layers' state) only after one moved, and walked again only after a registration."""
from __future__ import annotations

import functools
import weakref
import zlib
from typing import Any, Hashable, NamedTuple

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from .agreement import Fingerprint, stored_tensors, tensors_checksum
from .write_hooks import WriteCounts


class ModelKey(NamedTuple):
    """A model's state as far as the checks see it: equal keys, nothing they see changed in between."""

    registrations: int  # modules, parameters and buffers registered on the model's modules
    writes: int  # writes to its parameters (in place, through or of `.data`), or 0 where not read
    storages: int  # the sum of the data pointers of what the parameters store, or 0 where not read
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
    changed since the last time it was asked. Each reader reads what it needs: the one that compares values, the
    writes to the parameters (`writes`); the one that reads their memory, which sees writes into it anyway (a
    CUDA graph), their storage (`storage`), which `.to()` and offloading move without changing a value."""

    def __init__(self, model: nn.Module, writes: bool, storage: bool) -> None:
        self.model = model
        self._writes, self._storage = writes, storage
        self._registrations = 0
        self._walked_at = -1
        self._module_ids: set[int] = set()  # until the first walk, in `key()` below
        self._counts = WriteCounts()
        self._counted: tuple[int, int, int] | None = None  # the counters as of the last read
        # torch keeps the hooks globally: they hold this object weakly, so that a model nobody uses is freed
        registered = functools.partial(_count_registration, weakref.ref(self))
        self._hooks = [torch_module.register_module_module_registration_hook(registered),
                       torch_module.register_module_parameter_registration_hook(registered),
                       torch_module.register_module_buffer_registration_hook(registered)]
        weakref.finalize(self, _stop, list(self._hooks), self._counts)
        self.last = self.key()  # as of the last `moved()`

    def _walk(self) -> None:
        modules = list(self.model.modules())
        self._module_ids = {id(module) for module in modules}
        parameters = list(self.model.parameters())
        self._stored = [p for p in parameters if not p.is_inference()]
        tuner = _tuner_layer_type()
        self._tuners = [module for module in modules if tuner is not None and isinstance(module, tuner)]
        self._counts.follow(parameters, self._tuners)
        self._walked_at = self._registrations

    def key(self) -> ModelKey:
        counted = (self._registrations, self._counts.parameter_writes, self._counts.adapter_calls)
        if counted != self._counted:  # read again only after something touched the model
            if self._walked_at != self._registrations:  # walked again only after a registration
                self._walk()
            self._key = ModelKey(self._registrations, self._counts.parameter_writes if self._writes else 0,
                                 self._storage_pointers() if self._storage else 0,
                                 tuple(_adapter_state(layer) for layer in self._tuners))
            self._counted = counted
        return self._key

    def _storage_pointers(self) -> int:
        # a quantized weight's inner tensors, flattened at each read: `module.to()` swaps them, the weight stays
        return sum(inner.data_ptr() for p in self._stored for inner in stored_tensors(p))

    def moved(self) -> bool:
        """Whether the model changed since the last `moved()` (or construction)."""
        key = self.key()
        moved, self.last = key != self.last, key
        return moved

    def remove(self) -> None:
        _stop(self._hooks, self._counts)


def _count_registration(changes: weakref.ref[ModelChanges], module: nn.Module, name: str, value: Any) -> None:
    watching = changes()
    if watching is not None and id(module) in watching._module_ids:
        watching._registrations += 1


def _stop(hooks: list[Any], counts: WriteCounts) -> None:
    for hook in hooks:
        hook.remove()  # a second time does nothing
    counts.stop()


class ChangesSinceEnable:
    """What the ranks compare about one model before each call: its adapters' state, and how much its parameters'
    float64 sum moved since construction (a difference, so that parameters that differ between ranks by design,
    such as sharded experts, agree while nobody changes them). The sum is taken again only after a registration or
    a write, the adapters' text only after they moved."""

    def __init__(self, model: nn.Module, name: str) -> None:
        self.model, self.name = model, name
        self._changes = ModelChanges(model, writes=True, storage=False)
        self._baseline = tensors_checksum(model.parameters())
        self._weights_as_of = self._weights_at(self._changes.key())
        self._moved_by = 0.0
        self._adapters: tuple[Hashable, ...] | None = None

    @staticmethod
    def _weights_at(key: ModelKey) -> tuple[int, int]:
        return key.registrations, key.writes

    def add_to(self, fingerprint: Fingerprint) -> None:
        key = self._changes.key()
        if self._weights_at(key) != self._weights_as_of:
            self._moved_by = tensors_checksum(self.model.parameters()) - self._baseline
            self._weights_as_of = self._weights_at(key)
        if key.adapters is not self._adapters:  # the same tuple while nothing was read again
            self._adapters, self._adapters_crc = key.adapters, zlib.crc32(repr(key.adapters).encode())
        fingerprint.add(f"{self.name}'s adapters (active, disabled, merged, scales)", self._adapters_crc)
        fingerprint.add(f"{self.name}'s weights (their sum's change since enable)", self._moved_by)

    def remove(self) -> None:
        self._changes.remove()
