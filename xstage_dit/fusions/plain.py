"""Whether a fusion may compute a module from its weights instead of calling it. A fusion that reads
`linear.weight` computes what a plain `nn.Linear` computes; a module that is anything else (PEFT's LoRA layers,
which wrap the Linear and add their deltas in their forward; a forward that diffusers' or accelerate's hooks
replaced, as layerwise casting and offloading do; forward hooks; weights of a tensor subclass, as quantized
weights are) must be called as
it is, so the fusion runs the model's own code for it, and says so once. Asked on every call: adapters can be
loaded, set, fused and unloaded at any time. The checks read Python attributes only: a compiled graph holds them
as guards, except forward hooks, which torch does not guard on (`skip_nnmodule_hook_guards`) for any module."""
from __future__ import annotations

import types

import torch
from torch import nn

from ..logging_utils import warn_once

_PLAIN_WEIGHTS = (nn.Parameter, torch.Tensor)


def _own_forward(module: nn.Module) -> bool:
    """Whether `module.forward` is its class's (hooks that replace it set a partial; one they removed again may
    leave the bound method behind). Asked of the bound method, which a compiled graph guards."""
    forward = module.forward
    return isinstance(forward, types.MethodType) and forward.__func__ is type(module).forward


def why_not_plain(module: nn.Module, kind: type[nn.Module]) -> str | None:
    """Why `module` cannot be computed as a plain `kind` from its weights; None where it can."""
    if type(module) is not kind:
        return f"is a {type(module).__module__}.{type(module).__qualname__}, not a plain {kind.__name__}"
    if not _own_forward(module) or module._forward_hooks or module._forward_pre_hooks:
        return "has hooks on its forward"
    for name, weight in module._parameters.items():  # the dict itself: this runs every call
        why = why_not_plain_tensor(name, weight)
        if why is not None:
            return why
    return None


def why_not_plain_tensor(name: str, weight: torch.Tensor | None) -> str | None:
    """Why the weight `name` cannot be read as the numbers it holds (a quantized weight, such as torchao's
    Int8Tensor and Float8Tensor, or a GGUF parameter, stores other numbers and scales); None where it can."""
    if weight is not None and type(weight) not in _PLAIN_WEIGHTS:
        return f"holds its {name} as a {type(weight).__module__}.{type(weight).__qualname__}, not a plain tensor"
    return None


@torch.compiler.assume_constant_result
def say_fallback(what: str) -> bool:
    """Say once that a layer runs diffusers' code, and why (`what`). A compiler runs this as it traces the call
    (its result, always True, is a constant to it): the warning comes without a graph break."""
    warn_once(f"xstage_dit: {what}: that layer runs diffusers' code")
    return True


def reads_plain(module: nn.Module, kind: type[nn.Module], where: str) -> bool:
    """Whether the fusion may compute `module` from its weights this call; where not, says so once, naming it
    by `where` (e.g. "FluxSingleTransformerBlock.proj_out in the split projection")."""
    why = why_not_plain(module, kind)
    if why is not None:
        say_fallback(f"{where} {why}")
    return why is None
