"""The command-line tools as a user runs them, each a real process: `xstage-dit`, `python -m xstage_dit.serve` and
examples/generate.py answer --help (and `xstage-dit` --version) at once, and every bad argument is refused in
argparse's words (the subcommand's usage, then `error: ...`, exit status 2, no traceback) before any model loads,
and before torch, diffusers and what imports them (seconds) are imported; under torchrun, once for the job."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import PIL.Image
import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
GENERATE = REPOSITORY / "examples" / "generate.py"
ENVIRONMENT = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPOSITORY), str(REPOSITORY / "examples")])}
ENABLED = "xstage_dit enabled on"  # enable's log line, after the pipeline is loaded
HEAVY = {"torch", "diffusers", "transformers", "triton"}  # what a tool imports only in the commands that need it

# what --help may take: the CPU seconds it spends, which on an idle machine is its wall time and on a busy one stays
# about the same while its wall time grows with the queue for the cores
HELP_CPU_S = 1.5

XSTAGE_DIT = (sys.executable, "-m", "xstage_dit.cli")
SERVE = (sys.executable, "-m", "xstage_dit.serve")


def _run(*command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`command` run from the checkout, each Python process of it telling on stderr what it imports (`_imported`)."""
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPOSITORY,
                          env={**ENVIRONMENT, "PYTHONPROFILEIMPORTTIME": "1", **(env or {})})


def _imported(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def _xstage_dit(*args: str) -> subprocess.CompletedProcess:
    return _run(*XSTAGE_DIT, *args)


def _assert_usage_error(run: subprocess.CompletedProcess, prog: str, message: str) -> None:
    assert run.returncode == 2, run.stderr[-3000:]
    # libraries may say something at import (torchao on a machine without its kernels); the usage starts a line
    assert f"\nusage: {prog} " in "\n" + run.stderr, run.stderr[-3000:]
    assert f"{prog}: error: {message}" in run.stderr, run.stderr[-3000:]
    assert "Traceback" not in run.stdout + run.stderr
    assert ENABLED not in run.stdout + run.stderr
    assert not _imported(run.stderr) & HEAVY, _imported(run.stderr) & HEAVY


def _cpu_seconds_of(command: tuple[str, ...]) -> tuple[subprocess.CompletedProcess, float]:
    """`command`'s run and the CPU seconds (user and system) it spent."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPOSITORY, env=ENVIRONMENT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return run, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


@pytest.mark.parametrize("command, answer", [
    ((*XSTAGE_DIT, "--help"), "usage: xstage-dit "), ((*XSTAGE_DIT, "--version"), "xstage-dit "),
    ((*XSTAGE_DIT, "plan", "--help"), "usage: xstage-dit plan "),
    ((*XSTAGE_DIT, "serve", "--help"), "usage: xstage-dit serve "), ((*SERVE, "--help"), "usage: xstage_dit.serve "),
    ((sys.executable, str(GENERATE), "--help"), "usage: generate.py "),
], ids=["xstage-dit", "version", "plan", "xstage-dit-serve", "serve", "generate"])
def test_help_and_version_answer_at_once(command: tuple[str, ...], answer: str) -> None:
    run, seconds = _cpu_seconds_of(command)
    assert run.returncode == 0 and run.stdout.startswith(answer), run.stderr[-3000:]
    assert seconds < HELP_CPU_S, f"{seconds:.2f} CPU s"
    assert not _imported(_run(*command).stderr) & HEAVY


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
    _assert_usage_error(_run(*SERVE, *args, env=env), "xstage_dit.serve", message)


@pytest.mark.parametrize("args, message", [
    (["--backend", "fastest"], "argument --backend: invalid choice: 'fastest'"),
    (["--config", "tiny-flux-xl"], "argument --config: invalid choice: 'tiny-flux-xl'"),
    (["--port", "http"], "argument --port: invalid int value: 'http'"),
])
def test_xstage_dit_serve_refuses_with_its_own_usage(args: list[str], message: str) -> None:
    _assert_usage_error(_xstage_dit("serve", *args), "xstage-dit serve", message)


@pytest.mark.parametrize("args, message", [
    (["--ulysses-degree", "0"], "ulysses_degree must be None or an int >= 1, got 0"),
    (["--steps", "0"], "argument --steps: 0 is not a whole number >= 1"),
    (["--config", "tiny-flux-xl"], "argument --config: invalid choice: 'tiny-flux-xl'"),
    (["--num-frames", "5"], "argument --num-frames: tiny-flux makes images"),
    (["--output", "out.gif"], "--output out.gif: an image is written as .png"),
    (["--config", "tiny-wan", "--output", "out.png"], "--output out.png: a video is written as .gif"),
    (["--height", "30"], "argument --height: tiny-flux takes multiples of 4, got 30"),
    (["--config", "tiny-wan", "--width", "40"], "argument --width: tiny-wan takes multiples of 16, got 40"),
    (["--dtype", "fp64"], "argument --dtype: invalid choice: 'fp64'"),
])
def test_a_bad_argument_of_generate_is_refused_before_loading(args: list[str], message: str) -> None:
    _assert_usage_error(_run(sys.executable, str(GENERATE), *args), "generate.py", message)


def test_an_input_image_for_a_pipeline_that_takes_none_is_refused_before_loading(tmp_path: Path) -> None:
    PIL.Image.new("RGB", (16, 16)).save(tmp_path / "in.png")
    _assert_usage_error(_run(sys.executable, str(GENERATE), "--image", str(tmp_path / "in.png")), "generate.py",
                        "argument --image: FluxPipeline takes no input image")


@pytest.mark.parametrize("args, message", [
    (["--ulysses-degree", "2"], "ulysses_degree=2 does not fit the world size 3"),
    (["--ulysses-degree", "3", "--ring-degree", "3"], "ulysses_degree=3 x ring_degree=3 does not fit the world size 3"),
], ids=["ulysses-2", "ulysses-3-ring-3"])
def test_degrees_that_do_not_fit_the_ranks_are_refused_once_for_the_job(tmp_path: Path, args: list[str],
                                                                         message: str) -> None:
    """Three ranks of torchrun: the main rank says it in argparse's words and exits 2, which torchrun reports; the
    others leave quietly with 0 (so that none can make torchrun stop the main rank before it has printed). No rank
    imports torch first."""
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
    for rank, (_, stderr) in logs.items():
        assert not _imported(stderr) & HEAVY, (rank, _imported(stderr) & HEAVY)


@pytest.mark.parametrize("command", [SERVE, (sys.executable, str(GENERATE))], ids=["serve", "generate"])
def test_the_other_ranks_leave_a_bad_argument_to_the_main_rank(command: tuple[str, ...]) -> None:
    """Rank 1 of two meets the error too, says nothing and exits 0: the main rank's exit 2 fails the job."""
    run = _run(*command, "--ulysses-degree", "0", env={"WORLD_SIZE": "2", "RANK": "1"})
    assert run.returncode == 0 and run.stdout == "", run.stderr[-3000:]
    assert not [line for line in run.stderr.splitlines() if not line.startswith("import time:")], run.stderr[-3000:]


def test_the_zoo_listing_is_the_zoo() -> None:
    """What the command lines check a zoo config's arguments against without building it (testing/catalog.py) is
    what the built pipeline is: its class, video or not, its size multiple, the input image it takes. The
    released-size configs are built on the meta device (their shapes, no memory); those with a ControlNet, which
    draws its zero layers from values, on the CPU (all tiny)."""
    from xstage_dit.serve import loading
    from xstage_dit.testing import catalog, zoo

    wrong = {}
    for name, entry in zoo.ZOO.items():
        pipe = zoo.build_pipeline(name, device="cpu" if entry.controlnets else "meta")
        built = catalog.Listing(type(pipe).__name__, zoo.FAMILIES[entry.family].video, loading.size_multiple(pipe),
                                loading.image_input(type(pipe)))
        if catalog.CONFIGS.get(name) != built:
            wrong[name] = built
    lines = "\n".join(f'    "{name}": {listing!r},' for name, listing in wrong.items())
    assert not wrong, f"testing/catalog.py's CONFIGS should read (the lines that differ):\n{lines}"
    assert catalog.CONFIGS.keys() == zoo.ZOO.keys()


def test_the_backends_offered_are_the_registrys() -> None:
    """--backend's choices, found without importing the registry, are what `xstage_dit.available_backends()` lists."""
    from xstage_dit import available_backends
    from xstage_dit.config import installed_backends

    assert installed_backends() == available_backends()
