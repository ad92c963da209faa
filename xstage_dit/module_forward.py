"""Replacing a module's forward for a while: the layers `enable` puts around a transformer's forward stack
(CUDA graphs inside, the CFG split outside), each undone exactly, whatever was there before."""
from __future__ import annotations

from typing import Callable

from torch import nn


class ReplacedForward:
    """`model.forward` replaced by `new` (an instance attribute); `inner` is what was called before.
    `restore()` puts back exactly what was there: an instance attribute someone else set, or none."""

    def __init__(self, model: nn.Module, new: Callable) -> None:
        self.model = model
        self.inner: Callable = model.forward
        self._previous = model.__dict__.get("forward")
        model.forward = new

    def restore(self) -> None:
        if self._previous is None:
            del self.model.forward
        else:
            self.model.forward = self._previous
