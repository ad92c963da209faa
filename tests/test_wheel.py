"""The package as a user installs it (a wheel, not this checkout): `python -m xstage_dit.serve --help` runs, and a
torchrun job of one rank serves its default model (the zoo's tiny random Flux) from the installed copy alone,
answering /health and one small image request. Run from a folder outside the checkout, with only the installed
copy on the path, so nothing of the checkout (examples/ included) can be imported."""
from __future__ import annotations

import base64
import io
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

for _package in ("fastapi", "uvicorn", "prometheus_client", "httpx"):  # the `serve` extra
    pytest.importorskip(_package)

import httpx  # noqa: E402
import PIL.Image  # noqa: E402

from xstage_dit.runtime.distributed import free_port  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[1]
BUILD_S = 300
START_S = 300  # imports and a first call on a busy 2-core machine
EXIT_S = 60


def _installed_copy(tmp_path: Path) -> Path:
    """The package built as a wheel and installed into a folder of its own. The wheel is built from a copy of the
    package's sources: setuptools' build/ in the checkout keeps files of earlier builds, which a wheel built there
    would carry too."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("setup.py", "LICENSE"):
        shutil.copy2(REPOSITORY / name, source / name)
    shutil.copytree(REPOSITORY / "xstage_dit", source / "xstage_dit",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    wheels, target = tmp_path / "wheels", tmp_path / "installed"
    _pip(tmp_path, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(wheels))
    [wheel] = wheels.glob("xstage_dit-*.whl")
    _pip(tmp_path, "install", "--no-deps", "--target", str(target), str(wheel))
    return target


def _pip(cwd: Path, *args: str) -> None:
    command = [sys.executable, "-m", "pip", "-q", *args]
    done = subprocess.run(command, env={**os.environ, "XSTAGE_SKIP_CUDA_EXT": "1"}, cwd=cwd, capture_output=True,
                          text=True, timeout=BUILD_S)
    assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"


def test_an_installed_wheel_serves_its_default_model(tmp_path: Path) -> None:
    target = _installed_copy(tmp_path)
    away = tmp_path / "elsewhere"  # the working folder: neither the checkout nor the installed copy
    away.mkdir()
    # only the installed copy: not the checkout (the editable install's finder comes after the path), not examples/
    environment = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "PYTHONPATH": str(target),
                   "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import importlib.util; print(importlib.util.find_spec("
                            "'xstage_dit').origin)"], env=environment, cwd=away, capture_output=True, text=True,
                           timeout=START_S)
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(target), where.stdout

    helped = subprocess.run([sys.executable, "-m", "xstage_dit.serve", "--help"], env=environment, cwd=away,
                            capture_output=True, text=True, timeout=START_S)
    assert helped.returncode == 0 and "--config NAME" in helped.stdout, helped.stderr[-2000:]

    port = free_port()
    log = tmp_path / "serve.log"
    job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                            "--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                            "-m", "xstage_dit.serve", "--port", str(port)],
                           env=environment, cwd=away, stdout=log.open("w"), stderr=subprocess.STDOUT,
                           start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        health = _when_ready(job, url, log)
        assert health["status"] == "ready" and health["model"] == "tiny-flux", health
        answer = httpx.post(f"{url}/v1/images/generations", timeout=120,
                            json={"prompt": "a lighthouse", "size": "32x48", "num_inference_steps": 1})
        assert answer.status_code == 200, answer.text
        [item] = answer.json()["data"]
        assert PIL.Image.open(io.BytesIO(base64.b64decode(item["b64_json"]))).size == (32, 48)
        os.killpg(job.pid, signal.SIGTERM)  # a drain; torchrun itself says the signal in its exit code
        job.wait(timeout=EXIT_S)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait(timeout=EXIT_S)


def _when_ready(job: subprocess.Popen, url: str, log: Path) -> dict:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert job.poll() is None, f"the service exited with {job.returncode}:\n{log.read_text()[-4000:]}"
        try:
            response = httpx.get(f"{url}/health", timeout=5)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the service was not ready within {START_S} s:\n{log.read_text()[-4000:]}")
