"""Running code around every call of one pipeline object: its class is swapped for a subclass whose __call__
enters a context built from the call's arguments (Python looks special methods up on the class, so the
instance alone cannot be patched), which may give some arguments other values. `remove()` gives the object its
class back."""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, ContextManager, Mapping


class WrappedPipelineCall:
    """Every call of `pipe` runs inside `around(arguments)`, the call's arguments bound by name with the defaults
    applied (`self` included), until `remove()`. What the context yields, where not None, maps argument names to
    the values the call gets instead (a step callback of ours around the caller's, say)."""

    def __init__(self, pipe: Any, around: Callable[[dict[str, Any]], ContextManager[Mapping[str, Any] | None]]
                 ) -> None:
        cls = type(pipe)
        signature = inspect.signature(cls.__call__)

        @functools.wraps(cls.__call__)  # the pipeline's own signature and docs, for callers that inspect them
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            with around(bound.arguments) as replaced:
                if not replaced:
                    return cls.__call__(self, *args, **kwargs)
                bound.arguments.update(replaced)
                return cls.__call__(*bound.args, **bound.kwargs)

        self._pipe, self._original = pipe, cls
        pipe.__class__ = type(cls.__name__, (cls,), {"__call__": __call__})

    def remove(self) -> None:
        self._pipe.__class__ = self._original
