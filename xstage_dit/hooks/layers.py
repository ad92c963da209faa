"""What `enable` installs, as named layers with one undo record type: a layer's install returns the changes it
made (each undone by `.remove()`), kept as `Installed`; the layers on one module or pipeline are kept in
installation order in one `LayerStack`, which removes them last first. The table of layers and their order lives
in xstage_dit/layers.py; this module only keeps and undoes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

_STACK_ATTR = "_xstage_dit_layers"


class Change(Protocol):
    """One undoable change: a hook handle, a swapped class, a rebound name, a replaced forward..."""

    def remove(self) -> None: ...


@dataclass
class Installed:
    """One layer on one target: its name, and its changes in the order they were made."""

    layer: str
    changes: list[Change]

    def remove(self) -> None:
        for change in reversed(self.changes):
            change.remove()


@dataclass
class LayerStack:
    """The layers installed on one target (a transformer, a pipeline), innermost first."""

    installed: list[Installed] = field(default_factory=list)

    def push(self, layer: str, changes: list[Change]) -> None:
        """Keep `changes` as `layer`; a layer that changed nothing is not kept."""
        if changes:
            self.installed.append(Installed(layer, list(changes)))

    def names(self) -> list[str]:
        return [installed.layer for installed in self.installed]

    def changes_of(self, layer: str) -> list[Change]:
        """The changes of the layer named `layer` (none where it is not installed)."""
        return [change for installed in self.installed if installed.layer == layer for change in installed.changes]

    def remove(self) -> None:
        while self.installed:
            self.installed.pop().remove()


def stack_of(target: Any) -> LayerStack | None:
    """The layer stack on `target`, if any."""
    return getattr(target, _STACK_ATTR, None)


def attach_stack(target: Any) -> LayerStack:
    """A new, empty layer stack on `target`, which must have none."""
    assert stack_of(target) is None, f"{type(target).__name__} already has xstage_dit layers"
    stack = LayerStack()
    setattr(target, _STACK_ATTR, stack)
    return stack


def detach_stack(target: Any) -> None:
    """Every layer on `target` removed, last first, and the stack itself."""
    stack = stack_of(target)
    if stack is not None:
        stack.remove()
        delattr(target, _STACK_ATTR)
