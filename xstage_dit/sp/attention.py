"""The attention entry point a patched model's processors call instead of diffusers' dispatcher."""
from __future__ import annotations

import torch

from .backends import UlyssesLayout, get_backend
from .local_attention import sdpa_bshd
from .sharding import SequenceShard


class UlyssesAttention:
    """Ulysses attention for one model: knows the model's token split and the backend, not the model."""

    def __init__(self, shard: SequenceShard, backend: str) -> None:
        self.shard = shard
        self.backend_name = backend
        self._backend = get_backend(backend)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
    ) -> torch.Tensor:
        if dropout_p or is_causal:
            raise ValueError("xstage_dit attention is for inference: dropout and causal masks are not supported")
        shard = self.shard
        if shard.degree == 1:
            return sdpa_bshd(query, key, value, attn_mask=attn_mask, scale=scale)
        if attn_mask is not None:
            raise ValueError(
                "xstage_dit: an attention mask on sequence-sharded attention is not supported for this model"
            )
        layout = UlyssesLayout(
            text_len=query.shape[1] - shard.local_len,
            seq_len=shard.seq_len,
            local_len=shard.local_len,
            degree=shard.degree,
            rank=shard.rank,
        )
        return self._backend(query, key, value, layout, shard.group, scale)
