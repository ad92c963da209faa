"""FLUX.1-style single-stream blocks (FLUX.1's and Chroma's) without writing the concatenation of their attention
output and MLP branch (15360 columns per token at FLUX.1-dev's size): the output projection runs as two GEMMs,
the second accumulating into the first's output, and the MLP's tanh-GELU runs in its GEMM's epilogue
(fusions/gelu.py, `gelu_linear`). A block whose `proj_out` is not a plain Linear (a LoRA layer, hooks: see
fusions/plain.py) runs diffusers' forward for that call.

The blocks get a subclass of the same name (so that `compile_repeated_blocks`, which finds blocks by class name,
still compiles them) until `remove`. Its forward is diffusers' with those two changes; its result differs from
diffusers' by rounding (the GELU on the float32 accumulator; the attention part of the projection rounded once
before the MLP part is added)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.transformers import transformer_chroma, transformer_flux
from torch import nn

from ...fusions.gelu import gelu_linear
from ...fusions.plain import reads_plain
from ...hooks.module_forward import SwappedClasses, named_as


def project_joined(first: torch.Tensor, second: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """`linear(torch.cat([first, second], dim=-1))` without writing the concatenation: a GEMM over `first`'s
    columns of the weight, then one over `second`'s accumulating into its output."""
    split = first.shape[-1]
    out = F.linear(first, linear.weight[:, :split], linear.bias)
    out = torch.addmm(out.view(-1, out.shape[-1]), second.reshape(-1, second.shape[-1]), linear.weight[:, split:].t())
    return out.view(*first.shape[:-1], out.shape[-1])


def splits_projection(block: nn.Module) -> bool:
    """Whether `block`'s output projection can be computed from its weights this call."""
    return reads_plain(block.proj_out, nn.Linear, f"{type(block).__name__}.proj_out in the split projection")


def single_stream_tail(block: nn.Module, residual: torch.Tensor, norm_hidden_states: torch.Tensor,
                       gate: torch.Tensor, attn_output: torch.Tensor) -> torch.Tensor:
    """What a single-stream block does after its attention: `residual + gate * proj_out([attention, MLP])`, with
    the MLP through `gelu_linear` and the projection through `project_joined`."""
    mlp_hidden_states = gelu_linear(norm_hidden_states, block.proj_mlp,
                                    f"{type(block).__name__}.proj_mlp in the GELU epilogue")
    hidden_states = residual + gate.unsqueeze(1) * project_joined(attn_output, mlp_hidden_states, block.proj_out)
    if hidden_states.dtype == torch.float16:
        hidden_states = hidden_states.clip(-65504, 65504)
    return hidden_states


@named_as(transformer_flux.FluxSingleTransformerBlock)
class SplitProjectionBlock(transformer_flux.FluxSingleTransformerBlock):
    """diffusers' FLUX.1 single-stream block ending in `single_stream_tail`."""

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                joint_attention_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not splits_projection(self):
            return super().forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
                                   joint_attention_kwargs)
        text_len = encoder_hidden_states.shape[1]
        residual = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        norm_hidden_states, gate = self.norm(residual, emb=temb)
        attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                **(joint_attention_kwargs or {}))
        hidden_states = single_stream_tail(self, residual, norm_hidden_states, gate, attn_output)
        return hidden_states[:, :text_len], hidden_states[:, text_len:]


@named_as(transformer_chroma.ChromaSingleTransformerBlock)
class ChromaSplitProjectionBlock(transformer_chroma.ChromaSingleTransformerBlock):
    """diffusers' Chroma single-stream block (joined tokens, a prompt mask) ending in `single_stream_tail`."""

    def forward(self, hidden_states: torch.Tensor, temb: torch.Tensor,
                image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None,
                joint_attention_kwargs: dict | None = None) -> torch.Tensor:
        if not splits_projection(self):
            return super().forward(hidden_states, temb, image_rotary_emb, attention_mask, joint_attention_kwargs)
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        if attention_mask is not None:  # the (queries x keys) outer product of the token mask, as diffusers'
            attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]
        attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                attention_mask=attention_mask, **(joint_attention_kwargs or {}))
        return single_stream_tail(self, hidden_states, norm_hidden_states, gate, attn_output)


SPLIT_BLOCKS = {transformer_flux.FluxSingleTransformerBlock: SplitProjectionBlock,
                transformer_chroma.ChromaSingleTransformerBlock: ChromaSplitProjectionBlock}


def _takes_single_block(module: nn.Module, original: type) -> bool:
    return (type(module) is original and isinstance(module.act_mlp, nn.GELU)
            and module.act_mlp.approximate == "tanh")


def split_projection_blocks(model: nn.Module) -> list[SwappedClasses]:
    """The model's single-stream blocks switched to their split-projection subclass until `.remove()`."""
    return [SwappedClasses([module for module in model.modules() if _takes_single_block(module, original)], split)
            for original, split in SPLIT_BLOCKS.items()]
