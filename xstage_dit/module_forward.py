"""Replacing a module's forward (or another method) for a while: the layers `enable` puts around a transformer's
forward stack (CUDA graphs inside, the CFG split outside), and the parallel VAE's layers, each undone exactly,
whatever was there before; and modules switched to a subclass with another forward (`SwappedClasses`)."""
from __future__ import annotations

from typing import Callable

from torch import nn


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


class SwappedClasses:
    """Each of `modules` switched to `cls` (a subclass of its class with another forward) until `remove` puts its
    own class back."""

    def __init__(self, modules: list[nn.Module], cls: type) -> None:
        self._swapped = [(module, type(module)) for module in modules]
        for module, _ in self._swapped:
            module.__class__ = cls

    def remove(self) -> None:
        for module, original in self._swapped:
            module.__class__ = original
