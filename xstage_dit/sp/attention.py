"""The attention entry point a patched model's processors call instead of diffusers' dispatcher."""
from __future__ import annotations

import torch

from .auto import choose_local
from .backends import UlyssesLayout, get_backend
from .ops import ulysses_attention
from .sharding import SequenceShard


class UlyssesAttention:
    """Ulysses attention for one model: knows the model's token split and the backend, not the model.
    `fuse_rope`: the model's routed `apply_rotary_emb` calls run our RoPE kernel (routing.ROTARY reads it here,
    where the active module's settings are)."""

    def __init__(self, shard: SequenceShard, backend: str, text_first: bool = True, fuse_rope: bool = True) -> None:
        self.shard = shard
        self.text_first = text_first
        self.backend_name = backend
        self.fuse_rope = fuse_rope

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
            local = choose_local(query) if self.backend_name == "auto" else get_backend(self.backend_name).local
            return local(query, key, value, attn_mask, scale)
        layout = UlyssesLayout(
            text_len=query.shape[1] - shard.local_len,
            seq_len=shard.seq_len,
            local_len=shard.local_len,
            degree=shard.degree,
            rank=shard.rank,
            text_first=self.text_first,
        )
        return ulysses_attention(
            query, key, value, self._text_mask(attn_mask, layout), layout.text_len, layout.seq_len,
            layout.local_len, layout.degree, layout.rank, layout.text_first, self.backend_name,
            shard.group.group_name, scale,
        )

    @staticmethod
    def _text_mask(attn_mask: torch.Tensor | None, layout: UlyssesLayout) -> torch.Tensor | None:
        """The text-key part of a key-padding mask over this rank's [text, image] keys. Joint-attention models
        mask padded prompt tokens this way; image keys are never masked by them, only by our tail padding."""
        if attn_mask is None or layout.text_len == 0:
            if attn_mask is not None:
                raise ValueError("xstage_dit: attention masks on image-only sequence-sharded attention are not supported")
            return None
        if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2] != 1:
            raise ValueError(
                f"xstage_dit: only key-padding masks of shape (B, 1, 1, keys) are supported, got {tuple(attn_mask.shape)}"
            )
        return layout.split(attn_mask.transpose(1, 3))[0].transpose(1, 3)
