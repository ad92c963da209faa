"""examples/generate.py as a user runs it (one process; the distributed path is the pipeline tests'): input
images, output formats, and a wrong output refused before anything is generated."""
from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import PIL.Image
import pytest
from transformers.utils import logging as transformers_logging

import generate
from xstage_dit.testing import zoo
from xstage_dit.serve import loading, media

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
    assert "torchvision" not in run.stderr  # transformers' note on its image processors says nothing to a user


@pytest.mark.parametrize("output, message", [("out.png", "a video is written as"), ("missing/out.gif", "no directory")])
def test_a_wrong_output_is_refused(tmp_path: Path, capsys, output: str, message: str) -> None:
    """main() checks the output first, before loading anything."""
    args = argparse.Namespace(output=tmp_path / output, num_frames=None)
    with pytest.raises(SystemExit) as exit:
        generate.output_path(args, is_video=True)
    assert exit.value.code == 2 and message in capsys.readouterr().err


VIDEO_EXTRA = pytest.mark.skipif(not media.can_write_mp4(), reason="the video extra is not installed")


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


@pytest.fixture
def rank(monkeypatch):
    """Pretend to be one rank of a two-rank job (nothing here starts a process group)."""
    def set_rank(number: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(number))
    return set_rank


@pytest.mark.parametrize("number", [0, 1])
def test_an_argument_out_of_range_is_one_line_once_for_the_job(rank, capsys, number: int) -> None:
    rank(number)
    with pytest.raises(SystemExit) as exit:
        generate.parse_args(["--steps", "0"])
    printed = capsys.readouterr().err
    assert exit.value.code == (2 if number == 0 else 0)  # the job fails with the main rank's code
    assert "argument --steps: 0 is not a whole number >= 1" in printed if number == 0 else printed == ""


@pytest.mark.parametrize("number", [0, 1])
def test_a_missing_or_unreadable_input_image_is_refused_once_for_the_job(rank, tmp_path: Path, capsys,
                                                                          number: int) -> None:
    rank(number)
    (tmp_path / "notes.png").write_text("not an image")
    for name, message in (("missing.png", "no such file"), ("notes.png", "not an image this script can read")):
        with pytest.raises(SystemExit) as exit:
            generate.input_image(tmp_path / name)
        printed = capsys.readouterr().err
        assert exit.value.code == (2 if number == 0 else 0)
        assert f"error: --image {tmp_path / name}: {message}" in printed if number == 0 else printed == ""


def test_the_default_output_is_ignored_by_git() -> None:
    """Run from the checkout, the default output lands in a folder git ignores."""
    output = generate.output_path(argparse.Namespace(output=None, num_frames=None), is_video=False)
    assert output == Path("out", "output.png")
    checkout = Path(__file__).parent.parent
    if shutil.which("git") is None or not (checkout / ".git").exists():
        pytest.skip("not a git checkout")
    for where in (output, Path("examples") / output):
        assert subprocess.run(["git", "check-ignore", "-q", str(where)], cwd=checkout).returncode == 0, where


def test_library_warnings_are_left_to_the_main_rank(rank) -> None:
    before = transformers_logging.get_verbosity()
    try:
        rank(1)
        loading.quiet_libraries()
        assert transformers_logging.get_verbosity() == logging.ERROR
    finally:
        transformers_logging.set_verbosity(before)
