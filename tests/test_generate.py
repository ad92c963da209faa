"""examples/generate.py as a user runs it (one process; the distributed path is the pipeline tests'): input
images, output formats, and a wrong output refused before anything is generated."""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import PIL.Image
import pytest

import generate
import zoo

GENERATE = Path(__file__).parent.parent / "examples" / "generate.py"


def _generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATE), *args], capture_output=True, text=True, timeout=300)


def test_an_input_image_reaches_the_pipeline_and_the_image_is_written(tmp_path: Path) -> None:
    given = tmp_path / "in.png"
    zoo.random_image(40, 56, seed=3).save(given)
    out = tmp_path / "out.png"
    run = _generate("--config", "tiny-flux-kontext", "--image", str(given), "--height", "24", "--width", "32",
                    "--output", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    assert PIL.Image.open(out).size == (32, 24)
    assert "wrote" in run.stdout


@pytest.mark.parametrize("output, message", [("out.png", "a video is written as"), ("missing/out.gif", "no directory")])
def test_a_wrong_output_is_refused(tmp_path: Path, output: str, message: str) -> None:
    """main() checks the output first, before loading anything."""
    args = argparse.Namespace(output=tmp_path / output)
    with pytest.raises(SystemExit, match=message):
        generate.output_path(args, is_video=True)


VIDEO_EXTRA = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("imageio_ffmpeg", "av")),
                                 reason="the video extra is not installed")


@VIDEO_EXTRA
def test_a_video_is_written_as_mp4(tmp_path: Path) -> None:
    out = tmp_path / "out.mp4"
    run = _generate("--config", "tiny-wan", "--output", str(out))
    assert run.returncode == 0 and out.stat().st_size > 0, run.stderr[-2000:]


@VIDEO_EXTRA
def test_an_audio_video_model_writes_its_sound_into_the_mp4(tmp_path: Path) -> None:
    import av

    out = tmp_path / "out.mp4"
    run = _generate("--config", "tiny-ltx2", "--output", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    with av.open(str(out)) as container:
        assert [stream.type for stream in container.streams] == ["video", "audio"]
