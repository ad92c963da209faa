"""Writing a pipeline's output to a file, for the generation example and the service: an image as PNG/JPEG/WebP,
a video as GIF or MP4 at the model's frame rate (MP4 needs the `video` extra, which also muxes the sound of
audio-video models, LTX-2's); the service's PNGs are written for speed (`png`)."""
from __future__ import annotations

import importlib.util
import struct
import tempfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

IMAGE_SUFFIXES, VIDEO_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp"), (".gif", ".mp4")
_PNG_COLOR_TYPES = {"L": 0, "RGB": 2, "RGBA": 6}
_PNG_UP_FILTER = 2


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
        image = result.images[index]
        return png(image if isinstance(image, PIL.Image.Image) else PIL.Image.fromarray(image))
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "video.mp4"
        write_output(result, index, path, fps, pipe)
        return path.read_bytes()


def png(image: PIL.Image.Image) -> bytes:
    """`image` as a PNG written for speed, since encoding is part of every request's latency: each row less the
    row above it (PNG's Up filter), Huffman-coded without searching for repeats (zlib's Z_HUFFMAN_ONLY). That
    takes a fraction of the time of PIL's PNG at zlib's fastest level and is about as small for a photograph;
    flat drawings come out larger, noise the same."""
    if image.mode not in _PNG_COLOR_TYPES:
        image = image.convert("RGB")
    pixels = np.asarray(image).reshape(image.height, -1)
    rows = np.empty((image.height, 1 + pixels.shape[1]), dtype=np.uint8)
    rows[:, 0] = _PNG_UP_FILTER
    rows[0, 1:] = pixels[0]
    np.subtract(pixels[1:], pixels[:-1], out=rows[1:, 1:])  # modulo 256, as the filter is defined
    compressor = zlib.compressobj(1, zlib.DEFLATED, 15, 8, zlib.Z_HUFFMAN_ONLY)
    data = compressor.compress(rows.data) + compressor.flush()
    header = struct.pack(">IIBBBBB", image.width, image.height, 8, _PNG_COLOR_TYPES[image.mode], 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", data) + _png_chunk(b"IEND", b"")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))
