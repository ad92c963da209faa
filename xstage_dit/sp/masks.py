"""Attention masks the backends take: key-padding masks only, (B, 1, 1, keys), boolean (True = attend) or
additive. Joint-attention models mask their padded prompt tokens this way; image keys are masked only by our tail
padding, which the backends drop by key length."""
from __future__ import annotations

import torch

from .layout import UlyssesLayout


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
