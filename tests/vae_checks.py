"""What the VAE tests share."""
from __future__ import annotations

import torch


def rows_seen(vae: torch.nn.Module) -> list[int]:
    """Rows of every input the decoder's first convolution gets (recorded by a hook)."""
    seen: list[int] = []
    vae.decoder.conv_in.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[-2]))
    return seen
