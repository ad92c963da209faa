"""What patches share to run their own attention processors on diffusers modules while a model is enabled."""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from ..hooks.diffusers_registries import register_like


class StandInProcessor:
    """Base of a processor that stands in for diffusers' one on a module: it keeps the attention backend and
    parallel config diffusers set on the processor it replaces (`set_attention_backend` sets them on ours too).
    diffusers may also make one without arguments, as `type(processor)()` (loading or unloading an IP-Adapter
    gives the modules it leaves alone a fresh processor of their current class): it then has the defaults."""

    _attention_backend = None
    _parallel_config = None

    def __init__(self, replaced: Any = None) -> None:
        if replaced is not None:
            self._attention_backend = replaced._attention_backend
            self._parallel_config = replaced._parallel_config


class ReplacedProcessors:
    """`make(processor)` set on every module of `modules` that `takes`, until `remove` puts the old ones back (a
    processor the user set before stays where `takes` refuses it, and one that diffusers set since, e.g. an
    IP-Adapter's, stays on its module)."""

    def __init__(self, modules: list[nn.Module], takes: Callable[[nn.Module], bool],
                 make: Callable[[Any], StandInProcessor]) -> None:
        self._replaced = [(module, module.processor) for module in modules if takes(module)]
        for module, processor in self._replaced:
            module.processor = make(processor)
            register_like(type(module.processor), type(processor))

    def remove(self) -> None:
        for module, processor in self._replaced:
            if isinstance(module.processor, StandInProcessor):
                module.processor = processor


def rms_norm_eps(norm: nn.RMSNorm) -> float:
    """The eps an RMSNorm module adds: torch's RMSNorm without one uses float32's, the type it computes in."""
    return torch.finfo(torch.float32).eps if norm.eps is None else norm.eps
