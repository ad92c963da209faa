"""Attention masks the backends take: key-padding masks only, (B, 1, 1, keys), boolean (True = attend) or
additive. Joint-attention models mask their padded prompt tokens this way; image keys are masked only by our tail
padding, which the backends drop by key length."""
from __future__ import annotations

from enum import Enum

import torch

from .layout import UlyssesLayout


class QueryKeyMasks(Enum):
    """How a model's (B, 1, queries, keys) masks, built from one per-token vector m whose first query's entry is
    always 1 (a valid text or image token), reach the backends: as their first row, m over the keys.

    FIRST_ROW: boolean outer products whose masked (padding) query rows no other token reads, so that every row
    may take the first one's key-padding mask (HunyuanVideo 1.5).
    PAIR_BIAS: additive 0/1 outer products m_q m_k that every query adds to its logits, padding queries included,
    whose rows other tokens read as keys (Chroma): attention rebuilds the pair bias over the gathered tokens."""

    FIRST_ROW = "first_row"
    PAIR_BIAS = "pair_bias"


def check_key_padding(mask: torch.Tensor) -> None:
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        raise ValueError(f"xstage_dit: only key-padding attention masks of shape (B, 1, 1, keys) are supported, "
                         f"got {tuple(mask.shape)}")


def text_key_mask(attn_mask: torch.Tensor | None, layout: UlyssesLayout) -> torch.Tensor | None:
    """The text-key part of a key-padding mask over one rank's [text, image] keys."""
    if attn_mask is None:
        return None
    if layout.text_len == 0:
        raise ValueError("xstage_dit: attention masks on image-only sequence-sharded attention are not supported")
    check_key_padding(attn_mask)
    return layout.split(attn_mask.transpose(1, 3))[0].transpose(1, 3)


def keep_keys(mask: torch.Tensor | None) -> torch.Tensor | None:
    """(B, keys) bool, True where a key is attended, from a key-padding mask (what our kernels take)."""
    if mask is None:
        return None
    check_key_padding(mask)
    flat = mask[:, 0, 0]
    return flat if flat.dtype == torch.bool else flat > torch.finfo(flat.dtype).min / 2


def with_image_keys(text_mask: torch.Tensor | None, image_len: int) -> torch.Tensor | None:
    """The SDPA mask over [text, image] keys that applies `text_mask` to the text keys and lets every image key
    through; None without a text mask."""
    if text_mask is None:
        return None
    shape = (*text_mask.shape[:-1], image_len)
    if text_mask.dtype == torch.bool:
        image = torch.ones(shape, dtype=torch.bool, device=text_mask.device)
    else:
        image = torch.zeros(shape, dtype=text_mask.dtype, device=text_mask.device)
    return torch.cat([text_mask, image], dim=-1)


def pair_bias(text_factor: torch.Tensor, layout: UlyssesLayout, query_rows: int, key_rows: int) -> torch.Tensor:
    """The additive (B, 1, queries, keys) bias m_q m_k over the gathered [text, image] tokens (text first) of a
    per-token 0/1 factor given on the text tokens, (B, 1, 1, T); every image token's factor is 1."""
    if not (layout.text_first and layout.text_queries):
        raise ValueError("xstage_dit: pair-bias masks need text first, attending as queries")
    factor = text_factor[:, 0, 0]  # (B, T)
    ones = factor.new_ones(factor.shape[0], max(query_rows, key_rows) - factor.shape[1])
    tokens = torch.cat([factor, ones], dim=1)
    return (tokens[:, :query_rows, None] * tokens[:, None, :key_rows]).unsqueeze(1)
