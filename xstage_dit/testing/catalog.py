"""The zoo's configs (zoo.py) as the command lines check their arguments against them, known without building a
pipeline or importing torch and diffusers (seconds): each config's diffusers pipeline class, whether it makes
videos, what its widths and heights are multiples of, and whether its calls take an input image. tests/test_cli.py
checks every line against the zoo itself, and prints the line of a config missing here."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Listing:
    """What one zoo config's pipeline is and takes."""

    pipeline: str  # its diffusers class
    video: bool
    size_multiple: int  # its widths and heights are multiples of it (serve/loading.py's size_multiple of it built)
    image: str  # whether its calls take an input image: serve/loading.py's image_input of its class


CONFIGS: dict[str, Listing] = {
    "tiny-flux": Listing("FluxPipeline", False, 4, "none"),
    "tiny-wan": Listing("WanPipeline", True, 16, "none"),
    "tiny-hunyuan-video": Listing("HunyuanVideoPipeline", True, 16, "none"),
    "tiny-qwenimage": Listing("QwenImagePipeline", False, 8, "none"),
    "tiny-ltx2": Listing("LTX2Pipeline", True, 16, "none"),
    "tiny-qwenimage21": Listing("QwenImage21Pipeline", False, 32, "optional"),
    "tiny-flux2": Listing("Flux2Pipeline", False, 4, "optional"),
    "tiny-nucleusmoe": Listing("NucleusMoEImagePipeline", False, 8, "none"),
    "tiny-chroma": Listing("ChromaPipeline", False, 4, "none"),
    "tiny-hunyuan-video15": Listing("HunyuanVideo15Pipeline", True, 32, "none"),
    "tiny-zimage": Listing("ZImagePipeline", False, 4, "none"),
    "tiny-ltx": Listing("LTXPipeline", True, 16, "none"),
    "tiny-sd3.5": Listing("StableDiffusion3Pipeline", False, 4, "none"),
    "tiny-cogvideox": Listing("CogVideoXPipeline", True, 16, "none"),
    "tiny-hidream": Listing("HiDreamImagePipeline", False, 4, "none"),
    "flux-dev": Listing("FluxPipeline", False, 16, "none"),
    "wan-1.3b": Listing("WanPipeline", True, 16, "none"),
    "wan-14b": Listing("WanPipeline", True, 16, "none"),
    "hunyuan-video": Listing("HunyuanVideoPipeline", True, 16, "none"),
    "hidream": Listing("HiDreamImagePipeline", False, 16, "none"),
    "sd3.5-medium": Listing("StableDiffusion3Pipeline", False, 16, "none"),
    "qwenimage": Listing("QwenImagePipeline", False, 16, "none"),
    "flux2-dev": Listing("Flux2Pipeline", False, 16, "optional"),
    "nucleusmoe-image": Listing("NucleusMoEImagePipeline", False, 16, "none"),
    "chroma": Listing("ChromaPipeline", False, 16, "none"),
    "hunyuan-video15": Listing("HunyuanVideo15Pipeline", True, 32, "none"),
    "zimage": Listing("ZImagePipeline", False, 16, "none"),
    "ltx-video": Listing("LTXPipeline", True, 16, "none"),
    "qwenimage21": Listing("QwenImage21Pipeline", False, 32, "optional"),
    "ltx2": Listing("LTX2Pipeline", True, 16, "none"),
    "cogvideox-5b": Listing("CogVideoXPipeline", True, 16, "none"),
    "tiny-wan2.2": Listing("WanPipeline", True, 16, "none"),
    "tiny-flux-kontext": Listing("FluxKontextPipeline", False, 4, "optional"),
    "tiny-flux-fill": Listing("FluxFillPipeline", False, 4, "required"),
    "tiny-flux-control": Listing("FluxControlPipeline", False, 4, "none"),
    "tiny-qwenimage-edit": Listing("QwenImageEditPipeline", False, 32, "required"),
    "tiny-qwenimage-edit-plus": Listing("QwenImageEditPlusPipeline", False, 32, "required"),
    "tiny-qwenimage-edit-2511": Listing("QwenImageEditPlusPipeline", False, 32, "required"),
    "qwenimage-edit-2511": Listing("QwenImageEditPlusPipeline", False, 16, "required"),
    "tiny-ltx-i2v": Listing("LTXImageToVideoPipeline", True, 16, "required"),
    "tiny-ltx-condition": Listing("LTXConditionPipeline", True, 16, "optional"),
    "tiny-ltx2-i2v": Listing("LTX2ImageToVideoPipeline", True, 16, "required"),
    "wan2.2-ti2v-5b": Listing("WanPipeline", True, 32, "none"),
    "tiny-wan2.2-ti2v": Listing("WanPipeline", True, 32, "none"),
    "tiny-wan2.1-i2v": Listing("WanImageToVideoPipeline", True, 16, "required"),
    "tiny-wan2.2-i2v": Listing("WanImageToVideoPipeline", True, 16, "required"),
    "tiny-flux-d64": Listing("FluxPipeline", False, 4, "none"),
    "nucleusmoe-image-loop": Listing("NucleusMoEImagePipeline", False, 16, "none"),
    "tiny-flux2-klein": Listing("Flux2KleinPipeline", False, 4, "optional"),
    "tiny-flux2-edit": Listing("Flux2Pipeline", False, 4, "optional"),
    "tiny-flux2-klein-kv": Listing("Flux2KleinKVPipeline", False, 4, "optional"),
    "tiny-wan-vace": Listing("WanVACEPipeline", True, 16, "none"),
    "wan-vace-14b": Listing("WanVACEPipeline", True, 16, "none"),
    "tiny-nucleusmoe-d64": Listing("NucleusMoEImagePipeline", False, 8, "none"),
    "tiny-zimage-img2img": Listing("ZImageImg2ImgPipeline", False, 4, "required"),
    "tiny-zimage-inpaint": Listing("ZImageInpaintPipeline", False, 4, "required"),
    "tiny-chroma-img2img": Listing("ChromaImg2ImgPipeline", False, 4, "required"),
    "tiny-zimage-d64": Listing("ZImagePipeline", False, 4, "none"),
    "tiny-flux-controlnet": Listing("FluxControlNetPipeline", False, 4, "none"),
    "tiny-flux-multi-controlnet": Listing("FluxControlNetPipeline", False, 4, "none"),
    "tiny-flux-multi-controlnet-d64": Listing("FluxControlNetPipeline", False, 4, "none"),
    "tiny-qwenimage-controlnet": Listing("QwenImageControlNetPipeline", False, 8, "none"),
    "tiny-zimage-controlnet": Listing("ZImageControlNetPipeline", False, 4, "none"),
    "tiny-zimage-controlnet-inpaint": Listing("ZImageControlNetInpaintPipeline", False, 4, "required"),
    "tiny-wan-d64": Listing("WanPipeline", True, 16, "none"),
}
