"""Counts the calls that write a watched model's parameters or move its adapters, so that watching a model costs
nothing until one comes. Reading the model itself would not: torch's version counters are one attribute per
parameter (a pass over all of them per read) and miss writes through `.data`, and PEFT keeps its adapter state in
Python attributes of every tuner layer.

While anything is watched, `nn.Parameter`'s in-place methods, in-place operators and item assignment, its `.data`
(read, since the tensor it returns writes the parameter's memory unseen, or set), the same of each tensor subclass
that a watched parameter is without being an `nn.Parameter` (torchao's quantized weights, which are parameters by a
flag only), `torch.utils.swap_tensors` (how `module.to()` moves such a weight: the object stays, its contents are
swapped), and PEFT tuner layers' methods that change which adapters run and how are wrapped: a call on a watched
parameter or layer counts for each of its watchers. The wrappers are removed when the last watcher stops.

Not counted: writes through other aliases of a parameter (`detach()`, `state_dict()`'s tensors, views, an
alias taken from `.data` before the last read, a quantized weight's inner tensors), `out=` and `torch._foreach_*_`
writes, and parameters or layers put in place without registration (`module._parameters[name] = ...`)."""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Iterable

import torch
from torch import nn

# in-place methods that change a parameter's flags or names but not its values or memory
_NOT_WRITES = {"requires_grad_", "rename_"}
_IN_PLACE_OPERATORS = ("__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__",
                       "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                       "__irshift__")
# PEFT tuner layers' methods that change which adapters run, how they are weighted, or merge them
_ADAPTER_METHODS = ("set_adapter", "enable_adapters", "delete_adapter", "set_scale", "scale_layer",
                    "unscale_layer", "merge", "unmerge")
_DATA = torch._C.TensorBase.data


class WriteCounts:
    """What the hooks counted on the parameters and tuner layers one watcher follows."""

    def __init__(self) -> None:
        self.parameter_writes = 0
        self.adapter_calls = 0
        self._parameters: list[int] = []
        self._tuners: list[int] = []

    def follow(self, parameters: Iterable[nn.Parameter], tuners: Iterable[nn.Module]) -> None:
        """Counts calls on these from now on, instead of on those followed before."""
        self._unlist()
        self._parameters, self._tuners = [id(p) for p in parameters], [id(layer) for layer in tuners]
        for key in self._parameters:
            _PARAMETERS.setdefault(key, []).append(self)
        for key in self._tuners:
            _TUNERS.setdefault(key, []).append(self)
        _HOOKS.install({type(p) for p in parameters if not issubclass(type(p), nn.Parameter)} - {torch.Tensor})

    def stop(self) -> None:
        """Counts nothing more (a second time does nothing)."""
        self._unlist()
        if not _PARAMETERS and not _TUNERS:
            _HOOKS.remove()

    def _unlist(self) -> None:
        for table, keys in ((_PARAMETERS, self._parameters), (_TUNERS, self._tuners)):
            for key in keys:
                watchers = table[key]
                watchers.remove(self)
                if not watchers:
                    del table[key]
        self._parameters, self._tuners = [], []


# id of a watched parameter or tuner layer -> its watchers (ids: the hooks run on every parameter's writes)
_PARAMETERS: dict[int, list[WriteCounts]] = {}
_TUNERS: dict[int, list[WriteCounts]] = {}


def _count_parameter_write(parameter: nn.Parameter) -> None:
    for watcher in _PARAMETERS.get(id(parameter), ()):
        watcher.parameter_writes += 1


def _count_adapter_call(layer: nn.Module) -> None:
    for watcher in _TUNERS.get(id(layer), ()):
        watcher.adapter_calls += 1


def _counting(method: Callable[..., Any], count: Callable[[Any], None]) -> Callable[..., Any]:
    @functools.wraps(method)
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        count(self)  # after the call: a watcher that reads the model now sees what it wrote
        return result

    counted._counts_calls_of = method  # type: ignore[attr-defined]
    return counted


def _uncounted(cls: type, name: str) -> Any:
    """`cls`'s attribute `name` as it is without our wrappers (which a class may inherit from one wrapped before)."""
    value = getattr(cls, name)
    return getattr(value, "_counts_calls_of", value)


def _counting_swaps(swap: Callable[[torch.Tensor, torch.Tensor], None]) -> Callable[..., None]:
    @functools.wraps(swap)
    def counted(first: torch.Tensor, second: torch.Tensor) -> None:
        swap(first, second)
        _count_parameter_write(first)
        _count_parameter_write(second)

    return counted


def _get_data(parameter: nn.Parameter) -> torch.Tensor:
    _count_parameter_write(parameter)
    return _DATA.__get__(parameter)


def _set_data(parameter: nn.Parameter, data: torch.Tensor) -> None:
    _DATA.__set__(parameter, data)
    _count_parameter_write(parameter)


def _tuner_classes() -> list[type]:
    """PEFT's tuner layer classes, once PEFT is imported (before, no model has tuner layers)."""
    tuners_utils = sys.modules.get("peft.tuners.tuners_utils")
    if tuners_utils is None:
        return []
    classes, pending = [], [tuners_utils.BaseTunerLayer]
    while pending:
        cls = pending.pop()
        if cls not in classes:
            classes.append(cls)
            pending.extend(cls.__subclasses__())
    return classes


class _ClassHooks:
    """The wrappers set on the classes (and on `torch.utils`), and what they replaced there (`None`: the class
    inherited it)."""

    def __init__(self) -> None:
        self._replaced: list[tuple[type, str, Any]] = []
        self._parameter_classes: set[type] = set()
        self._tuners_wrapped = False

    def install(self, tensor_classes: set[type]) -> None:
        """Wraps `nn.Parameter` and `tensor_classes` (the other classes watched parameters are), where not yet."""
        if not self._replaced:
            self._set(torch.utils, "swap_tensors", _counting_swaps(torch.utils.swap_tensors))
        for cls in (nn.Parameter, *tensor_classes):
            if cls not in self._parameter_classes:
                self._wrap_parameters(cls)
        if not self._tuners_wrapped:  # PEFT may come later, with the first adapter loaded
            self._wrap_tuners()

    def _wrap_parameters(self, cls: type) -> None:
        writes = [name for name in dir(torch.Tensor) if name.endswith("_") and not name.startswith("_")
                  and name not in _NOT_WRITES and callable(getattr(torch.Tensor, name))]
        writes += [name for name in _IN_PLACE_OPERATORS if hasattr(torch.Tensor, name)]
        for name in writes:
            self._set(cls, name, _counting(_uncounted(cls, name), _count_parameter_write))
        self._set(cls, "data", property(_get_data, _set_data, doc=_DATA.__doc__))
        self._parameter_classes.add(cls)

    def _wrap_tuners(self) -> None:
        classes = _tuner_classes()
        self._tuners_wrapped = bool(classes)
        for cls in classes:
            for name in _ADAPTER_METHODS:
                if name in vars(cls):  # wrapped where defined: an override that calls super() counts twice
                    self._set(cls, name, _counting(vars(cls)[name], _count_adapter_call))

    def _set(self, cls: Any, name: str, value: Any) -> None:
        self._replaced.append((cls, name, vars(cls).get(name)))
        setattr(cls, name, value)

    def remove(self) -> None:
        for cls, name, before in reversed(self._replaced):
            if before is None:
                delattr(cls, name)
            else:
                setattr(cls, name, before)
        self._replaced, self._parameter_classes, self._tuners_wrapped = [], set(), False


_HOOKS = _ClassHooks()
