"""Which modules of each supported VAE's decoder take which row-split layer (vae/decode.py), and when a VAE's
decode must stay whole on every rank. Encoders are not split."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from diffusers import (AutoencoderKL, AutoencoderKLHunyuanVideo, AutoencoderKLLTXVideo, AutoencoderKLQwenImage,
                       AutoencoderKLWan)
from diffusers.models.autoencoders import autoencoder_kl_hunyuan_video as hunyuan_video
from diffusers.models.autoencoders import autoencoder_kl_ltx as ltx
from diffusers.models.autoencoders import autoencoder_kl_qwenimage as qwenimage
from diffusers.models.autoencoders import autoencoder_kl_wan as wan
from torch import nn

from ..vae.decode import DecoderLayers, modules_of


@dataclass(frozen=True)
class VaeRule:
    """A VAE class's decoder: its split layers, and a reason its decode stays whole (None where it splits)."""

    layers: Callable[[nn.Module], DecoderLayers]
    replicated_because: Callable[[nn.Module], str | None] = lambda vae: None


def _kl(vae: AutoencoderKL) -> DecoderLayers:
    # attention in the mid block over all H x W positions, each rank's rows its queries; GroupNorm everywhere, the
    # attention's own included
    decoder = vae.decoder
    return DecoderLayers(modules_of(decoder, [nn.Conv2d]), modules_of(decoder, [nn.GroupNorm]),
                         split_queries=[a for a in decoder.mid_block.attentions if a is not None])


def _wan_like(causal_conv: type, attention: type) -> Callable[[nn.Module], DecoderLayers]:
    # causal 3D convolutions (their cached frames travel with the input), the resamplers' 2D convolutions,
    # RMS norms over channels only; attention per frame over H x W in the mid block
    def layers(vae: nn.Module) -> DecoderLayers:
        decoder = vae.decoder
        return DecoderLayers(modules_of(decoder, [causal_conv, nn.Conv2d]), [], whole=modules_of(decoder, [attention]))

    return layers


def _hunyuan_video(vae: AutoencoderKLHunyuanVideo) -> DecoderLayers:
    # replicate-padded causal convolutions; the mid block's attention is frame-causal over T x H x W and builds
    # its mask from the shapes it sees, so the whole mid block runs on every row
    decoder = vae.decoder
    return DecoderLayers(modules_of(decoder, [hunyuan_video.HunyuanVideoCausalConv3d]),
                         modules_of(decoder, [nn.GroupNorm]), whole=[decoder.mid_block])


def _ltx(vae: AutoencoderKLLTXVideo) -> DecoderLayers:
    # convolutions and per-channel norms only; upsampling is depth-to-space
    return DecoderLayers(modules_of(vae.decoder, [ltx.LTXVideoCausalConv3d]), [])


def _ltx_noise(vae: AutoencoderKLLTXVideo) -> str | None:
    if any(getattr(m, "inject_noise", False) for m in vae.decoder.modules()):
        return "its decoder injects spatial noise drawn per call, which a row split would draw differently"
    return None


RULES: dict[type, VaeRule] = {
    AutoencoderKL: VaeRule(_kl),
    AutoencoderKLWan: VaeRule(_wan_like(wan.WanCausalConv3d, wan.WanAttentionBlock)),
    AutoencoderKLQwenImage: VaeRule(_wan_like(qwenimage.QwenImageCausalConv3d, qwenimage.QwenImageAttentionBlock)),
    AutoencoderKLHunyuanVideo: VaeRule(_hunyuan_video),
    AutoencoderKLLTXVideo: VaeRule(_ltx, _ltx_noise),
}


def vae_rule_for(vae: nn.Module) -> VaeRule | None:
    return RULES.get(type(vae))


def supported_vaes() -> list[str]:
    return sorted(cls.__name__ for cls in RULES)
