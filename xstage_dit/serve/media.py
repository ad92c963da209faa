"""Writing a pipeline's output to a file, for the generation example and the service: an image as PNG/JPEG/WebP,
a video as GIF or MP4 at the model's frame rate (MP4 needs the `video` extra, which also muxes the sound of
audio-video models, LTX-2's); the service's PNGs are written for speed (`png`)."""
from __future__ import annotations

import functools
import importlib.util
import os
import struct
import tempfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image

IMAGE_SUFFIXES, VIDEO_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp"), (".gif", ".mp4")
_PNG_COLOR_TYPES = {"L": 0, "RGB": 2, "RGBA": 6}
_PNG_UP_FILTER = 2
_ZLIB_HEADER = b"\x78\x01"  # deflate with a 32 KiB window, fastest level: no dictionary
# threads that compress a PNG's strips: a few cores' worth, since the ranks' own threads share the machine
_ENCODER_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))


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
    row above it (PNG's Up filter), Huffman-coded without searching for repeats (zlib's Z_HUFFMAN_ONLY), in strips
    of rows compressed by a pool of threads (zlib lets go of the GIL). That takes a fraction of the time of PIL's
    PNG at zlib's fastest level and is about as small for a photograph; flat drawings come out larger, noise the
    same."""
    if image.mode not in _PNG_COLOR_TYPES:
        image = image.convert("RGB")
    pixels = np.asarray(image).reshape(image.height, -1)
    rows = np.empty((image.height, 1 + pixels.shape[1]), dtype=np.uint8)
    rows[:, 0] = _PNG_UP_FILTER
    rows[0, 1:] = pixels[0]
    np.subtract(pixels[1:], pixels[:-1], out=rows[1:, 1:])  # modulo 256, as the filter is defined
    header = struct.pack(">IIBBBBB", image.width, image.height, 8, _PNG_COLOR_TYPES[image.mode], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", header) + _png_chunk(b"IDAT", _zlib_stream(rows))
            + _png_chunk(b"IEND", b""))


def _zlib_stream(rows: np.ndarray) -> bytes:
    """A zlib stream of `rows`' bytes: one raw deflate stream per strip of rows, each but the last ended on a byte
    boundary without the final-block bit (Z_SYNC_FLUSH), so that their concatenation is one deflate stream; a
    Huffman-only strip refers to no earlier bytes, so the strips compress independently."""
    strips = [strip for strip in np.array_split(rows, min(len(rows), _ENCODER_THREADS)) if strip.size]
    last = len(strips) - 1

    def deflate(index: int) -> bytes:
        compressor = zlib.compressobj(1, zlib.DEFLATED, -15, 8, zlib.Z_HUFFMAN_ONLY)
        return compressor.compress(strips[index].data) + compressor.flush(
            zlib.Z_FINISH if index == last else zlib.Z_SYNC_FLUSH)

    body = b"".join(_encoders().map(deflate, range(len(strips))))
    return _ZLIB_HEADER + body + struct.pack(">I", zlib.adler32(rows.data))


@functools.cache
def _encoders() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(_ENCODER_THREADS, thread_name_prefix="xstage-png")


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))
