"""xstage_dit: Ulysses sequence-parallel inference for diffusers Diffusion Transformers.

    pipe = xstage_dit.enable(pipe)   # under torchrun: every rank runs its share of the sequence
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .api import cuda_graph_use, disable, enable, installed_layers, is_main_process
    from .config import XStageConfig
    from .runtime.distributed import local_device
    from .sp.attention.backends import available_backends

# each public name's module, imported at the name's first use: the command-line tools answer --help and bad
# arguments without loading torch and diffusers (seconds)
_EXPORTS = {"enable": "api", "disable": "api", "installed_layers": "api", "is_main_process": "api",
            "cuda_graph_use": "api", "local_device": "runtime.distributed",
            "available_backends": "sp.attention.backends", "XStageConfig": "config"}

__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
