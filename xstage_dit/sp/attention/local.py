"""Attention on one rank, in diffusers' (batch, seq, heads, head_dim) layout, through the fastest SDPA kernel."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

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


@functools.cache
def diffusers_attention(backend: str):
    """The attention the user chose for the model (`set_attention_backend`): diffusers' own dispatcher with that
    backend, on (B, S, H, D) tensors like sdpa_bshd."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               scale: float | None = None) -> torch.Tensor:
        return dispatch_attention_fn(query, key, value, attn_mask=attn_mask, scale=scale, backend=backend)

    return attend
