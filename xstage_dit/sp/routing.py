"""Send a patched model's attention calls to xstage_dit.

diffusers' attention processors call `dispatch_attention_fn(..., parallel_config=self._parallel_config)` by
its name in the model's module. We rebind that name to a router that hands calls whose `parallel_config` is an
`UlyssesAttention` to it and every other call to diffusers unchanged, so no processor code is copied and models
that are not enabled keep diffusers' behaviour. The binding is reference-counted per module."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, Callable

from .attention import UlyssesAttention

_routed: dict[str, tuple[Callable[..., Any], int]] = {}


def _router(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if isinstance(parallel_config, UlyssesAttention):
            return parallel_config(query, key, value, attn_mask, dropout_p, is_causal, scale)
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                        backend=backend, parallel_config=parallel_config)

    return dispatch_attention_fn


def route(module_name: str) -> None:
    """Rebind `dispatch_attention_fn` in `module_name` to the router (idempotent, counted)."""
    module: ModuleType = importlib.import_module(module_name)
    if module_name in _routed:
        original, count = _routed[module_name]
        _routed[module_name] = (original, count + 1)
        return
    original = module.dispatch_attention_fn
    module.dispatch_attention_fn = _router(original)
    _routed[module_name] = (original, 1)


def unroute(module_name: str) -> None:
    """Undo one `route`; the last one restores diffusers' function."""
    original, count = _routed[module_name]
    if count > 1:
        _routed[module_name] = (original, count - 1)
        return
    importlib.import_module(module_name).dispatch_attention_fn = original
    del _routed[module_name]
