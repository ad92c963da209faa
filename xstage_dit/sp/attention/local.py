"""Attention on one rank, in diffusers' (batch, seq, heads, head_dim) layout: through the fastest SDPA kernel, or
our attention kernel (kernels/attention.py)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .masks import keep_keys

# cuDNN attention is SDPA's fastest kernel on Hopper for DiT shapes (docs/benchmarks/kernels-h200.md); SDPA
# falls through this list to the first kernel that accepts the inputs.
_GPU_PRIORITY = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def sdpa_bshd(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for (B, S, H, D) tensors; queries and keys may differ in length."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    if q.is_cuda:
        with sdpa_kernel(_GPU_PRIORITY, set_priority=True):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    return out.transpose(1, 2)


def flash_attention_bshd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None, scale: float | None, fp8: bool = False) -> torch.Tensor:
    """Our attention kernel (with FP8 products: `fp8`); a key-padding mask (B, 1, 1, keys) becomes its key
    mask."""
    from ...kernels.attention import flash_attention  # Triton: imported where our kernel runs

    return flash_attention(query, key, value, scale=scale, key_mask=keep_keys(attn_mask), fp8=fp8).out


def fp8_attention_bshd(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attn_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """Our attention kernel's FP8 attention (kernels/attention_fp8.py)."""
    return flash_attention_bshd(query, key, value, attn_mask, scale, fp8=True)


@functools.cache
def diffusers_attention(backend: str):
    """The attention the user chose for the model (`set_attention_backend`): diffusers' own dispatcher with that
    backend, on (B, S, H, D) tensors like sdpa_bshd."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, scale=scale, backend=backend)

    return attend
