"""diffusers' tanh-GELU feed-forward activations (`GELU(approximate="tanh")`: a Linear, then the GELU) as one GEMM
with the GELU in its epilogue (`torch._addmm_activation`, cuBLASLt's GELU epilogue, on CUDA): the pass that reads
and writes the feed-forward's widest activations once more goes away. The GELU then acts on the float32
accumulator rather than on the output rounded to the model's dtype. The modules get a subclass of the same name
until `remove`; elsewhere (CPU, a Linear that is not plain, such as a LoRA layer or one with a quantized weight:
fusions/plain.py; mixed dtypes) they run diffusers' forward."""
from __future__ import annotations

import torch
from diffusers.models.activations import GELU
from torch import nn

from ..hooks.module_forward import SwappedClasses, named_as
from .plain import reads_plain


def gelu_linear(x: torch.Tensor, linear: nn.Module, where: str) -> torch.Tensor:
    """tanh-GELU of `linear(x)`; on CUDA with the GELU in the GEMM's epilogue where `linear` is a plain Linear
    with a bias, in x's dtype (`where` names it in the warning of one that is not plain)."""
    if (x.is_cuda and reads_plain(linear, nn.Linear, where) and linear.bias is not None
            and x.dtype == linear.weight.dtype):
        out = torch._addmm_activation(linear.bias, x.reshape(-1, x.shape[-1]), linear.weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], out.shape[-1])
    return nn.functional.gelu(linear(x), approximate="tanh")


@named_as(GELU)
class EpilogueGELU(GELU):
    """diffusers' GELU with the tanh approximation, through `gelu_linear`."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gelu_linear(hidden_states, self.proj, "GELU.proj in the GELU epilogue")


def epilogue_gelus(model: nn.Module) -> SwappedClasses:
    """Every tanh-GELU module of `model` switched to `EpilogueGELU` until `.remove()`."""
    return SwappedClasses([module for module in model.modules()
                           if type(module) is GELU and module.approximate == "tanh"], EpilogueGELU)
