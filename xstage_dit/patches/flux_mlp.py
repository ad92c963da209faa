"""FLUX.1's single-stream blocks without writing the concatenation of their attention output and MLP branch
(15360 columns per token at FLUX.1-dev's size): the output projection runs as two GEMMs, the second accumulating
into the first's output, and the MLP's tanh-GELU runs in its GEMM's epilogue (fused_gelu.gelu_linear).

The blocks get a subclass of the same name (so that `compile_repeated_blocks`, which finds blocks by class name,
still compiles them) until `remove`. Its forward is diffusers' with those two changes; its result differs from
diffusers' by rounding (the GELU on the float32 accumulator; the attention part of the projection rounded once
before the MLP part is added)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.transformers import transformer_flux
from torch import nn

from ..fused_gelu import gelu_linear
from ..module_forward import SwappedClasses


def project_joined(first: torch.Tensor, second: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """`linear(torch.cat([first, second], dim=-1))` without writing the concatenation: a GEMM over `first`'s
    columns of the weight, then one over `second`'s accumulating into its output."""
    split = first.shape[-1]
    out = F.linear(first, linear.weight[:, :split], linear.bias)
    out = torch.addmm(out.view(-1, out.shape[-1]), second.reshape(-1, second.shape[-1]), linear.weight[:, split:].t())
    return out.view(*first.shape[:-1], out.shape[-1])


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


def split_projection_blocks(model: nn.Module) -> SwappedClasses:
    """The model's single-stream blocks switched to `SplitProjectionBlock` until `.remove()`."""
    return SwappedClasses([module for module in model.modules() if _takes_single_block(module)],
                          SplitProjectionBlock)
