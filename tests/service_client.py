"""The generation service as the service tests drive it: a torchrun job of CPU ranks started on a free port (and
ended with the test process), one HTTP client, its answers decoded, waits that are bounded, and a service without
ranks or pipeline for the checks made on rank 0 alone."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch

# the `serve` extra (a GPU machine may lack it): a test module importing this one is skipped, in words, without it
for _package in ("fastapi", "uvicorn", "prometheus_client", "httpx", "multipart"):
    pytest.importorskip(_package, reason=f"{_package} is not installed: the serve extra (pip install -e '.[serve]')")

import httpx  # noqa: E402
import xstage_dit  # noqa: E402
from serve_job import SLOW_PROMPT  # noqa: E402
from xstage_dit.runtime.distributed import free_port  # noqa: E402
from xstage_dit.serve import loading, media  # noqa: E402
from xstage_dit.serve.__main__ import model_card  # noqa: E402
from xstage_dit.serve.app import create_app  # noqa: E402
from xstage_dit.serve.metrics import ServiceMetrics  # noqa: E402
from xstage_dit.serve.ranks import SideChannel  # noqa: E402
from xstage_dit.serve.schema import ModelCard, ServeOptions  # noqa: E402
from xstage_dit.serve.service import Service  # noqa: E402

QUEUE_BOUND, MAX_BATCH, TIMEOUT_S = 5, 4, 60  # four clients at once all wait behind a running call
REPOSITORY = Path(__file__).resolve().parents[1]


SERVE_JOB = Path(__file__).with_name("serve_job.py")


START_S = 240  # three jobs start side by side on a busy CPU


EXIT_S = 60


DRAINED_S = 20  # from a drained job's last answer to its exit: well before torchrun's SIGKILL, 30 s after SIGTERM


LONG_STEPS = 20  # with SLOW_PROMPT, a call of 2 s or more: long enough to hold the queue behind it


@dataclass
class ServiceJob:
    process: subprocess.Popen
    url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text()[-4000:]

    def agent_and_ranks(self) -> list[int]:
        return [self.process.pid, *self.rank_pids().values()]

    def rank_pids(self) -> dict[int, int]:
        """The torchrun workers (its children), by rank."""
        pids = {}
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) \
                        == self.process.pid:
                    environment = dict(item.split("=", 1) for item in
                                       (entry / "environ").read_bytes().decode().split("\0") if "=" in item)
                    pids[int(environment["RANK"])] = int(entry.name)
            except (OSError, KeyError, IndexError, ValueError):
                continue
        return pids


# torchrun runs in a session of its own (the test signals its group) but dies with the test process (Linux's
# parent-death signal, kept across exec), so that a killed test run leaves no service behind: its ranks then see the
# agent's store gone and exit
_DIE_WITH_PARENT = "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGKILL); " \
                   "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"


def launch_service(log: Path, *args: str) -> ServiceJob:
    port = free_port()
    command = [sys.executable, "-c", _DIE_WITH_PARENT, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--max-restarts", "0",
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(SERVE_JOB),
               "--port", str(port), "--timeout-s", str(TIMEOUT_S), *args]
    # as a user runs it: not with the Triton interpreter that conftest.py turns on for the kernel tests
    environment = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(command, env=environment, stdout=log.open("w"), stderr=subprocess.STDOUT,
                               start_new_session=True)
    return ServiceJob(process, f"http://127.0.0.1:{port}", log)


def wait_until_ready(job: ServiceJob) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert job.process.poll() is None, f"the service exited with {job.process.returncode}:\n{job.output()}"
        try:
            if httpx.get(f"{job.url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the service was not ready within {START_S} s:\n{job.output()}")


def end_job(job: ServiceJob) -> None:
    """torchrun and its ranks (each in a session of its own) killed, if they still run."""
    for pid in reversed(job.agent_and_ranks()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    job.process.wait(timeout=EXIT_S)


def is_running(pid: int) -> bool:
    """Whether process `pid` runs (an orphan that exited may stay a zombie until its new parent reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


HTTP = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=16))  # one client: no TLS set-up per request


def post_generation(url: str, timeout: float = 60, **body) -> httpx.Response:
    return HTTP.post(f"{url}/v1/images/generations", json={"prompt": "a lighthouse", **body}, timeout=timeout)


def decoded_pixels(payload: bytes) -> np.ndarray:
    return np.asarray(PIL.Image.open(io.BytesIO(payload)).convert("RGB"), dtype=np.int16)


def decoded_images(response: httpx.Response) -> list[np.ndarray]:
    assert response.status_code == 200, response.text
    return [decoded_pixels(base64.b64decode(item["b64_json"])) for item in response.json()["data"]]


def metric_value(url: str, line_start: str) -> float:
    text = HTTP.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def sse_events(response: httpx.Response):
    """(event, data) of a Server-Sent Events answer, as they arrive."""
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            yield name, json.loads(line[len("data: "):])


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, list]:
    box: list = []
    thread = threading.Thread(target=lambda: box.append(fn(*args, **kwargs)), daemon=True)
    thread.start()
    return thread, box


def wait_until(condition, what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def start_long_call(url: str, prompt: str = SLOW_PROMPT, steps: int = LONG_STEPS, leave_after: int | None = None
               ) -> tuple[threading.Thread, list]:
    """A streamed request of `steps` steps in a thread, returned once its call runs; the box gets its last event.
    With `leave_after`, the client closes its connection after that many events."""
    running, box = threading.Event(), []

    def stream() -> None:
        body = {"prompt": prompt, "num_inference_steps": steps, "stream": True}
        with HTTP.stream("POST", f"{url}/v1/images/generations", json=body, timeout=60) as response:
            for count, event in enumerate(sse_events(response), 1):
                running.set()
                box[:] = [event]
                if count == leave_after:
                    return

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    assert running.wait(timeout=60), "the long call did not start"
    return thread, box


VIDEO_EXTRA = pytest.mark.skipif(not media.can_write_mp4(), reason="the video extra is not installed")


def serve_in_process(config: str, device: torch.device, ask) -> tuple[list, int]:
    """`config` served in this process (one rank; the app called through httpx's ASGI transport, no server):
    `ask(client)`'s answers and the loop's exit code after a drain."""
    loaded = loading.load_pipeline(None, config, loading.family_of(None, config), device, torch.float32)
    loaded.pipe.set_progress_bar_config(disable=True)
    if device.type == "cuda":
        xstage_dit.enable(loaded.pipe, timeout_s=TIMEOUT_S)
    service = Service(loaded, model_card(loaded, config), ServeOptions(timeout_s=TIMEOUT_S),
                      SideChannel(TIMEOUT_S), ServiceMetrics())

    async def answers() -> list:
        transport = httpx.ASGITransport(app=create_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://service", timeout=120) as client:
            return await ask(client)

    loop, box = in_thread(service.run)
    try:
        return asyncio.run(answers()), box
    finally:
        service.drain(signal.SIGTERM, None)
        loop.join(timeout=30)
        if device.type == "cuda":
            xstage_dit.disable(loaded.pipe)


def stub_card(image: str, video: bool = False) -> ModelCard:
    return ModelCard(id="a-model", video=video, image=image, text_encoder=False, size_multiple=16,
                     default_height=32, default_width=48, fps=16)


def pipeline_free_service(card: ModelCard) -> Service:
    """A service with no pipeline and no loop: what rank 0 does before anything reaches the ranks."""
    return Service(None, card, ServeOptions(timeout_s=TIMEOUT_S), SideChannel(TIMEOUT_S), ServiceMetrics())
