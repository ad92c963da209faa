"""Pipelines with random weights built from model configs, for the example, the tests and the benchmarks.

No weights or tokenizers are downloaded: text encoders are left out and text embeddings (and prompt masks) are
drawn at random with the real shapes. "tiny-*" configs run in well under a second per call on a CPU; the
others are the released models' configs. The examples, the tests and the benchmarks import it
(`from xstage_dit.testing import zoo`), and the service builds its default model from it."""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import diffusers
import PIL.Image
import torch


@dataclass(frozen=True)
class Family:
    """What one diffusers model family's pipeline is made of and how it takes text and guidance."""

    pipeline: str
    transformer: str
    vae: str
    scheduler: str
    text_inputs: Callable[["ZooEntry", int, Callable[..., torch.Tensor]], dict[str, torch.Tensor]]
    guidance_kwarg: str = "guidance_scale"  # the kwarg that turns classifier-free guidance on
    video: bool = False
    vae_float32: bool = False  # diffusers' examples keep this family's VAE in float32
    fps: int = 16  # frames per second of the family's videos, as diffusers' examples write them
    components: Callable[[], dict[str, Any]] | None = None  # pipeline components besides models (a guider)
    controlnet: str | None = None  # the family's ControlNet model class
    multi_controlnet: str | None = None  # the model that holds several ControlNets (or one Union ControlNet)


@dataclass(frozen=True)
class ZooEntry:
    """One buildable pipeline: configs, text shapes, default output size."""

    family: str
    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_len: int
    text_dim: int
    pooled_dim: int = 0
    text_padding: int = 0  # masked (padded) prompt tokens, for families that take a prompt mask
    extra_text: dict[str, Any] = field(default_factory=dict)  # family-specific text shapes
    height: int = 1024
    width: int = 1024
    num_frames: int = 1
    scheduler: dict[str, Any] = field(default_factory=dict)
    boundary_ratio: float | None = None  # Wan 2.2: a second transformer denoises below this noise level
    pipeline_attributes: dict[str, Any] = field(default_factory=dict)
    pipeline: str | None = None  # another pipeline class of the family (image-to-X); default: the family's
    # such a pipeline's image kwargs: (h, w), or None for the size of the output asked for (image-to-image)
    images: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    call_extra: dict[str, Any] = field(default_factory=dict)  # further call kwargs that pipeline needs
    pipeline_config: dict[str, Any] = field(default_factory=dict)  # constructor arguments (Wan 2.2 TI2V's)
    image_encoder: dict[str, Any] | None = None  # a CLIP vision encoder's config (Wan 2.1 image-to-video)
    # further model components, name -> (class, its config): LTX-2's text connectors, audio VAE and vocoder
    modules: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    # ControlNet configs: one is the pipeline's `controlnet`; in a multi-ControlNet model where `multi_controlnet`
    controlnets: tuple[dict[str, Any], ...] = ()
    multi_controlnet: bool = False

    @property
    def is_video(self) -> bool:
        return FAMILIES[self.family].video


def _prompt_mask(entry: ZooEntry, batch: int, padding: int) -> torch.Tensor:
    mask = torch.ones(batch, entry.text_len, dtype=torch.long)
    if padding:
        mask[:, -padding:] = 0
    return mask


def _embeds_and_pooled(entry: ZooEntry, batch: int, draw) -> dict[str, torch.Tensor]:
    out = {}
    for prefix in ("", "negative_"):
        out[f"{prefix}prompt_embeds"] = draw(batch, entry.text_len, entry.text_dim)
        if entry.pooled_dim:
            out[f"{prefix}pooled_prompt_embeds"] = draw(batch, entry.pooled_dim)
    return out


def _masked(mask_name: str, negative_mask_name: str):
    def text_inputs(entry: ZooEntry, batch: int, draw) -> dict[str, torch.Tensor]:
        out = _embeds_and_pooled(entry, batch, draw)
        out[mask_name] = _prompt_mask(entry, batch, entry.text_padding)
        out[negative_mask_name] = _prompt_mask(entry, batch, entry.text_padding // 2)
        return out

    return text_inputs


def _hidream_text(entry: ZooEntry, batch: int, draw) -> dict[str, torch.Tensor]:
    llama_states, llama_len, llama_dim = entry.extra_text["llama"]
    out = {}
    for prefix in ("", "negative_"):
        out[f"{prefix}prompt_embeds_t5"] = draw(batch, entry.text_len, entry.text_dim)
        out[f"{prefix}prompt_embeds_llama3"] = draw(llama_states, batch, llama_len, llama_dim)
        out[f"{prefix}pooled_prompt_embeds"] = draw(batch, entry.pooled_dim)
    return out


def _float_masked(entry: ZooEntry, batch: int, draw) -> dict[str, torch.Tensor]:
    """Chroma: embeddings and 0/1 prompt masks in the embeddings' dtype (its blocks add them to the logits)."""
    out = _embeds_and_pooled(entry, batch, draw)
    for prefix, padding in (("", entry.text_padding), ("negative_", entry.text_padding // 2)):
        out[f"{prefix}prompt_attention_mask"] = _prompt_mask(entry, batch, padding).to(out["prompt_embeds"].dtype)
    return out


def _hunyuan_video15_text(entry: ZooEntry, batch: int, draw) -> dict[str, torch.Tensor]:
    """Its two text encoders' states and padding masks (Qwen2.5-VL's, then ByT5's), positive and negative."""
    byt5_len, byt5_dim = entry.extra_text["byt5"]
    out = {}
    for prefix, padding in (("", entry.text_padding), ("negative_", entry.text_padding // 2)):
        out[f"{prefix}prompt_embeds"] = draw(batch, entry.text_len, entry.text_dim)
        out[f"{prefix}prompt_embeds_mask"] = _prompt_mask(entry, batch, padding)
        out[f"{prefix}prompt_embeds_2"] = draw(batch, byt5_len, byt5_dim)
        out[f"{prefix}prompt_embeds_mask_2"] = _prompt_mask(dataclasses.replace(entry, text_len=byt5_len), batch,
                                                            padding // 2)
    return out


class _PromptTemplateCounts:
    """Stands in for Qwen-Image 2.1's Qwen3-VL processor (whose tokenizer files are not downloaded): with prompt
    embeddings given, its pipeline asks the processor only, when built, for the system prompt's token count and
    the image-pad token's id, which no call here uses."""

    class tokenizer:  # noqa: N801 (the processor's attribute name)
        @staticmethod
        def encode(text: str) -> list[int]:
            return [0]

    @staticmethod
    def apply_chat_template(messages: list, tokenize: bool = True, return_dict: bool = False) -> list[list[int]]:
        return [[0]]


def _qwen3_vl_processor() -> dict[str, Any]:
    return {"processor": _PromptTemplateCounts()}


def _guider() -> dict[str, Any]:
    """HunyuanVideo 1.5 guides through a guider component: classifier-free guidance at its pipelines' scale."""
    return {"guider": diffusers.ClassifierFreeGuidance(guidance_scale=6.0)}


def _caption_lists(entry: ZooEntry, batch: int, draw) -> dict[str, list[torch.Tensor]]:
    """Z-Image takes one caption tensor per prompt, as long as its prompt (its pipeline drops the padding):
    every other prompt here is `text_padding` tokens shorter, and each negative one `text_padding` tokens shorter
    still (the branches' longest captions differ)."""
    out = {}
    for prefix, shorter in (("", 0), ("negative_", entry.text_padding)):
        out[f"{prefix}prompt_embeds"] = [draw(entry.text_len - shorter - (i % 2) * entry.text_padding,
                                              entry.text_dim) for i in range(batch)]
    return out


FAMILIES: dict[str, Family] = {
    "flux": Family("FluxPipeline", "FluxTransformer2DModel", "AutoencoderKL", "FlowMatchEulerDiscreteScheduler",
                   _embeds_and_pooled, guidance_kwarg="true_cfg_scale", controlnet="FluxControlNetModel",
                   multi_controlnet="FluxMultiControlNetModel"),
    "wan": Family("WanPipeline", "WanTransformer3DModel", "AutoencoderKLWan", "UniPCMultistepScheduler",
                  _embeds_and_pooled, video=True, vae_float32=True),
    "hunyuan-video": Family(
        "HunyuanVideoPipeline", "HunyuanVideoTransformer3DModel", "AutoencoderKLHunyuanVideo",
        "FlowMatchEulerDiscreteScheduler", _masked("prompt_attention_mask", "negative_prompt_attention_mask"),
        guidance_kwarg="true_cfg_scale", video=True, fps=15),
    "qwenimage": Family(
        "QwenImagePipeline", "QwenImageTransformer2DModel", "AutoencoderKLQwenImage",
        "FlowMatchEulerDiscreteScheduler", _masked("prompt_embeds_mask", "negative_prompt_embeds_mask"),
        guidance_kwarg="true_cfg_scale", controlnet="QwenImageControlNetModel",
        multi_controlnet="QwenImageMultiControlNetModel"),
    "ltx": Family(
        "LTXPipeline", "LTXVideoTransformer3DModel", "AutoencoderKLLTXVideo", "FlowMatchEulerDiscreteScheduler",
        _masked("prompt_attention_mask", "negative_prompt_attention_mask"), video=True, fps=24),
    "sd3": Family("StableDiffusion3Pipeline", "SD3Transformer2DModel", "AutoencoderKL",
                  "FlowMatchEulerDiscreteScheduler", _embeds_and_pooled),
    "cogvideox": Family("CogVideoXPipeline", "CogVideoXTransformer3DModel", "AutoencoderKLCogVideoX",
                        "CogVideoXDDIMScheduler", _embeds_and_pooled, video=True, fps=8),
    "hidream": Family("HiDreamImagePipeline", "HiDreamImageTransformer2DModel", "AutoencoderKL",
                      "FlowMatchEulerDiscreteScheduler", _hidream_text),
    "wan-vace": Family("WanVACEPipeline", "WanVACETransformer3DModel", "AutoencoderKLWan", "UniPCMultistepScheduler",
                       _embeds_and_pooled, video=True, vae_float32=True),
    "ltx2": Family("LTX2Pipeline", "LTX2VideoTransformer3DModel", "AutoencoderKLLTX2Video",
                   "FlowMatchEulerDiscreteScheduler",
                   _masked("prompt_attention_mask", "negative_prompt_attention_mask"), video=True, fps=24),
    "flux2": Family("Flux2Pipeline", "Flux2Transformer2DModel", "AutoencoderKLFlux2", "FlowMatchEulerDiscreteScheduler",
                    _embeds_and_pooled),
    "hunyuan-video15": Family(
        "HunyuanVideo15Pipeline", "HunyuanVideo15Transformer3DModel", "AutoencoderKLHunyuanVideo15",
        "FlowMatchEulerDiscreteScheduler", _hunyuan_video15_text, video=True, fps=24, components=_guider),
    "qwenimage21": Family(
        "QwenImage21Pipeline", "QwenImage21Transformer2DModel", "AutoencoderKLQwenImage21",
        "FlowMatchEulerDiscreteScheduler", _masked("prompt_embeds_mask", "negative_prompt_embeds_mask"),
        guidance_kwarg="true_cfg_scale", components=_qwen3_vl_processor),
    "chroma": Family("ChromaPipeline", "ChromaTransformer2DModel", "AutoencoderKL", "FlowMatchEulerDiscreteScheduler",
                     _float_masked),
    "zimage": Family("ZImagePipeline", "ZImageTransformer2DModel", "AutoencoderKL", "FlowMatchEulerDiscreteScheduler",
                     _caption_lists, controlnet="ZImageControlNetModel"),
    "nucleusmoe": Family(
        "NucleusMoEImagePipeline", "NucleusMoEImageTransformer2DModel", "AutoencoderKLQwenImage",
        "FlowMatchEulerDiscreteScheduler", _masked("prompt_embeds_mask", "negative_prompt_embeds_mask")),
}

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
_TINY_KL_VAE = {
    "block_out_channels": (8, 16), "latent_channels": 4, "norm_num_groups": 4, "layers_per_block": 1,
    "down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2,
    "sample_size": 32, "scaling_factor": 1.5, "shift_factor": 0.06,
}
_FLUX_VAE = {
    "block_out_channels": (128, 256, 512, 512), "latent_channels": 16, "layers_per_block": 2,
    "down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
    "sample_size": 1024, "scaling_factor": 0.3611, "shift_factor": 0.1159,
    "use_quant_conv": False, "use_post_quant_conv": False,
}
_TINY_WAN22_VAE = {  # Wan 2.2's VAE layout: residual blocks, patch size 2, 16x spatial
    "base_dim": 4, "decoder_base_dim": 6, "z_dim": 8, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 1,
    "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
    "patch_size": 2, "scale_factor_spatial": 16}
_TINY_HEADS = 12  # divides by 2, 3 and 4

ZOO: dict[str, ZooEntry] = {
    "tiny-flux": ZooEntry(
        family="flux",
        transformer={
            "patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
            "num_attention_heads": _TINY_HEADS, "joint_attention_dim": 32, "pooled_projection_dim": 32,
            "guidance_embeds": True, "axes_dims_rope": (4, 6, 6),
        },
        vae=_TINY_KL_VAE, text_len=8, text_dim=32, pooled_dim=32, height=32, width=48, scheduler=_FLUX_SCHEDULER,
    ),
    "tiny-wan": ZooEntry(
        family="wan",
        transformer={
            "patch_size": (1, 2, 2), "num_attention_heads": _TINY_HEADS, "attention_head_dim": 12,
            "in_channels": 16, "out_channels": 16, "text_dim": 32, "freq_dim": 32, "ffn_dim": 64, "num_layers": 2,
            "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 32,
        },
        vae={"base_dim": 3, "z_dim": 16, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1,
             "temperal_downsample": [False, True, True]},
        text_len=9, text_dim=32, height=32, width=48, num_frames=9, scheduler=_WAN_SCHEDULER,
    ),
    "tiny-hunyuan-video": ZooEntry(
        family="hunyuan-video",
        transformer={
            "in_channels": 4, "out_channels": 4, "num_attention_heads": _TINY_HEADS, "attention_head_dim": 16,
            "num_layers": 1, "num_single_layers": 1, "num_refiner_layers": 1, "mlp_ratio": 2.0, "patch_size": 2,
            "patch_size_t": 1, "qk_norm": "rms_norm", "guidance_embeds": True, "text_embed_dim": 32,
            "pooled_projection_dim": 24, "rope_theta": 256.0, "rope_axes_dim": (4, 6, 6),
        },
        vae={"in_channels": 3, "out_channels": 3, "latent_channels": 4,
             "down_block_types": ("HunyuanVideoDownBlock3D",) * 4, "up_block_types": ("HunyuanVideoUpBlock3D",) * 4,
             "block_out_channels": (8, 8, 8, 8), "layers_per_block": 1, "norm_num_groups": 4,
             "scaling_factor": 0.476986, "spatial_compression_ratio": 8, "temporal_compression_ratio": 4,
             "mid_block_add_attention": True},
        text_len=11, text_dim=32, pooled_dim=24, text_padding=4, height=32, width=48, num_frames=9,
        scheduler={"shift": 7.0},
    ),
    "tiny-qwenimage": ZooEntry(
        family="qwenimage",
        transformer={"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 2,
                     "attention_head_dim": 16, "num_attention_heads": _TINY_HEADS, "joint_attention_dim": 32,
                     "guidance_embeds": False, "axes_dims_rope": (4, 6, 6)},
        vae={"base_dim": 24, "z_dim": 4, "dim_mult": [1, 2, 4], "num_res_blocks": 1,
             "temperal_downsample": [False, True], "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4},
        text_len=11, text_dim=32, text_padding=4, height=32, width=48,
        scheduler={"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 8192, "max_shift": 0.9,
                   "shift": 1.0, "use_dynamic_shifting": True, "time_shift_type": "exponential"},
    ),
    # 12 video heads, 4 audio heads; the VAE downsamples 8x in space and 2x in time; prompt states are every
    # text-encoder layer's (2 + 1) of width 32, stacked, as LTX-2's text connectors take them
    "tiny-ltx2": ZooEntry(
        family="ltx2",
        transformer={"in_channels": 4, "out_channels": 4, "patch_size": 1, "patch_size_t": 1,
                     "num_attention_heads": _TINY_HEADS, "attention_head_dim": 8, "cross_attention_dim": 96,
                     "audio_in_channels": 4, "audio_out_channels": 4, "audio_num_attention_heads": 4,
                     "audio_attention_head_dim": 8, "audio_cross_attention_dim": 32, "num_layers": 2,
                     "caption_channels": 32},
        vae={"in_channels": 3, "out_channels": 3, "latent_channels": 4, "block_out_channels": (8, 8, 8),
             "decoder_block_out_channels": (8, 8, 8), "layers_per_block": (1, 1, 1, 1),
             "decoder_layers_per_block": (1, 1, 1, 1), "spatio_temporal_scaling": (True, True, True),
             "decoder_spatio_temporal_scaling": (True, True, True), "decoder_inject_noise": (False,) * 4,
             "downsample_type": ("spatial", "spatial", "spatiotemporal"),
             "upsample_type": ("spatiotemporal", "spatial", "spatial"), "upsample_residual": (False,) * 3,
             "upsample_factor": (1,) * 3, "patch_size": 1, "patch_size_t": 1, "decoder_causal": False,
             "spatial_compression_ratio": 8, "temporal_compression_ratio": 2},
        modules={
            "connectors": ("pipelines.ltx2.LTX2TextConnectors", {
                "caption_channels": 32, "text_proj_in_factor": 3, "video_connector_num_attention_heads": 4,
                "video_connector_attention_head_dim": 8, "video_connector_num_layers": 1,
                "video_connector_num_learnable_registers": None, "audio_connector_num_attention_heads": 4,
                "audio_connector_attention_head_dim": 8, "audio_connector_num_layers": 1,
                "audio_connector_num_learnable_registers": None, "connector_rope_base_seq_len": 32}),
            "audio_vae": ("AutoencoderKLLTX2Audio", {
                "base_channels": 4, "output_channels": 2, "ch_mult": (1,), "num_res_blocks": 1, "resolution": 32,
                "latent_channels": 2, "mel_bins": 8}),
            "vocoder": ("pipelines.ltx2.vocoder.LTX2Vocoder", {
                "in_channels": 16, "hidden_channels": 32, "upsample_kernel_sizes": [4, 4], "upsample_factors": [2, 2],
                "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]], "output_sampling_rate": 16000}),
        },
        text_len=9, text_dim=96, text_padding=4, height=32, width=64, num_frames=9,
    ),
    # its VAE downsamples 16x and the transformer takes the latents unpatched: a token per 16 x 16 pixels
    "tiny-qwenimage21": ZooEntry(
        family="qwenimage21",
        transformer={"in_channels": 8, "out_channels": 8, "num_layers": 2, "attention_head_dim": 16,
                     "num_attention_heads": _TINY_HEADS, "context_in_dim": 24, "axes_dims_rope": (4, 6, 6)},
        vae={"base_dim": 8, "decoder_base_dim": 8, "z_dim": 8, "dim_mult": [1, 1, 1, 1, 1], "num_res_blocks": 1,
             "in_channels": 3, "out_channels": 3, "latents_mean": [0.0] * 8, "latents_std": [1.0] * 8},
        text_len=9, text_dim=24, text_padding=4, height=64, width=96,
    ),
    "tiny-flux2": ZooEntry(
        family="flux2",
        transformer={"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
                     "attention_head_dim": 16, "num_attention_heads": _TINY_HEADS, "joint_attention_dim": 32,
                     "timestep_guidance_channels": 32, "axes_dims_rope": (4, 4, 4, 4), "guidance_embeds": True},
        vae={"block_out_channels": (8, 16), "latent_channels": 4, "norm_num_groups": 4, "layers_per_block": 1,
             "down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2,
             "sample_size": 32},
        text_len=8, text_dim=32, height=24, width=32, scheduler=_FLUX_SCHEDULER,
    ),
    # layers 1 and 2 are MoE; 8 experts each take half the tokens (capacity 4) or a quarter (2); 4 key/value heads
    "tiny-nucleusmoe": ZooEntry(
        family="nucleusmoe",
        transformer={"patch_size": 2, "in_channels": 16, "out_channels": 4, "num_layers": 3,
                     "attention_head_dim": 16, "num_attention_heads": _TINY_HEADS, "num_key_value_heads": 4,
                     "joint_attention_dim": 32, "axes_dims_rope": (4, 6, 6),
                     "dense_moe_strategy": "leave_first_block_dense",
                     "num_experts": 8, "moe_intermediate_dim": 32, "capacity_factors": [4.0, 4.0, 2.0]},
        vae={"base_dim": 24, "z_dim": 4, "dim_mult": [1, 2, 4], "num_res_blocks": 1,
             "temperal_downsample": [False, True], "latents_mean": [0.0] * 4, "latents_std": [1.0] * 4},
        text_len=11, text_dim=32, text_padding=4, height=32, width=40,
        scheduler={"base_image_seq_len": 256, "base_shift": 0.5, "max_image_seq_len": 4096, "max_shift": 1.15,
                   "shift": 1.0, "use_dynamic_shifting": True},
    ),
    "tiny-chroma": ZooEntry(
        family="chroma",
        transformer={"patch_size": 1, "in_channels": 16, "num_layers": 1, "num_single_layers": 1,
                     "attention_head_dim": 16, "num_attention_heads": _TINY_HEADS, "joint_attention_dim": 32,
                     "axes_dims_rope": (4, 6, 6), "approximator_num_channels": 16, "approximator_hidden_dim": 32,
                     "approximator_layers": 1},
        vae=_TINY_KL_VAE, text_len=11, text_dim=32, text_padding=4, height=32, width=48, scheduler=_FLUX_SCHEDULER,
    ),
    # text-to-video: 2 x 4 + 1 input channels (noise, conditioning latents, their mask)
    "tiny-hunyuan-video15": ZooEntry(
        family="hunyuan-video15",
        transformer={"in_channels": 9, "out_channels": 4, "num_attention_heads": _TINY_HEADS, "attention_head_dim": 16,
                     "num_layers": 2, "num_refiner_layers": 1, "text_embed_dim": 32, "text_embed_2_dim": 24,
                     "image_embed_dim": 16, "rope_axes_dim": (4, 6, 6), "task_type": "t2v"},
        vae={"latent_channels": 4, "block_out_channels": (8, 8, 8, 8, 8), "layers_per_block": 1},
        text_len=11, text_dim=32, text_padding=4, extra_text={"byt5": (5, 24)}, height=32, width=48, num_frames=9,
        scheduler={"shift": 7.0},
        pipeline_attributes={"vision_num_semantic_tokens": 9},  # the image-conditioning slots (729 released)
    ),
    # 64 + 32 caption tokens, or 32 + 32 (the model pads each part to a multiple of 32 tokens)
    "tiny-zimage": ZooEntry(
        family="zimage",
        transformer={"all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 4, "dim": 16 * _TINY_HEADS,
                     "n_layers": 2, "n_refiner_layers": 1, "n_heads": _TINY_HEADS, "n_kv_heads": _TINY_HEADS,
                     "cap_feat_dim": 32, "axes_dims": [4, 6, 6]},
        vae=_TINY_KL_VAE, text_len=40, text_dim=32, text_padding=12, height=32, width=48,
        scheduler={"shift": 3.0},
    ),
    "tiny-ltx": ZooEntry(
        family="ltx",
        transformer={"in_channels": 8, "out_channels": 8, "patch_size": 1, "patch_size_t": 1,
                     "num_attention_heads": _TINY_HEADS, "attention_head_dim": 8, "cross_attention_dim": 96,
                     "num_layers": 2, "caption_channels": 32},
        vae={"in_channels": 3, "out_channels": 3, "latent_channels": 8, "block_out_channels": (8, 8, 8, 8),
             "decoder_block_out_channels": (8, 8, 8, 8), "layers_per_block": (1, 1, 1, 1, 1),
             "decoder_layers_per_block": (1, 1, 1, 1, 1),
             "spatio_temporal_scaling": (True, True, False, False),
             "decoder_spatio_temporal_scaling": (True, True, False, False),
             "decoder_inject_noise": (False,) * 5, "upsample_residual": (False,) * 4, "upsample_factor": (1, 1, 1, 1),
             "timestep_conditioning": False, "patch_size": 1, "patch_size_t": 1, "encoder_causal": True,
             "decoder_causal": False},
        text_len=16, text_dim=32, text_padding=6, height=32, width=64, num_frames=9,
    ),
    "tiny-sd3.5": ZooEntry(
        family="sd3",
        transformer={"sample_size": 32, "patch_size": 2, "in_channels": 4, "num_layers": 2, "attention_head_dim": 8,
                     "num_attention_heads": _TINY_HEADS, "joint_attention_dim": 32, "caption_projection_dim": 96,
                     "pooled_projection_dim": 64, "out_channels": 4, "pos_embed_max_size": 32,
                     "dual_attention_layers": (0,), "qk_norm": "rms_norm"},
        vae={**_TINY_KL_VAE, "block_out_channels": (8, 8), "norm_num_groups": 8},
        text_len=7, text_dim=32, pooled_dim=64, height=48, width=64,
    ),
    "tiny-cogvideox": ZooEntry(
        family="cogvideox",
        transformer={"num_attention_heads": _TINY_HEADS, "attention_head_dim": 16, "in_channels": 4,
                     "out_channels": 4, "time_embed_dim": 32, "text_embed_dim": 32, "num_layers": 2,
                     "sample_width": 8, "sample_height": 8, "sample_frames": 9, "patch_size": 2,
                     "temporal_compression_ratio": 4, "max_text_seq_length": 7,
                     "use_rotary_positional_embeddings": True},
        vae={"in_channels": 3, "out_channels": 3, "down_block_types": ("CogVideoXDownBlock3D",) * 4,
             "up_block_types": ("CogVideoXUpBlock3D",) * 4, "block_out_channels": (8, 8, 8, 8),
             "latent_channels": 4, "layers_per_block": 1, "norm_num_groups": 2, "temporal_compression_ratio": 4},
        text_len=7, text_dim=32, height=96, width=64, num_frames=9,
    ),
    "tiny-hidream": ZooEntry(
        family="hidream",
        transformer={"patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 1, "num_single_layers": 1,
                     "attention_head_dim": 16, "num_attention_heads": _TINY_HEADS, "caption_channels": [32, 16],
                     "text_emb_dim": 24, "num_routed_experts": 4, "num_activated_experts": 2,
                     "axes_dims_rope": (8, 4, 4), "max_resolution": (16, 16), "llama_layers": [0, 1]},
        vae={**_TINY_KL_VAE, "block_out_channels": (8, 8), "norm_num_groups": 8},
        text_len=5, text_dim=32, pooled_dim=24, extra_text={"llama": (3, 6, 16)}, height=32, width=32,
        pipeline_attributes={"default_sample_size": 16},
    ),
    "flux-dev": ZooEntry(
        family="flux",
        transformer={
            "patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
            "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
            "pooled_projection_dim": 768, "guidance_embeds": True, "axes_dims_rope": (16, 56, 56),
        },
        vae=_FLUX_VAE, text_len=512, text_dim=4096, pooled_dim=768, scheduler=_FLUX_SCHEDULER,
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
    "hunyuan-video": ZooEntry(
        family="hunyuan-video",
        transformer={
            "in_channels": 16, "out_channels": 16, "num_attention_heads": 24, "attention_head_dim": 128,
            "num_layers": 20, "num_single_layers": 40, "num_refiner_layers": 2, "mlp_ratio": 4.0, "patch_size": 2,
            "patch_size_t": 1, "qk_norm": "rms_norm", "guidance_embeds": True, "text_embed_dim": 4096,
            "pooled_projection_dim": 768, "rope_theta": 256.0, "rope_axes_dim": (16, 56, 56),
        },
        vae={"latent_channels": 16, "scaling_factor": 0.476986},
        text_len=256, text_dim=4096, pooled_dim=768, text_padding=200, height=720, width=1280, num_frames=129,
        scheduler={"shift": 7.0},
    ),
    "hidream": ZooEntry(
        family="hidream",
        transformer={
            "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 16, "num_single_layers": 32,
            "attention_head_dim": 128, "num_attention_heads": 20, "caption_channels": [4096, 4096],
            "text_emb_dim": 2048, "num_routed_experts": 4, "num_activated_experts": 2,
            "axes_dims_rope": (64, 32, 32), "max_resolution": (128, 128),
            "llama_layers": list(range(32)) + [31] * 16,
        },
        vae=_FLUX_VAE, text_len=128, text_dim=4096, pooled_dim=2048, extra_text={"llama": (32, 128, 4096)},
        scheduler={"shift": 3.0},
    ),
}
# released models' transformer configs, transcribed from their repositories' config.json
ZOO.update({
    "sd3.5-medium": ZooEntry(
        family="sd3",
        transformer={"sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24,
                     "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
                     "caption_projection_dim": 1536, "pooled_projection_dim": 2048, "out_channels": 16,
                     "pos_embed_max_size": 384, "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm"},
        vae={**_FLUX_VAE, "scaling_factor": 1.5305, "shift_factor": 0.0609},
        text_len=77 + 256, text_dim=4096, pooled_dim=2048,
    ),
    "qwenimage": ZooEntry(
        family="qwenimage",
        transformer={"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 60,
                     "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 3584,
                     "guidance_embeds": False, "axes_dims_rope": (16, 56, 56)},
        vae={}, text_len=256, text_dim=3584, text_padding=128,
        scheduler=ZOO["tiny-qwenimage"].scheduler,
    ),
    # FLUX.2 [dev]: the transformer's defaults are the released config (8 double, 48 single blocks, 48 heads)
    "flux2-dev": ZooEntry(
        family="flux2",
        transformer={"patch_size": 1, "in_channels": 128, "num_layers": 8, "num_single_layers": 48,
                     "attention_head_dim": 128, "num_attention_heads": 48, "joint_attention_dim": 15360,
                     "timestep_guidance_channels": 256, "mlp_ratio": 3.0, "axes_dims_rope": (32, 32, 32, 32),
                     "rope_theta": 2000, "guidance_embeds": True},
        vae={}, text_len=512, text_dim=15360, scheduler=_FLUX_SCHEDULER,
    ),
    # 17B parameters, 64 routed experts of which each takes 4 or 2 x S / 64 tokens, blocks 0-2 dense
    "nucleusmoe-image": ZooEntry(
        family="nucleusmoe",
        transformer={"patch_size": 2, "in_channels": 64, "out_channels": 16, "num_layers": 32,
                     "attention_head_dim": 128, "num_attention_heads": 16, "num_key_value_heads": 4,
                     "joint_attention_dim": 4096, "axes_dims_rope": (16, 56, 56), "mlp_ratio": 4.0,
                     "dense_moe_strategy": "leave_first_three_blocks_dense", "num_experts": 64,
                     "moe_intermediate_dim": 1344, "capacity_factors": [0.0] * 3 + [4.0] * 2 + [2.0] * 27,
                     "route_scale": 2.5, "use_grouped_mm": True},
        vae={}, text_len=256, text_dim=4096, text_padding=128,
        scheduler=ZOO["tiny-nucleusmoe"].scheduler,
    ),
    # Chroma1-HD: FLUX.1's 19 + 38 blocks with a 5-layer approximator for the modulation
    "chroma": ZooEntry(
        family="chroma",
        transformer={"patch_size": 1, "in_channels": 64, "num_layers": 19, "num_single_layers": 38,
                     "attention_head_dim": 128, "num_attention_heads": 24, "joint_attention_dim": 4096,
                     "axes_dims_rope": (16, 56, 56), "approximator_num_channels": 64,
                     "approximator_hidden_dim": 5120, "approximator_layers": 5},
        vae=_FLUX_VAE, text_len=512, text_dim=4096, text_padding=256, scheduler=_FLUX_SCHEDULER,
    ),
    # HunyuanVideo 1.5 text-to-video (8.3B): the transformer's defaults are the released config, 54 blocks
    "hunyuan-video15": ZooEntry(
        family="hunyuan-video15",
        transformer={"task_type": "t2v"}, vae={}, text_len=1000, text_dim=3584, text_padding=500,
        extra_text={"byt5": (256, 1472)}, height=720, width=1280, num_frames=121, scheduler={"shift": 7.0},
    ),
    # Z-Image (Turbo and base share it): 30 layers and 2 refiner layers of each kind, 30 heads of 128
    "zimage": ZooEntry(
        family="zimage",
        transformer={"all_patch_size": (2,), "all_f_patch_size": (1,), "in_channels": 16, "dim": 3840,
                     "n_layers": 30, "n_refiner_layers": 2, "n_heads": 30, "n_kv_heads": 30, "norm_eps": 1e-5,
                     "qk_norm": True, "cap_feat_dim": 2560, "rope_theta": 256.0, "t_scale": 1000.0,
                     "axes_dims": [32, 48, 48]},
        vae=_FLUX_VAE, text_len=512, text_dim=2560, text_padding=256, scheduler={"shift": 3.0},
    ),
    "ltx-video": ZooEntry(
        family="ltx",
        transformer={"in_channels": 128, "out_channels": 128, "patch_size": 1, "patch_size_t": 1,
                     "num_attention_heads": 32, "attention_head_dim": 64, "cross_attention_dim": 2048,
                     "num_layers": 28, "caption_channels": 4096},
        vae={}, text_len=128, text_dim=4096, text_padding=64, height=512, width=704, num_frames=161,
    ),
    # Qwen-Image 2.1 (diffusers' default configs: 32 blocks of 32 heads, a 64-channel 16x VAE); prompt states of
    # Qwen3-VL, width 4096
    "qwenimage21": ZooEntry(family="qwenimage21", transformer={}, vae={}, text_len=512, text_dim=4096,
                            text_padding=256, height=1024, width=1024),
    # the released LTX-2 (diffusers' default configs); prompt states: Gemma 3's 48 + 1 layers of width 3840
    "ltx2": ZooEntry(
        family="ltx2", transformer={}, vae={},
        modules={"connectors": ("pipelines.ltx2.LTX2TextConnectors", {}), "audio_vae": ("AutoencoderKLLTX2Audio", {}),
                 "vocoder": ("pipelines.ltx2.vocoder.LTX2Vocoder", {})},
        text_len=1024, text_dim=3840 * 49, text_padding=512, height=512, width=768, num_frames=121,
    ),
    "cogvideox-5b": ZooEntry(
        family="cogvideox",
        transformer={"num_attention_heads": 48, "attention_head_dim": 64, "in_channels": 16, "out_channels": 16,
                     "time_embed_dim": 512, "text_embed_dim": 4096, "num_layers": 42, "sample_width": 90,
                     "sample_height": 60, "sample_frames": 49, "patch_size": 2, "temporal_compression_ratio": 4,
                     "max_text_seq_length": 226, "use_rotary_positional_embeddings": True},
        vae={}, text_len=226, text_dim=4096, height=480, width=720, num_frames=49,
    ),
})
ZOO["tiny-wan2.2"] = dataclasses.replace(ZOO["tiny-wan"], boundary_ratio=0.9)
# pipelines that take images, on supported families: the reference image's tokens travel with the image tokens
# (Kontext: appended to the sequence, 10 x 14 more tokens here) or its latents with the noise's channels (Fill:
# 16 noise + 16 masked-image + 16 mask channels, packed; Control: 16 + 16; Wan 2.2 A14B image-to-video: 16 noise +
# 4 mask + 16 image channels)
ZOO["tiny-flux-kontext"] = dataclasses.replace(ZOO["tiny-flux"], pipeline="FluxKontextPipeline",
                                               images={"image": (40, 56)}, call_extra={"_auto_resize": False})
ZOO["tiny-flux-fill"] = dataclasses.replace(
    ZOO["tiny-flux"], pipeline="FluxFillPipeline", images={"image": (40, 56), "mask_image": (40, 56)},
    transformer={**ZOO["tiny-flux"].transformer, "in_channels": 48, "out_channels": 16})
ZOO["tiny-flux-control"] = dataclasses.replace(
    ZOO["tiny-flux"], pipeline="FluxControlPipeline", images={"control_image": (40, 56)},
    transformer={**ZOO["tiny-flux"].transformer, "in_channels": 32, "out_channels": 16})
# Qwen-Image Edit resizes its input image to about 1024 x 1024 whatever the output size: a VAE that downsamples 16x
# keeps that at about 1000 tokens
_TINY_QWEN_EDIT_VAE = {**ZOO["tiny-qwenimage"].vae, "base_dim": 8, "dim_mult": [1, 1, 1, 1, 1],
                       "temperal_downsample": [False, True, True, True]}
ZOO["tiny-qwenimage-edit"] = dataclasses.replace(ZOO["tiny-qwenimage"], pipeline="QwenImageEditPipeline",
                                                 images={"image": (40, 56)}, vae=_TINY_QWEN_EDIT_VAE,
                                                 height=64, width=96)
ZOO["tiny-qwenimage-edit-plus"] = dataclasses.replace(ZOO["tiny-qwenimage-edit"],
                                                      pipeline="QwenImageEditPlusPipeline")
# Edit-2511: the input image's tokens modulated as at timestep 0 (zero_cond_t, a per-token modulation index)
ZOO["tiny-qwenimage-edit-2511"] = dataclasses.replace(
    ZOO["tiny-qwenimage-edit-plus"], transformer={**ZOO["tiny-qwenimage"].transformer, "zero_cond_t": True})
# the released Edit-2511 (Qwen-Image's transformer with zero_cond_t), editing a 1024 x 1024 image
ZOO["qwenimage-edit-2511"] = dataclasses.replace(
    ZOO["qwenimage"], pipeline="QwenImageEditPlusPipeline", images={"image": (1024, 1024)},
    transformer={**ZOO["qwenimage"].transformer, "zero_cond_t": True})
# per-token timesteps: LTX image-to-video and Condition (the conditioning frame's tokens less noisy); Wan 2.2
# TI2V-5B (its own VAE: 16x spatial, 8 latent channels here; the timestep expanded to every token)
ZOO["tiny-ltx-i2v"] = dataclasses.replace(ZOO["tiny-ltx"], pipeline="LTXImageToVideoPipeline",
                                          images={"image": (40, 56)})
ZOO["tiny-ltx-condition"] = dataclasses.replace(ZOO["tiny-ltx-i2v"], pipeline="LTXConditionPipeline")
# image_crf=0: no H.264 re-compression of the condition image (that needs PyAV)
ZOO["tiny-ltx2-i2v"] = dataclasses.replace(ZOO["tiny-ltx2"], pipeline="LTX2ImageToVideoPipeline",
                                           images={"image": (40, 56)}, call_extra={"image_crf": 0})
# Wan 2.2 TI2V-5B: 30 blocks of 24 heads, 48 latent channels from its 16x VAE (latent statistics not transcribed:
# zeros and ones), 720p at 121 frames, 24 fps
ZOO["wan2.2-ti2v-5b"] = dataclasses.replace(
    ZOO["wan-1.3b"], transformer={**_WAN_1_3B, "num_attention_heads": 24, "ffn_dim": 14336, "in_channels": 48,
                                  "out_channels": 48},
    vae={**_TINY_WAN22_VAE, "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "num_res_blocks": 2,
         "latents_mean": [0.0] * 48, "latents_std": [1.0] * 48},
    pipeline_config={"expand_timesteps": True}, height=704, width=1280, num_frames=121)
ZOO["tiny-wan2.2-ti2v"] = dataclasses.replace(
    ZOO["tiny-wan"], transformer={**ZOO["tiny-wan"].transformer, "in_channels": 8, "out_channels": 8},
    vae=_TINY_WAN22_VAE, pipeline_config={"expand_timesteps": True}, height=64, width=64)
# Wan 2.1 image-to-video: the image's CLIP features are extra cross-attention keys (17 tokens here)
ZOO["tiny-wan2.1-i2v"] = dataclasses.replace(
    ZOO["tiny-wan"], pipeline="WanImageToVideoPipeline", images={"image": (40, 56)},
    transformer={**ZOO["tiny-wan"].transformer, "in_channels": 36, "image_dim": 32, "added_kv_proj_dim": 144},
    image_encoder={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37,
                   "image_size": 32, "patch_size": 8})
ZOO["tiny-wan2.2-i2v"] = dataclasses.replace(
    ZOO["tiny-wan2.2"], pipeline="WanImageToVideoPipeline", images={"image": (40, 56)},
    transformer={**ZOO["tiny-wan2.2"].transformer, "in_channels": 36})
# head_dim 64: the smallest the fused backend's kernels take (its GPU tests use these)
ZOO["tiny-flux-d64"] = dataclasses.replace(
    ZOO["tiny-flux"], transformer={**ZOO["tiny-flux"].transformer, "attention_head_dim": 64, "axes_dims_rope": (16, 24, 24)})
# the released config asks for grouped expert matmuls; diffusers' default loops over the experts with a host sync
ZOO["nucleusmoe-image-loop"] = dataclasses.replace(ZOO["nucleusmoe-image"], transformer={
    **ZOO["nucleusmoe-image"].transformer, "use_grouped_mm": False})
# FLUX.2 [klein]: no guidance embedding, true CFG in pairs of calls unless the pipeline is configured distilled
ZOO["tiny-flux2-klein"] = dataclasses.replace(ZOO["tiny-flux2"], pipeline="Flux2KleinPipeline", transformer={
    **ZOO["tiny-flux2"].transformer, "guidance_embeds": False})
# FLUX.2 with a reference image: its latents' tokens are appended to the image tokens
ZOO["tiny-flux2-edit"] = dataclasses.replace(ZOO["tiny-flux2"], images={"image": (64, 80)})
# FLUX.2 [klein] with the reference image's KV cache: its 16 x 16 tokens lead the image tokens in the first step,
# which caches their keys and values for the others
ZOO["tiny-flux2-klein-kv"] = dataclasses.replace(ZOO["tiny-flux2-klein"], pipeline="Flux2KleinKVPipeline",
                                                 images={"image": (64, 64)})
# Wan VACE without a control video (its text-to-video use): control blocks before main blocks 0 and 1
ZOO["tiny-wan-vace"] = dataclasses.replace(ZOO["tiny-wan"], family="wan-vace", transformer={
    **ZOO["tiny-wan"].transformer, "vace_layers": [0, 1], "vace_in_channels": 96})
# Wan 2.1 VACE 14B: the 14B transformer with a control block before every fifth block
ZOO["wan-vace-14b"] = dataclasses.replace(ZOO["wan-14b"], family="wan-vace", transformer={
    **ZOO["wan-14b"].transformer, "vace_layers": list(range(0, 40, 5)), "vace_in_channels": 96})
ZOO["tiny-nucleusmoe-d64"] = dataclasses.replace(ZOO["tiny-nucleusmoe"], transformer={
    **ZOO["tiny-nucleusmoe"].transformer, "attention_head_dim": 64, "axes_dims_rope": (16, 24, 24)})
ZOO["tiny-zimage-img2img"] = dataclasses.replace(ZOO["tiny-zimage"], pipeline="ZImageImg2ImgPipeline",
                                                 images={"image": None})
ZOO["tiny-zimage-inpaint"] = dataclasses.replace(ZOO["tiny-zimage"], pipeline="ZImageInpaintPipeline",
                                                 images={"image": None, "mask_image": None})
ZOO["tiny-chroma-img2img"] = dataclasses.replace(ZOO["tiny-chroma"], pipeline="ChromaImg2ImgPipeline",
                                                 images={"image": None})
ZOO["tiny-zimage-d64"] = dataclasses.replace(ZOO["tiny-zimage"], transformer={
    **ZOO["tiny-zimage"].transformer, "dim": 64 * _TINY_HEADS, "axes_dims": [16, 24, 24]})
# FLUX.1 ControlNets (InstantX's kind: the control image's latents embedded, residuals after every block): one;
# several in a multi-ControlNet model (a plain one and a Union one, whose mode token leads the prompt)
_TINY_FLUX_CONTROLNET = {**ZOO["tiny-flux"].transformer, "num_layers": 1, "num_single_layers": 1}
ZOO["tiny-flux-controlnet"] = dataclasses.replace(
    ZOO["tiny-flux"], pipeline="FluxControlNetPipeline", controlnets=(_TINY_FLUX_CONTROLNET,),
    images={"control_image": None}, call_extra={"controlnet_conditioning_scale": 0.7})
ZOO["tiny-flux-multi-controlnet"] = dataclasses.replace(
    ZOO["tiny-flux-controlnet"], controlnets=(_TINY_FLUX_CONTROLNET, {**_TINY_FLUX_CONTROLNET, "num_mode": 4}),
    multi_controlnet=True, images={},
    call_extra={"controlnet_conditioning_scale": [0.6, 0.4], "control_mode": [None, 2]})
ZOO["tiny-flux-multi-controlnet-d64"] = dataclasses.replace(
    ZOO["tiny-flux-multi-controlnet"], transformer=ZOO["tiny-flux-d64"].transformer,
    controlnets=tuple({**config, **ZOO["tiny-flux-d64"].transformer, "num_layers": 1, "num_single_layers": 1}
                      for config in ZOO["tiny-flux-multi-controlnet"].controlnets))
# a Qwen-Image ControlNet (one block, residuals added after both of the transformer's)
ZOO["tiny-qwenimage-controlnet"] = dataclasses.replace(
    ZOO["tiny-qwenimage"], pipeline="QwenImageControlNetPipeline", images={"control_image": None},
    controlnets=({key: value for key, value in ZOO["tiny-qwenimage"].transformer.items() if key != "guidance_embeds"}
                 | {"num_layers": 1},), call_extra={"controlnet_conditioning_scale": 0.7})
# Z-Image ControlNets: the Union one (control blocks before both layers, a control refiner of plain blocks),
# and the inpainting one of version 2.1 (control image, mask and masked image latents: 9 channels; control blocks
# beside the noise refiner too)
_TINY_ZIMAGE_CONTROLNET = {
    **{key: ZOO["tiny-zimage"].transformer[key] for key in ("all_patch_size", "all_f_patch_size", "dim",
                                                            "n_refiner_layers", "n_heads", "n_kv_heads")},
    "control_layers_places": [0, 1], "control_in_dim": 4}
ZOO["tiny-zimage-controlnet"] = dataclasses.replace(
    ZOO["tiny-zimage"], pipeline="ZImageControlNetPipeline", controlnets=(_TINY_ZIMAGE_CONTROLNET,),
    images={"control_image": None}, call_extra={"controlnet_conditioning_scale": 0.7})
ZOO["tiny-zimage-controlnet-inpaint"] = dataclasses.replace(
    ZOO["tiny-zimage-controlnet"], pipeline="ZImageControlNetInpaintPipeline",
    controlnets=({**_TINY_ZIMAGE_CONTROLNET, "control_in_dim": 9, "add_control_noise_refiner": "control_noise_refiner",
                  "control_refiner_layers_places": [0]},),
    images={"control_image": None, "image": None, "mask_image": None})
ZOO["tiny-wan-d64"] = dataclasses.replace(ZOO["tiny-wan"], transformer={**ZOO["tiny-wan"].transformer, "attention_head_dim": 64})


def build_pipeline(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                   seed: int = 0) -> diffusers.DiffusionPipeline:
    """The pipeline of ZOO[name] with random weights (seeded, so every rank builds the same model), built
    straight on `device` in `dtype`: a 14B model never exists in float32 on the host."""
    entry = ZOO[name]
    family = FAMILIES[entry.family]
    transformer_cls = getattr(diffusers, family.transformer)
    torch.manual_seed(seed)
    with torch.device(device):
        transformers = [_in_dtype(dtype, lambda: transformer_cls(**entry.transformer))]
        if entry.boundary_ratio is not None:
            transformers.append(_in_dtype(dtype, lambda: transformer_cls(**entry.transformer)))
        vae = _in_dtype(torch.float32 if family.vae_float32 else dtype,
                        lambda: getattr(diffusers, family.vae)(**entry.vae))
    for model in (*transformers, vae):
        model.eval()  # HiDream's MoE takes another path in training mode
    for model in transformers:
        draw_packed_experts(model)
        _keep_fp32_modules(model)
    components = {"transformer": transformers[0], "vae": vae,
                  "scheduler": getattr(diffusers, family.scheduler)(**entry.scheduler),
                  **(family.components() if family.components is not None else {})}
    if entry.image_encoder is not None:
        components.update(_clip_image_encoder(entry.image_encoder, device, dtype))
    if entry.controlnets:
        components["controlnet"] = _controlnet(entry, family, device, dtype)
    with torch.device(device):
        for component, (cls, config) in entry.modules.items():
            components[component] = _in_dtype(dtype, lambda: _diffusers_class(cls)(**config)).eval()
    pipeline_cls = getattr(diffusers, entry.pipeline or family.pipeline)
    for component in _absent_components(pipeline_cls, components):
        components[component] = None
    if entry.boundary_ratio is not None:
        components.update(transformer_2=transformers[1], boundary_ratio=entry.boundary_ratio)
    pipe = pipeline_cls(**components, **entry.pipeline_config)
    for attribute, value in entry.pipeline_attributes.items():
        setattr(pipe, attribute, value)
    return pipe


def _controlnet(entry: ZooEntry, family: Family, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """The entry's ControlNet(s), random: the layers diffusers starts at zero (the residuals' projections, the
    control image's embedding) are drawn too, so that the control changes the output."""
    nets = []
    with torch.device(device):
        for config in entry.controlnets:
            net = _in_dtype(dtype, lambda: getattr(diffusers, family.controlnet)(**config)).eval()
            for module in net.modules():
                if isinstance(module, torch.nn.Linear) and not module.weight.any():
                    module.reset_parameters()
            nets.append(net)
    if entry.multi_controlnet:
        return getattr(diffusers, family.multi_controlnet)(nets)
    (net,) = nets
    return net


IP_ADAPTER_EMBED_DIM = 24


def random_ip_adapter(model: torch.nn.Module, seed: int = 5) -> list[dict[str, dict[str, torch.Tensor]]]:
    """A FLUX.1 IP-Adapter's state dicts as diffusers' loader takes them (`model._load_ip_adapter_weights`), drawn
    at random: 4 image-prompt tokens from an image embedding of width IP_ADAPTER_EMBED_DIM (the CLIP image features
    a pipeline takes as `ip_adapter_image_embeds`, (batch, 1, width))."""
    generator = torch.Generator().manual_seed(seed)
    width, tokens = model.config.joint_attention_dim, 4

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * shape[-1] ** -0.5

    adapter = {}
    for index in range(len(model.transformer_blocks)):
        for name in ("to_k_ip", "to_v_ip"):
            adapter[f"{index}.{name}.weight"] = draw(model.inner_dim, width)
            adapter[f"{index}.{name}.bias"] = draw(model.inner_dim)
    projection = {"proj.weight": draw(width * tokens, IP_ADAPTER_EMBED_DIM), "proj.bias": draw(width * tokens),
                  "norm.weight": torch.ones(width), "norm.bias": torch.zeros(width)}
    return [{"image_proj": projection, "ip_adapter": adapter}]


def _diffusers_class(name: str) -> type:
    """A diffusers class by name: exported at the top, or a pipeline's own module (dotted from diffusers)."""
    module, _, attribute = name.rpartition(".")
    return getattr(importlib.import_module(f"diffusers.{module}") if module else diffusers, attribute)


def _clip_image_encoder(config: dict[str, Any], device: torch.device | str, dtype: torch.dtype) -> dict[str, Any]:
    """A random CLIP vision encoder and its image processor, as image-to-video pipelines take them."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    with torch.device(device):
        encoder = _in_dtype(dtype, lambda: CLIPVisionModel(CLIPVisionConfig(**config)))
    side = config["image_size"]
    return {"image_encoder": encoder.eval(), "image_processor": CLIPImageProcessor(
        size={"shortest_edge": side}, crop_size={"height": side, "width": side})}


def _absent_components(pipeline_cls: type, given: dict[str, Any]) -> list[str]:
    """The pipeline's text and image encoders, tokenizers and processors (left out: embeddings are passed in)."""
    return [name for name in inspect.signature(pipeline_cls.__init__).parameters
            if name.startswith(("text_encoder", "tokenizer", "image_encoder", "image_processor",
                                "feature_extractor", "processor"))
            and name not in given]


def _in_dtype(dtype: torch.dtype, build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return build()
    finally:
        torch.set_default_dtype(previous)


def draw_packed_experts(model: torch.nn.Module) -> None:
    """Draw the packed expert weights (E, in, out) that diffusers allocates and leaves to a checkpoint (NucleusMoE),
    as a Linear layer's of that width would be."""
    for module in model.modules():
        for name in ("gate_up_proj", "down_proj"):
            weight = getattr(module, name, None)
            if isinstance(weight, torch.nn.Parameter) and weight.dim() == 3:
                with torch.no_grad():
                    weight.uniform_(-weight.shape[1] ** -0.5, weight.shape[1] ** -0.5)


def _keep_fp32_modules(model: torch.nn.Module) -> None:
    """Keep in float32 what diffusers' from_pretrained keeps there whatever the dtype asked for."""
    keep = set(model._keep_in_fp32_modules or [])
    for tensor_name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if keep & set(tensor_name.split(".")) and tensor.is_floating_point():
            tensor.data = tensor.data.float()


def prompt_seed(prompt: str) -> int:
    """A stable seed from a prompt, so a model without a text encoder still maps prompts to embeddings."""
    return zlib.crc32(prompt.encode())


def text_embeddings(name: str, batch: int, seed: int, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Random positive and negative text inputs with the model's real shapes, as pipeline kwargs."""
    entry = ZOO[name]
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    inputs = FAMILIES[entry.family].text_inputs(entry, batch, draw)
    # prompt masks are made on the host; Z-Image's captions are lists of drawn tensors
    return {k: v if isinstance(v, list) else v.to(device)
            for k, v in inputs.items() if _takes(entry, k)}  # no negatives without CFG


def call_kwargs(name: str, *, height: int, width: int, num_frames: int, steps: int, guidance: float
                ) -> dict[str, Any]:
    """Pipeline kwargs for size, steps and classifier-free guidance (> 1 turns it on), and the entry's input
    images (random, seeded) where its pipeline takes some."""
    entry = ZOO[name]
    family = FAMILIES[entry.family]
    kwargs: dict[str, Any] = {"height": height, "width": width, "num_inference_steps": steps, **entry.call_extra}
    if _takes(entry, family.guidance_kwarg):  # guidance-distilled pipelines (Flux Fill, Control) have no CFG
        kwargs[family.guidance_kwarg] = guidance
    if family.video:
        kwargs["num_frames"] = num_frames
    for seed, (kwarg, size) in enumerate(entry.images.items()):
        kwargs[kwarg] = random_image(*(size or (height, width)), seed)
    if entry.multi_controlnet:  # a control image per condition, as many as the conditioning scales
        kwargs["control_image"] = [random_image(height, width, seed)
                                   for seed in range(len(entry.call_extra["controlnet_conditioning_scale"]))]
    if _takes(entry, "max_area"):
        kwargs["max_area"] = height * width  # a pipeline that fits its output to an area: the size asked for
    return kwargs


def _takes(entry: ZooEntry, kwarg: str) -> bool:
    """Whether the entry's pipeline takes `kwarg`."""
    pipeline = entry.pipeline or FAMILIES[entry.family].pipeline
    return kwarg in inspect.signature(getattr(diffusers, pipeline).__call__).parameters


def random_image(height: int, width: int, seed: int = 0) -> PIL.Image.Image:
    """An RGB image of uniform noise, the same on every rank."""
    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed),
                           dtype=torch.uint8)
    return PIL.Image.fromarray(pixels.numpy())


@dataclass(frozen=True)
class VaeEntry:
    """A VAE alone, for the decode tests and benchmark: its class, config and a latent (B, C, [T,] H, W) to
    decode; `float32` where diffusers' pipelines keep it in float32."""

    cls: str
    config: dict[str, Any]
    latent: tuple[int, ...]
    float32: bool = False


_TINY_HUNYUAN_VAE = {
    "latent_channels": 4, "block_out_channels": (8, 8, 16, 16), "layers_per_block": 1, "norm_num_groups": 4,
    "down_block_types": ("HunyuanVideoDownBlock3D",) * 4, "up_block_types": ("HunyuanVideoUpBlock3D",) * 4,
}
_TINY_LTX_VAE = {
    "latent_channels": 8, "block_out_channels": (8, 8, 8, 8), "decoder_block_out_channels": (8, 8, 16, 16),
    "layers_per_block": (1, 1, 1, 1, 1), "decoder_layers_per_block": (1, 1, 1, 1, 1),
    "spatio_temporal_scaling": (True, True, True, False), "decoder_spatio_temporal_scaling": (True, True, True, False),
    "decoder_inject_noise": (False,) * 5, "timestep_conditioning": False, "patch_size": 4, "patch_size_t": 1,
}
# latent heights of 7 rows split unevenly over 2, 3 and 4 ranks
VAES: dict[str, VaeEntry] = {
    "tiny-kl": VaeEntry("AutoencoderKL", {**_TINY_KL_VAE, "block_out_channels": (8, 16, 16), "sample_size": 64,
                                          "down_block_types": ("DownEncoderBlock2D",) * 3,
                                          "up_block_types": ("UpDecoderBlock2D",) * 3}, (2, 4, 7, 5)),
    "tiny-wan2.1": VaeEntry("AutoencoderKLWan", {"base_dim": 4, "z_dim": 4, "dim_mult": [1, 2, 4, 4],
                                                 "num_res_blocks": 1, "temperal_downsample": [False, True, True]},
                            (2, 4, 3, 7, 5), float32=True),
    "tiny-wan2.2": VaeEntry("AutoencoderKLWan", _TINY_WAN22_VAE, (2, 8, 3, 7, 5), float32=True),
    "tiny-qwenimage": VaeEntry("AutoencoderKLQwenImage", {"base_dim": 4, "z_dim": 4, "dim_mult": [1, 2, 4, 4],
                                                          "num_res_blocks": 1,
                                                          "temperal_downsample": [False, True, True]},
                               (2, 4, 1, 7, 5)),  # images: one latent frame
    # 6 latent frames: more than HunyuanVideo's framewise decode takes at once, so its temporal tiles run too
    "tiny-hunyuan-video": VaeEntry("AutoencoderKLHunyuanVideo", _TINY_HUNYUAN_VAE, (2, 4, 6, 7, 5)),
    "tiny-ltx": VaeEntry("AutoencoderKLLTXVideo", _TINY_LTX_VAE, (2, 8, 3, 7, 5)),
    "flux": VaeEntry("AutoencoderKL", _FLUX_VAE, (1, 16, 256, 256)),  # 2048 x 2048
    "wan2.1-720p": VaeEntry("AutoencoderKLWan", _WAN_VAE, (1, 16, 21, 90, 160), float32=True),  # 81 x 720 x 1280
}


def build_vae(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              seed: int = 0) -> torch.nn.Module:
    """VAES[name] with random weights (seeded: every rank builds the same), in `dtype` unless diffusers keeps it
    in float32. Weights are drawn around diffusers' initialisation so that every layer changes its input."""
    entry = VAES[name]
    torch.manual_seed(seed)
    with torch.device(device):
        vae = _in_dtype(torch.float32 if entry.float32 else dtype,
                        lambda: getattr(diffusers, entry.cls)(**entry.config))
    with torch.no_grad():
        for parameter in vae.parameters():
            parameter.add_(torch.randn_like(parameter), alpha=0.05)
    return vae.eval()


def vae_latent(name: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
               seed: int = 1) -> torch.Tensor:
    generator = torch.Generator(device).manual_seed(seed)
    return torch.randn(VAES[name].latent, generator=generator, device=device, dtype=dtype)
