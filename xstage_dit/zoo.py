"""Pipelines with random weights built from model configs, for the example, the tests and the benchmarks.

No weights or tokenizers are downloaded: text encoders are left out and text embeddings are drawn at random
with the real shapes. "tiny-*" configs run in seconds on a CPU; the others are the released models' configs."""
from __future__ import annotations

import dataclasses
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLWan,
    DiffusionPipeline,
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
    UniPCMultistepScheduler,
    WanPipeline,
    WanTransformer3DModel,
)


@dataclass(frozen=True)
class ZooEntry:
    """How to build one pipeline and what its text inputs look like."""

    family: str  # "flux" or "wan"
    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_len: int
    text_dim: int
    pooled_dim: int = 0
    height: int = 1024
    width: int = 1024
    num_frames: int = 1
    scheduler: dict[str, Any] = field(default_factory=dict)
    boundary_ratio: float | None = None  # Wan 2.2: a second transformer denoises below this noise level

    @property
    def is_video(self) -> bool:
        return self.family == "wan"


_FLUX_SCHEDULER = {
    "base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
    "shift": 3.0, "use_dynamic_shifting": True,
}
_WAN_SCHEDULER = {"prediction_type": "flow_prediction", "use_flow_sigmas": True, "flow_shift": 3.0}
_WAN_VAE = {"base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
            "temperal_downsample": [False, True, True]}
_WAN_1_3B = {
    "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 128, "in_channels": 16,
    "out_channels": 16, "text_dim": 4096, "freq_dim": 256, "ffn_dim": 8960, "num_layers": 30,
    "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024,
}

ZOO: dict[str, ZooEntry] = {
    "tiny-flux": ZooEntry(
        family="flux",
        transformer={
            "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
            "num_attention_heads": 12, "joint_attention_dim": 32, "pooled_projection_dim": 32,
            "guidance_embeds": True, "axes_dims_rope": (4, 6, 6),
        },
        vae={
            "block_out_channels": (8, 16), "latent_channels": 4, "norm_num_groups": 4, "layers_per_block": 1,
            "down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2,
            "sample_size": 32, "scaling_factor": 1.5, "shift_factor": 0.06,
        },
        text_len=7, text_dim=32, pooled_dim=32, height=32, width=48, scheduler=_FLUX_SCHEDULER,
    ),
    "tiny-wan": ZooEntry(
        family="wan",
        transformer={
            "patch_size": (1, 2, 2), "num_attention_heads": 12, "attention_head_dim": 12, "in_channels": 16,
            "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 32,
        },
        vae={"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
             "temperal_downsample": [False, True, True]},
        text_len=9, text_dim=32, height=32, width=48, num_frames=9, scheduler=_WAN_SCHEDULER,
    ),
    "flux-dev": ZooEntry(
        family="flux",
        transformer={
            "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
            "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
            "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": (16, 56, 56),
        },
        vae={
            "block_out_channels": (128, 256, 512, 512), "latent_channels": 16, "layers_per_block": 2,
            "down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
            "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
            "use_quant_conv": False, "use_post_quant_conv": False,
        },
        text_len=512, text_dim=4096, pooled_dim=768, scheduler=_FLUX_SCHEDULER,
    ),
    "wan-1.3b": ZooEntry(
        family="wan", transformer=_WAN_1_3B, vae=_WAN_VAE, text_len=512, text_dim=4096,
        height=480, width=832, num_frames=81, scheduler=_WAN_SCHEDULER,
    ),
    "wan-14b": ZooEntry(
        family="wan", transformer={**_WAN_1_3B, "num_attention_heads": 40, "ffn_dim": 13824, "num_layers": 40},
        vae=_WAN_VAE, text_len=512, text_dim=4096, height=720, width=1280, num_frames=81,
        scheduler=_WAN_SCHEDULER,
    ),
}

ZOO["tiny-wan2.2"] = dataclasses.replace(ZOO["tiny-wan"], boundary_ratio=0.9)


def build_pipeline(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> DiffusionPipeline:
    """The pipeline of ZOO[name] with random weights (seeded, so every rank builds the same model), built
    straight on `device` in `dtype`: a 14B model never exists in float32 on the host."""
    entry = ZOO[name]
    torch.manual_seed(seed)
    with torch.device(device):
        transformer = _in_dtype(dtype, lambda: _TRANSFORMERS[entry.family](**entry.transformer))
        transformer_2 = None
        if entry.boundary_ratio is not None:
            transformer_2 = _in_dtype(dtype, lambda: _TRANSFORMERS[entry.family](**entry.transformer))
        # the Wan VAE stays in float32, as diffusers' Wan examples keep it
        vae_dtype = dtype if entry.family == "flux" else torch.float32
        vae = _in_dtype(vae_dtype, lambda: _VAES[entry.family](**entry.vae))
    for model in filter(None, (transformer, transformer_2)):
        _keep_fp32_modules(model)
    if entry.family == "flux":
        return FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(**entry.scheduler), vae=vae, transformer=transformer,
            text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        )
    return WanPipeline(
        tokenizer=None, text_encoder=None, vae=vae, transformer=transformer, transformer_2=transformer_2,
        scheduler=UniPCMultistepScheduler(**entry.scheduler), boundary_ratio=entry.boundary_ratio,
    )


def _keep_fp32_modules(model: torch.nn.Module) -> None:
    """Keep in float32 what diffusers' from_pretrained keeps there whatever the dtype asked for."""
    keep = set(model._keep_in_fp32_modules or [])
    for tensor_name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if keep & set(tensor_name.split(".")) and tensor.is_floating_point():
            tensor.data = tensor.data.float()


_TRANSFORMERS = {"flux": FluxTransformer2DModel, "wan": WanTransformer3DModel}
_VAES = {"flux": AutoencoderKL, "wan": AutoencoderKLWan}


def _in_dtype(dtype: torch.dtype, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build()
    finally:
        torch.set_default_dtype(previous)


def prompt_seed(prompt: str) -> int:
    """A stable seed from a prompt, so a tiny model without a text encoder still maps prompts to embeddings."""
    return zlib.crc32(prompt.encode())


def text_embeddings(name: str, batch: int, seed: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Random positive and negative text embeddings with the model's real shapes, as pipeline kwargs."""
    entry = ZOO[name]
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    kwargs = {
        "prompt_embeds": draw(batch, entry.text_len, entry.text_dim),
        "negative_prompt_embeds": draw(batch, entry.text_len, entry.text_dim),
    }
    if entry.pooled_dim:
        kwargs["pooled_prompt_embeds"] = draw(batch, entry.pooled_dim)
        kwargs["negative_pooled_prompt_embeds"] = draw(batch, entry.pooled_dim)
    return kwargs


def image_tokens(name: str, *, height: int, width: int, num_frames: int) -> int:
    """Image/video tokens the transformer sees for this output size."""
    entry = ZOO[name]
    if entry.family == "flux":
        pixels_per_token = 2 * 2 ** (len(entry.vae["block_out_channels"]) - 1)  # VAE downsampling, 2x2 packing
        return (height // pixels_per_token) * (width // pixels_per_token)
    spatial = 2 ** len(entry.vae["temperal_downsample"]) * entry.transformer["patch_size"][1]
    latent_frames = (num_frames - 1) // 2 ** sum(entry.vae["temperal_downsample"]) + 1
    return latent_frames * (height // spatial) * (width // spatial)


def call_kwargs(name: str, *, height: int, width: int, num_frames: int, steps: int, guidance: float
                ) -> dict[str, Any]:
    """Pipeline kwargs for size, steps and classifier-free guidance (Flux: true CFG; Wan: CFG)."""
    entry = ZOO[name]
    kwargs: dict[str, Any] = {"height": height, "width": width, "num_inference_steps": steps}
    if entry.family == "flux":
        kwargs["true_cfg_scale"] = guidance
    else:
        kwargs.update(num_frames=num_frames, guidance_scale=guidance)
    return kwargs


