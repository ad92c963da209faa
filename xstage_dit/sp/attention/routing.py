"""Send the attention calls of a patched model's chosen attention modules to xstage_dit.

diffusers' processors call either `dispatch_attention_fn` (Flux, Wan, HunyuanVideo, QwenImage, LTX) or
`F.scaled_dot_product_attention` (SD3, CogVideoX, HiDream) by name in their module. We rebind that name to a
router (and, where a family's plan names it, `apply_rotary_emb` to one that runs our RoPE kernel), and each
routed attention module is marked active while it runs (`mark_active`): calls made inside an active module go to its
`UlyssesAttention` (or the RoPE kernel), unless it declines them (`routes`: calls within a prefix every rank holds
whole, and a family's local cross-attention such as a Flux IP-Adapter's); every other call (text refiners,
cross-attention, VAEs, models that are not enabled) goes to diffusers or torch unchanged. A processor of ours that
holds q and k before their norms and rotation (patches/image/flux.py) may first offer them as they are
(`joint_attention`); code that attends keys every rank holds whole besides the sequence's (FLUX.2's cached
reference keys) asks `attention_with_whole_keys`. No processor code is copied. Bindings are shared by the enabled
models (module_forward.ReboundName): the last one's `remove` restores the original."""
from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch
from torch import nn

from ...kernels.rotary_args import JointTokens
from ...hooks.diffusers_registries import register_like
from ...hooks.module_forward import ReboundName, ReplacedForward
from . import ops
from .layout import WholeKeys
from .ulysses import GatheredKeysAttention, UlyssesAttention

_active: UlyssesAttention | GatheredKeysAttention | None = None

# the kinds of call sites, and the module attribute a processor looks them up by
DISPATCH = "dispatch_attention_fn"
SDPA = "F"
ROTARY = "apply_rotary_emb"


def _dispatch_router(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                              enable_gqa=False, attention_kwargs=None, *, backend=None, parallel_config=None):
        if _active is not None and _active.routes(query.shape[1], key.shape[1]) \
                and not _whole_mask_unsplit(attn_mask):  # (B, S, H, D)
            return _active(query, key, value, attn_mask, dropout_p, is_causal, scale, _backend_name(backend))
        return original(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs,
                        backend=backend, parallel_config=parallel_config)

    return dispatch_attention_fn


def _whole_mask_unsplit(attn_mask: Any) -> bool:
    """A mask that is not a tensor (flex attention's BlockMask, over the whole sequence) where the sequence is not
    split: diffusers' own dispatch takes it (split, the active attention refuses it)."""
    return attn_mask is not None and not isinstance(attn_mask, torch.Tensor) and _active.shard.degree == 1


def _backend_name(backend: Any) -> str | None:
    """A diffusers attention backend (its enum, or its name) by name."""
    return None if backend is None else getattr(backend, "value", backend)


def joint_attention(query: JointTokens, key: JointTokens, value: JointTokens, attn_mask: torch.Tensor | None = None,
                    backend: Any = None) -> torch.Tensor | None:
    """A routed `dispatch_attention_fn` call for q, k, v held as JointTokens (a processor that would otherwise
    normalise, join and rotate them first): the active Ulysses attention's, where it takes them; None where it
    does not (or no attention of ours is active), and the caller joins them and dispatches as usual."""
    if not isinstance(_active, UlyssesAttention) or not _active.routes(query.rows, key.rows):
        return None
    return _active.joint(query, key, value, attn_mask, None, _backend_name(backend))


def attention_with_whole_keys(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, whole: WholeKeys
                              ) -> torch.Tensor | None:
    """A routed attention call (B, S, H, D) that also attends keys and values every rank holds whole (cached
    reference-image keys): the active Ulysses attention's where the tokens are split; None otherwise, and the
    caller attends over all the keys as diffusers does."""
    if not isinstance(_active, UlyssesAttention) or not _active.routes(query.shape[1], key.shape[1]):
        return None
    return _active.with_whole_keys(query, key, value, whole)


def joint_attention_offered(keys: int, device: torch.device) -> bool:
    """Whether `joint_attention` of self-attention over `keys` tokens on `device` may take JointTokens now, the
    tensors' own checks aside (asked by a processor that would otherwise leave the whole call to diffusers'
    code)."""
    return (isinstance(_active, UlyssesAttention) and _active.routes(keys, keys)
            and _active.takes_joint_tokens(device))


def _sdpa_router(original: types.ModuleType) -> types.ModuleType:
    """torch.nn.functional with scaled_dot_product_attention routed; (B, H, S, D) layout like torch's."""

    class RoutedFunctional(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(original, name)

        @staticmethod
        def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                         scale=None, enable_gqa=False):
            if _active is None or not _active.routes(query.shape[2], key.shape[2]):  # (B, H, S, D)
                return original.scaled_dot_product_attention(
                    query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa,
                )
            out = _active(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask,
                          dropout_p, is_causal, scale)
            return out.transpose(1, 2)

    return RoutedFunctional("torch.nn.functional (xstage_dit-routed)")


def _rotary_router(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def apply_rotary_emb(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
        if (_active is not None and _active in _rotating and use_real and use_real_unbind_dim == -1
                and ops.rotary_kernel_runs(x, *freqs_cis, sequence_dim)):
            return ops.rotary(x, *freqs_cis, sequence_dim)
        return original(x, freqs_cis, use_real, use_real_unbind_dim, sequence_dim)

    return apply_rotary_emb


_ROUTERS = {DISPATCH: _dispatch_router, SDPA: _sdpa_router, ROTARY: _rotary_router}


def route(module_name: str, kind: str) -> ReboundName:
    """`kind` (DISPATCH or SDPA) in `module_name` bound to its router until the handle's `remove()` (shared by
    every enabled model whose plan routes it)."""
    return ReboundName(module_name, kind, _ROUTERS[kind])


_rotating: list[UlyssesAttention] = []  # the attentions whose modules' apply_rotary_emb calls run our kernel


class RotaryRoute:
    """`apply_rotary_emb` in `module_name` routed to our RoPE kernel for the calls made while `attention` is
    active, until `remove()`."""

    def __init__(self, module_name: str, attention: UlyssesAttention) -> None:
        self._attention = attention
        self._binding = ReboundName(module_name, ROTARY, _ROUTERS[ROTARY])
        _rotating.append(attention)

    def remove(self) -> None:
        _rotating.remove(self._attention)
        self._binding.remove()


class ActiveMark:
    """A module marked by `mark_active`; `remove()` restores its class, and its instance forward if wrapped and
    nobody wrapped that since (a hook registry created after `enable` keeps working: our wrapper inside it then
    runs the old forward without an active attention)."""

    def __init__(self, module: nn.Module, original: type, wrapped: ReplacedForward | None) -> None:
        self.module, self.original, self.wrapped = module, original, wrapped

    def remove(self) -> None:
        if self.wrapped is not None and self.wrapped.is_outermost():
            self.wrapped.restore()
        self.module.__class__ = self.original
        del self.module._xstage_attention


def mark_active(module: nn.Module, attention: UlyssesAttention | GatheredKeysAttention) -> ActiveMark:
    """Make `attention` receive the routed calls made while `module` runs. The module's class is swapped for a
    subclass whose forward activates the module's `_xstage_attention`: one subclass per original class, shared
    by every marked module, so that a compiler sees every block's attention module alike (per-module hooks would
    make it compile each block anew). A forward set on the instance before (a diffusers hook registry, e.g. of a
    cache enabled earlier, or accelerate's) calls the original class's forward and would bypass the subclass:
    it is wrapped to activate too."""
    original = type(module)
    module.__class__ = _activating(original)
    module._xstage_attention = attention
    wrapped = None
    if "forward" in module.__dict__:
        instance_forward = module.__dict__["forward"]
        wrapped = ReplacedForward(module, functools.wraps(instance_forward)(
            functools.partial(_run_active, module, instance_forward)))
    return ActiveMark(module, original, wrapped)


def marked_attention(module: nn.Module) -> UlyssesAttention | GatheredKeysAttention | None:
    """The attention `mark_active` gave `module`; None where it is not marked. A model that runs modules another
    enabled model marked (a ControlNet running its transformer's refiner) splits their tokens by that attention's
    shard."""
    return getattr(module, "_xstage_attention", None)


def _run_active(module: nn.Module, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`forward(*args, **kwargs)` with the module's attention active; none once the mark is removed (a hook
    registered while the module was marked still calls the marked class's forward)."""
    global _active
    outer = _active
    _active = getattr(module, "_xstage_attention", None)
    try:
        return forward(*args, **kwargs)
    finally:
        _active = outer


@functools.cache
def _activating(cls: type) -> type:
    original_forward = cls.forward  # the function itself: a compiler traces it, not an attribute of a type

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _run_active(self, original_forward, self, *args, **kwargs)

    activating = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__})
    register_like(activating, cls)
    return activating
