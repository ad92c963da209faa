"""Writing a pipeline's output to a file, for the generation example and the service: an image as PNG/JPEG/WebP,
a video as GIF or MP4 at the model's frame rate (MP4 needs the `video` extra, which also muxes the sound of
audio-video models, LTX-2's)."""
from __future__ import annotations

import importlib.util
import io
import tempfile
from pathlib import Path
from typing import Any

import PIL.Image

IMAGE_SUFFIXES, VIDEO_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp"), (".gif", ".mp4")


def can_write_mp4() -> bool:
    return all(importlib.util.find_spec(m) for m in ("imageio_ffmpeg", "av"))


def write_output(result: Any, index: int, output: Path, fps: int, pipe: Any) -> None:
    """Item `index` of a pipeline call's batch to `output` (its suffix picks the format)."""
    from diffusers.utils import export_to_gif, export_to_video
    from diffusers.utils.export_utils import encode_video

    audio = getattr(result, "audio", None)  # an audio-video pipeline's waveforms (LTX-2's vocoder output)
    suffix = output.suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        result.images[index].save(output)
    elif suffix == ".mp4" and audio is not None:
        encode_video(result.frames[index], fps, str(output), audio=audio[index].float().cpu(),
                     audio_sample_rate=pipe.vocoder.config.output_sampling_rate)
    elif suffix == ".mp4":
        export_to_video(result.frames[index], str(output), fps=fps)
    else:
        export_to_gif(result.frames[index], str(output), fps=fps)


def encoded(result: Any, index: int, fps: int, pipe: Any) -> bytes:
    """Item `index` as the bytes of a PNG (an image) or an MP4 (a video)."""
    if getattr(result, "images", None) is not None:
        buffer = io.BytesIO()
        image = result.images[index]
        # zlib's fastest level: encoding is part of every request's latency
        (image if isinstance(image, PIL.Image.Image) else PIL.Image.fromarray(image)).save(
            buffer, format="PNG", compress_level=1)
        return buffer.getvalue()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "video.mp4"
        write_output(result, index, path, fps, pipe)
        return path.read_bytes()
