"""FLUX.1's MLP branches without the extra passes over their hidden activations (14 or 15 thousand columns per
token): the tanh-GELU runs in the epilogue of the GEMM before it (`torch._addmm_activation`, cuBLASLt's GELU
epilogue; on CUDA), and each single-stream block projects its attention output and its MLP branch as two GEMMs,
the second accumulating into the first's output, where diffusers writes their concatenation and projects that.

The blocks and the feed-forward GELUs get subclasses of the same names (so that `compile_repeated_blocks`, which
finds blocks by class name, still compiles them) until `remove`. The single-stream forward is diffusers' with those
two changes; its result differs from diffusers' by rounding (the GELU on the float32 accumulator; the attention
part of the projection rounded once before the MLP part is added)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU
from diffusers.models.transformers import transformer_flux
from torch import nn


def gelu_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """tanh-GELU of `linear(x)`; on CUDA with the GELU in the GEMM's epilogue."""
    if x.is_cuda and linear.bias is not None:
        out = torch._addmm_activation(linear.bias, x.reshape(-1, x.shape[-1]), linear.weight.t(), use_gelu=True)
        return out.view(*x.shape[:-1], out.shape[-1])
    return F.gelu(linear(x), approximate="tanh")


def project_joined(first: torch.Tensor, second: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """`linear(torch.cat([first, second], dim=-1))` without writing the concatenation: a GEMM over `first`'s
    columns of the weight, then one over `second`'s accumulating into its output."""
    split = first.shape[-1]
    out = F.linear(first, linear.weight[:, :split], linear.bias)
    out = torch.addmm(out.view(-1, out.shape[-1]), second.reshape(-1, second.shape[-1]), linear.weight[:, split:].t())
    return out.view(*first.shape[:-1], out.shape[-1])


class EpilogueGELU(GELU):
    """diffusers' GELU (a Linear, then the tanh-GELU) as one GEMM with the GELU in its epilogue."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return gelu_linear(hidden_states, self.proj)


EpilogueGELU.__name__ = EpilogueGELU.__qualname__ = GELU.__name__


class SplitProjectionBlock(transformer_flux.FluxSingleTransformerBlock):
    """diffusers' single-stream block with `gelu_linear` for its MLP and `project_joined` for its output."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        text_len = encoder_hidden_states.shape[1]
        residual = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        norm_hidden_states, gate = self.norm(residual, emb=temb)
        mlp_hidden_states = gelu_linear(norm_hidden_states, self.proj_mlp)
        attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                **(joint_attention_kwargs or {}))
        hidden_states = residual + gate.unsqueeze(1) * project_joined(attn_output, mlp_hidden_states, self.proj_out)
        if hidden_states.dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states[:, :text_len], hidden_states[:, text_len:]


SplitProjectionBlock.__name__ = SplitProjectionBlock.__qualname__ = \
    transformer_flux.FluxSingleTransformerBlock.__name__


def _takes_single_block(module: nn.Module) -> bool:
    return (type(module) is transformer_flux.FluxSingleTransformerBlock and isinstance(module.act_mlp, nn.GELU)
            and module.act_mlp.approximate == "tanh")


class FusedMlp:
    """The model's tanh-GELU feed-forwards and single-stream blocks switched to the classes above until
    `remove`."""

    def __init__(self, model: nn.Module) -> None:
        self._swapped: list[tuple[nn.Module, type]] = []
        for module in model.modules():
            if type(module) is GELU and module.approximate == "tanh":
                self._swap(module, EpilogueGELU)
            elif _takes_single_block(module):
                self._swap(module, SplitProjectionBlock)

    def _swap(self, module: nn.Module, cls: type) -> None:
        self._swapped.append((module, type(module)))
        module.__class__ = cls

    def remove(self) -> None:
        for module, original in self._swapped:
            module.__class__ = original
