"""The command-line tools as a user runs them, each a real process: `xstage-dit` answers --help and --version at
once (torch and diffusers load only in the commands that need them), and every bad argument of `xstage-dit`,
`python -m xstage_dit.serve` and examples/generate.py is refused in argparse's words (the subcommand's usage, then
`error: ...`, exit status 2, no traceback) before any model loads; under torchrun, once for the job."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
GENERATE = REPOSITORY / "examples" / "generate.py"
ENVIRONMENT = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), str(REPOSITORY / "examples")])}
ENABLED = "xstage_dit enabled on"  # enable's log line, after the pipeline is loaded

# `xstage-dit --help` takes HELP_S on an idle 2-core machine; a loaded one slows every start alike, so the bound
# grows with how much longer than IDLE_START_S a bare interpreter (`python -c pass`) takes just before
HELP_S = 1.5
IDLE_START_S = 0.1


def _run(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPOSITORY,
                          env={**ENVIRONMENT, **(env or {})})


def _xstage_dit(*args: str) -> subprocess.CompletedProcess:
    return _run(sys.executable, "-m", "xstage_dit.cli", *args)


def _assert_usage_error(run: subprocess.CompletedProcess, prog: str, message: str) -> None:
    assert run.returncode == 2, run.stderr[-3000:]
    # libraries may say something at import (torchao on a machine without its kernels); the usage starts a line
    assert f"\nusage: {prog} " in "\n" + run.stderr, run.stderr[-3000:]
    assert f"{prog}: error: {message}" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stdout + run.stderr
    assert ENABLED not in run.stdout + run.stderr


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["plan", "--help"]])
def test_help_and_version_answer_at_once(args: list[str]) -> None:
    start = time.perf_counter()
    _run(sys.executable, "-c", "pass")
    slowdown = max(1.0, (time.perf_counter() - start) / IDLE_START_S)
    start = time.perf_counter()
    run = _xstage_dit(*args)
    elapsed = time.perf_counter() - start
    assert run.returncode == 0 and run.stdout.startswith("xstage-dit " if args == ["--version"] else "usage: ")
    assert elapsed < HELP_S * slowdown, f"{elapsed:.2f} s (bound {HELP_S * slowdown:.2f} s)"
    imported = _run(sys.executable, "-X", "importtime", "-m", "xstage_dit.cli", *args).stderr
    loaded = {line.rsplit("|", 1)[-1].strip() for line in imported.splitlines() if line.startswith("import time:")}
    assert not loaded & {"torch", "diffusers", "transformers", "triton"}


@pytest.mark.parametrize("args, prog, message", [
    (["plan", "--tokens", "4096", "--heads", "24", "--ranks", "4", "--ulysses", "3"], "xstage-dit plan",
     "argument --ulysses: 3 must divide --ranks 4 and --heads 24"),
    (["plan", "--tokens", "4096", "--heads", "32", "--ranks", "16", "--ulysses", "16"], "xstage-dit plan",
     "argument --ulysses: 16 is wider than a node of 8 ranks"),
    (["plan", "--tokens", "4096", "--heads", "24", "--ranks", "0"], "xstage-dit plan",
     "argument --ranks: 0 is not a whole number >= 1"),
    (["plan", "--tokens", "4096", "--heads", "24"], "xstage-dit plan", "the following arguments are required: --ranks"),
    (["plan", "--tokens", "4096", "--heads", "24", "--ranks", "2", "--calibration", "missing.json"],
     "xstage-dit plan", "argument --calibration: cannot read missing.json"),
    (["calibrate", "--kernels-only", "missing.json"], "xstage-dit calibrate",
     "argument --kernels-only: cannot read missing.json"),
    (["info", "--verbose"], "xstage-dit info", "unrecognized arguments: --verbose"),
    (["plot"], "xstage-dit", "argument command: invalid choice: 'plot'"),
])
def test_a_bad_argument_of_xstage_dit_gets_its_commands_usage(args: list[str], prog: str, message: str) -> None:
    _assert_usage_error(_xstage_dit(*args), prog, message)


@pytest.mark.parametrize("args, env, message", [
    (["--ulysses-degree", "0"], {}, "ulysses_degree must be None or an int >= 1, got 0"),
    (["--ulysses-degree", "2"], {"WORLD_SIZE": "3"}, "ulysses_degree=2 does not fit the world size 3"),
    (["--cfg-degree", "2"], {"WORLD_SIZE": "3"}, "cfg_degree=2 does not divide the world size 3"),
    (["--max-steps", "0"], {}, "--max-steps must be at least 1"),
])
def test_a_bad_argument_of_the_service_is_refused_before_loading(args: list[str], env: dict[str, str],
                                                                 message: str) -> None:
    """WORLD_SIZE as torchrun sets it: the degrees are checked against it before any process group starts."""
    run = _run(sys.executable, "-m", "xstage_dit.serve", *args, env=env)
    _assert_usage_error(run, "xstage_dit.serve", message)


@pytest.mark.parametrize("args, message", [
    (["--ulysses-degree", "0"], "ulysses_degree must be None or an int >= 1, got 0"),
    (["--steps", "0"], "argument --steps: 0 is not a whole number >= 1"),
    (["--config", "tiny-flux-xl"], "argument --config: invalid choice: 'tiny-flux-xl'"),
    (["--num-frames", "5"], "argument --num-frames: tiny-flux makes images"),
    (["--output", "out.gif"], "--output out.gif: an image is written as .png"),
])
def test_a_bad_argument_of_generate_is_refused_before_loading(args: list[str], message: str) -> None:
    _assert_usage_error(_run(sys.executable, str(GENERATE), *args), "generate.py", message)


def test_an_input_image_for_a_pipeline_that_takes_none_is_refused_before_loading(tmp_path: Path) -> None:
    from xstage_dit.testing import zoo

    zoo.random_image(16, 16).save(tmp_path / "in.png")
    _assert_usage_error(_run(sys.executable, str(GENERATE), "--image", str(tmp_path / "in.png")), "generate.py",
                        "argument --image: FluxPipeline takes no input image")


def test_a_size_the_model_cannot_take_is_refused_before_generating() -> None:
    """What sizes a pipeline takes its VAE tells (the tiny Flux's: multiples of 4): checked once it is loaded."""
    _assert_usage_error(_run(sys.executable, str(GENERATE), "--height", "30"), "generate.py",
                        "argument --height: tiny-flux takes multiples of 4, got 30")


@pytest.mark.parametrize("args, message", [
    (["--ulysses-degree", "2"], "ulysses_degree=2 does not fit the world size 3"),
    (["--ulysses-degree", "3", "--ring-degree", "3"], "ulysses_degree=3 x ring_degree=3 does not fit the world size 3"),
], ids=["ulysses-2", "ulysses-3-ring-3"])
def test_degrees_that_do_not_fit_the_ranks_are_refused_once_for_the_job(tmp_path: Path, args: list[str],
                                                                         message: str) -> None:
    """Three ranks of torchrun: the main rank says it in argparse's words; the others leave quietly."""
    run = _run(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--log-dir", str(tmp_path),
               "--redirects", "3", str(GENERATE), *args)
    assert run.returncode != 0 and "exitcode: 2" in run.stderr, run.stderr[-3000:]
    logs = {rank: (next(tmp_path.rglob(f"attempt_0/{rank}/stdout.log")).read_text(),
                   next(tmp_path.rglob(f"attempt_0/{rank}/stderr.log")).read_text()) for rank in range(3)}
    stdout, stderr = logs[0]
    assert "\nusage: generate.py " in "\n" + stderr and f"generate.py: error: {message}" in stderr, stderr[-3000:]
    assert "Traceback" not in stdout + stderr and ENABLED not in stdout + stderr
    for rank in (1, 2):
        assert "usage:" not in "".join(logs[rank]) and "Traceback" not in "".join(logs[rank]), logs[rank]
