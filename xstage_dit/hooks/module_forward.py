"""Replacing a module's forward (or another method) for a while: the layers `enable` puts around a transformer's
forward stack (CUDA graphs inside, the CFG split outside), and the parallel VAE's layers, each undone exactly,
whatever was there before; modules switched to a subclass with another forward (`SwappedClasses`); and names
in a library module rebound for a while (`ReboundName`). A class swapped in is known to diffusers' registries as
the class it replaces (diffusers_registries.py)."""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Callable

from torch import nn

from .diffusers_registries import register_like


def forward_signature(module: nn.Module) -> inspect.Signature:
    """The signature of `module`'s own forward (its class's), which the wrappers set on an instance (caches,
    graphs) take and pass on: a wrapper's own may say no more than (*args, **kwargs)."""
    return inspect.signature(type(module).forward.__get__(module))


class ReplacedForward:
    """`model.forward` (or another method, `attribute`) replaced by `new` (an instance attribute); `inner` is what
    was called before. `restore()` puts back exactly what was there: an instance attribute someone else set, or
    none."""

    def __init__(self, model: nn.Module, new: Callable, attribute: str = "forward") -> None:
        self.model, self.attribute = model, attribute
        self.inner: Callable = getattr(model, attribute)
        self._previous = model.__dict__.get(attribute)
        self._new = new
        setattr(model, attribute, new)

    def is_outermost(self) -> bool:
        """Nobody replaced `new` since (a wrapper set later would call it, and would be lost by `restore()`)."""
        return self.model.__dict__.get(self.attribute) is self._new

    def restore(self) -> None:
        if self._previous is None:
            delattr(self.model, self.attribute)
        else:
            setattr(self.model, self.attribute, self._previous)


def named_as(original: type) -> Callable[[type], type]:
    """Class decorator: the subclass takes `original`'s name, so that code that finds modules by class name
    (diffusers' `compile_repeated_blocks`) finds them while they are swapped."""

    def name(cls: type) -> type:
        cls.__name__ = cls.__qualname__ = original.__name__
        return cls

    return name


class SwappedClasses:
    """Each of `modules` switched to `cls` (a subclass of its class with another forward) until `remove` puts its
    own class back. While switched, the module's instance dict names `cls` (`SWAPPED_TO`): torch.compile may skip
    re-checking a module whose instance dict has not changed since it traced it (dynamo's recursive dict tags),
    and a class change alone would leave the dict as it was, so compiled code traced for the other class would
    run."""

    SWAPPED_TO = "_xstage_dit_swapped_to"

    def __init__(self, modules: list[nn.Module], cls: type) -> None:
        self._swapped = [(module, type(module)) for module in modules]
        for original in {original for _, original in self._swapped}:
            register_like(cls, original)
        for module, _ in self._swapped:
            module.__class__ = cls
            module.__dict__[self.SWAPPED_TO] = cls

    def remove(self) -> None:
        for module, original in self._swapped:
            module.__class__ = original
            del module.__dict__[self.SWAPPED_TO]


_bindings: dict[tuple[str, str], tuple[Any, int]] = {}  # (module, name) -> (its original object, holders)


class ReboundName:
    """`name` in module `module_name` bound to `make(original)` until `remove()`. Holders of one name share the
    first holder's binding (one `make` per name), and the last `remove()` puts the original back."""

    def __init__(self, module_name: str, name: str, make: Callable[[Any], Any]) -> None:
        self._key = (module_name, name)
        original, holders = _bindings.get(self._key, (None, 0))
        if not holders:
            module = importlib.import_module(module_name)
            original = getattr(module, name)
            setattr(module, name, make(original))
        _bindings[self._key] = (original, holders + 1)

    def remove(self) -> None:
        original, holders = _bindings.pop(self._key)
        if holders > 1:
            _bindings[self._key] = (original, holders - 1)
        else:
            setattr(importlib.import_module(self._key[0]), self._key[1], original)
