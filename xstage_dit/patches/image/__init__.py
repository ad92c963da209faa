"""The image families' patches (FLUX.1, FLUX.2, Chroma, HiDream, Qwen-Image, Qwen-Image 2.1, SD3, Z-Image,
NucleusMoE-Image)."""
