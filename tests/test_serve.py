"""The generation service as a client sees it: torchrun jobs of 2 CPU ranks serving the tiny random Flux on
127.0.0.1, real HTTP clients. One job answers most checks and ends drained by SIGTERM; a second one loses a rank
mid-request; a third one loses its torchrun agent. Every wait is bounded, and a job dies with the test process."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np
import PIL.Image
import pytest
import torch

# service_client skips this module, in words, without the serve extra
from service_client import (DRAINED_S, EXIT_S, HTTP, LONG_STEPS, MAX_BATCH, QUEUE_BOUND, START_S,
                            TIMEOUT_S, VIDEO_EXTRA, ServiceJob, decoded_images, decoded_pixels, end_job, in_thread,
                            is_running, launch_service, metric_value, pipeline_free_service, post_generation,
                            serve_in_process, sse_events, start_long_call, stub_card, wait_until, wait_until_ready)
import httpx
import bench_serve
from serve_job import FAIL_PROMPT, SLOW_PROMPT
from xstage_dit.serve import loading, media
from xstage_dit.serve.admission import Job, JobQueue, QueueFull
from xstage_dit.serve.app import create_app
from xstage_dit.serve.loading import CallOptions
from xstage_dit.serve.ranks import Liveness, silence_bound
from xstage_dit.serve.schema import GenerationRequest, ModelCard
from xstage_dit.serve.service import State
from xstage_dit.testing import zoo


class Jobs(NamedTuple):
    shared: ServiceJob  # most checks, then drained by SIGTERM
    doomed: ServiceJob  # loses a rank mid-request
    orphaned: ServiceJob  # loses its torchrun agent


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Jobs:
    """The three jobs, started side by side."""
    folder = tmp_path_factory.mktemp("serve")
    started = Jobs(launch_service(folder / "shared.log", "--queue-bound", str(QUEUE_BOUND), "--max-batch", str(MAX_BATCH)),
                   launch_service(folder / "doomed.log"), launch_service(folder / "orphaned.log"))
    try:
        for job in started:
            wait_until_ready(job)
        yield started
    finally:
        for job in started:
            end_job(job)


@pytest.fixture
def server(jobs: Jobs) -> ServiceJob:
    return jobs.shared


def test_health_models_metrics_and_an_image(server: ServiceJob) -> None:
    health = HTTP.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ready" and health["ranks"] == 2 and health["model"] == "tiny-flux"
    models = HTTP.get(f"{server.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny-flux"]
    assert models["data"][0]["service"]["max_batch"] == MAX_BATCH
    first, again = post_generation(server.url, seed=7), post_generation(server.url, seed=7, response_format="url")
    [image] = decoded_images(first)
    assert image.shape == (32, 48, 3) and first.json()["data"][0]["seed"] == 7
    fetched = HTTP.get(again.json()["data"][0]["url"], timeout=10)
    assert fetched.headers["content-type"] == "image/png"
    assert np.array_equal(decoded_pixels(fetched.content), image), "the same seed gave another image"
    assert not np.array_equal(decoded_images(post_generation(server.url, seed=8))[0], image)
    assert float(first.headers["x-queue-seconds"]) >= 0
    assert metric_value(server.url, 'xstage_requests_total{outcome="ok"}') >= 3
    assert metric_value(server.url, "xstage_step_seconds_count") >= 12
    assert metric_value(server.url, "xstage_queue_depth") == 0


def test_progress_streams_step_by_step(server: ServiceJob) -> None:
    body = {"prompt": "a lighthouse", "seed": 7, "num_inference_steps": 3, "stream": True}
    with HTTP.stream("POST", f"{server.url}/v1/images/generations", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(response))
    assert [data for name, data in events if name == "progress"] == [{"step": i, "steps": 3} for i in (1, 2, 3)]
    name, data = events[-1]
    assert name == "completed" and data["data"][0]["seed"] == 7


def test_four_concurrent_clients(server: ServiceJob) -> None:
    threads = [in_thread(post_generation, server.url, seed=100 + i) for i in range(4)]
    for thread, _ in threads:
        thread.join(timeout=60)
    images = [decoded_images(box[0])[0] for _, box in threads]
    assert len({image.tobytes() for image in images}) == 4


@pytest.mark.parametrize("body, status, param", [
    ({"size": "1024"}, 400, "size"), ({"size": "30x48"}, 400, "size"),
    ({"size": "4096x4096"}, 400, "size"), ({"num_inference_steps": 0}, 400, "num_inference_steps"),
    ({"n": 0}, 400, "n"), ({"n": "two"}, 422, "n"), ({"prompt": ""}, 422, "prompt"),
    ({"image": base64.b64encode(b"not an image").decode()}, 400, "image"),
    ({"negative_prompt": "blur"}, 400, "negative_prompt"), ({"model": "dall-e-3"}, 404, "model"),
    ({"response_format": "jpeg"}, 422, "response_format"),
])
def test_bad_input_is_refused_naming_the_field(server: ServiceJob, body: dict, status: int, param: str) -> None:
    response = post_generation(server.url, **body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_a_malformed_body_and_the_wrong_endpoint_are_refused(server: ServiceJob) -> None:
    malformed = HTTP.post(f"{server.url}/v1/images/generations", content=b"{not json",
                           headers={"content-type": "application/json"}, timeout=10)
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] is None
    video = HTTP.post(f"{server.url}/v1/videos/generations", json={"prompt": "a wave"}, timeout=10)
    assert video.status_code == 400 and video.json()["error"]["param"] == "model"


def test_a_failure_inside_a_call_answers_500_and_the_service_goes_on(server: ServiceJob) -> None:
    failed = post_generation(server.url, prompt=FAIL_PROMPT)
    assert failed.status_code == 500 and "a failure inside the pipeline call" in failed.json()["error"]["message"]
    assert "rank 1" in failed.json()["error"]["message"]
    assert len(decoded_images(post_generation(server.url, seed=3))) == 1
    assert HTTP.get(f"{server.url}/health", timeout=10).status_code == 200


def test_batched_equals_unbatched_and_a_full_queue_answers_429(server: ServiceJob) -> None:
    """Behind a long call, four compatible requests wait (the bound, with the running one): the first three run as
    one call of 4 outputs (the most), the fourth after them; a fifth is refused. Each output equals the same seed
    run alone."""
    seeds = [(20, 2), (30, 1), (40, 1), (50, 1)]  # (seed, n): seeds 20, 21, 30, 40, 50
    alone = {seed + i: decoded_images(post_generation(server.url, seed=seed + i))[0] for seed, n in seeds for i in range(n)}
    calls_of_4 = 'xstage_batch_outputs_bucket{le="4.0"}', 'xstage_batch_outputs_bucket{le="2.0"}'
    before = metric_value(server.url, calls_of_4[0]) - metric_value(server.url, calls_of_4[1])
    long_call, long_box = start_long_call(server.url)
    waiting = []
    for seed, n in seeds:
        waiting.append(in_thread(post_generation, server.url, seed=seed, n=n))
        time.sleep(0.05)  # arrival order
    wait_until(lambda: HTTP.get(f"{server.url}/health", timeout=5).json()["queue"] == QUEUE_BOUND - 1, "a full queue")
    refused = post_generation(server.url, seed=60)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    for thread, _ in [(long_call, long_box), *waiting]:
        thread.join(timeout=60)
    assert long_box[0][0] == "completed"
    for (seed, n), (_, box) in zip(seeds, waiting):
        for i, image in enumerate(decoded_images(box[0])):
            assert np.abs(image - alone[seed + i]).max() <= 1, f"seed {seed + i}: batched differs from alone"
    after = metric_value(server.url, calls_of_4[0]) - metric_value(server.url, calls_of_4[1])
    assert after == before + 1, "the first three waiting requests did not run as one call of 4 outputs"


def test_a_waiting_request_whose_client_left_is_dropped(server: ServiceJob) -> None:
    dropped = metric_value(server.url, 'xstage_requests_total{outcome="dropped"}')
    long_call, box = start_long_call(server.url)
    with pytest.raises(httpx.ReadTimeout):
        post_generation(server.url, timeout=0.5, seed=70)
    long_call.join(timeout=60)
    assert box[0][0] == "completed"
    wait_until(lambda: metric_value(server.url, 'xstage_requests_total{outcome="dropped"}') == dropped + 1,
           "the request to be dropped")


def test_a_short_load_benchmark(server: ServiceJob, tmp_path: Path) -> None:
    prefix = tmp_path / "serve-cpu"
    bench_serve.main(["--url", server.url, "--concurrency", "2", "--requests", "4", "--out", str(prefix)])
    [record] = json.loads(prefix.with_suffix(".json").read_text())
    assert record["answered"] == {"200": 4} and record["ranks"] == 2 and record["model"] == "tiny-flux"
    assert record["service"]["queue_bound"] == QUEUE_BOUND
    assert 0 < record["latency_s"]["p50"] <= record["latency_s"]["p99"] and record["throughput_rps"] > 0
    assert 0 <= record["overhead_s"]["p50"] < record["latency_s"]["p50"]
    assert 0 < record["encode_s"]["p50"] <= record["overhead_s"]["p99"]
    assert "p99" in prefix.with_suffix(".md").read_text()


def test_the_benchmark_launches_the_service_and_compares_max_batches(tmp_path: Path, monkeypatch) -> None:
    """--launch: the service (one CPU rank) started with the max batch asked for, and stopped by SIGTERM; runs at
    two max batches side by side as ratios to the first (records made up: a launch costs seconds of CPU)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # as a user runs it (see launch_service)
    prefix = tmp_path / "serve-launched"
    bench_serve.main(["--launch", f"{sys.executable} -m xstage_dit.serve --timeout-s {TIMEOUT_S}", "--max-batch", "2",
                      "--wait-ready", str(START_S), "--concurrency", "2", "--requests", "2", "--warmup", "0",
                      "--out", str(prefix)])
    [record] = json.loads(prefix.with_suffix(".json").read_text())
    assert record["max_batch"] == 2 and record["answered"] == {"200": 2} and record["ranks"] == 1
    slower = {**record, "max_batch": 1, "throughput_rps": record["throughput_rps"] / 2,
              "latency_s": {**record["latency_s"], "p50": record["latency_s"]["p50"] * 4}}
    assert bench_serve.ratios([slower, record])[-1] == "| 2 | 2 concurrent client(s) | 2.000 | 0.250 |"


def test_sigterm_to_torchrun_and_the_ranks_drains_and_the_ranks_exit_0(server: ServiceJob) -> None:
    """SIGTERM to torchrun's process group (an orchestrator's stop) and to every rank (as `pkill -f` of the command
    line does), all at once: each rank gets it twice, from the test and from torchrun passing it on. The running
    request answers 200, a new one 503, and both ranks exit 0 long before torchrun would kill them. Ends the
    shared job."""
    body = {"prompt": SLOW_PROMPT, "num_inference_steps": LONG_STEPS, "stream": True}
    with HTTP.stream("POST", f"{server.url}/v1/images/generations", json=body, timeout=60) as response:
        events = sse_events(response)
        assert next(events)[0] == "progress"
        ranks = server.rank_pids()
        os.killpg(server.process.pid, signal.SIGTERM)
        for pid in ranks.values():
            os.kill(pid, signal.SIGTERM)
        wait_until(lambda: HTTP.get(f"{server.url}/health", timeout=5).status_code == 503, "/health to fail")
        assert post_generation(server.url).status_code == 503
        assert list(events)[-1][0] == "completed"
    answered = time.monotonic()
    server.process.wait(timeout=EXIT_S)
    assert time.monotonic() - answered < DRAINED_S, server.output()
    log = server.output()
    assert "serve_job: rank 0 exits 0" in log and "serve_job: rank 1 exits 0" in log, log
    assert "torchvision" not in log  # transformers' note on its image processors says nothing to a user


def test_a_rank_killed_mid_request_fails_the_request_and_the_job(jobs: Jobs) -> None:
    doomed = jobs.doomed
    body = {"prompt": SLOW_PROMPT, "num_inference_steps": LONG_STEPS, "stream": True}
    started = time.monotonic()
    with HTTP.stream("POST", f"{doomed.url}/v1/images/generations", json=body, timeout=60) as response:
        events = sse_events(response)
        assert next(events)[0] == "progress"
        os.kill(doomed.rank_pids()[1], signal.SIGKILL)
        name, data = list(events)[-1]
    assert name == "error" and data["error"]["code"] == 503, (name, data)
    assert doomed.process.wait(timeout=TIMEOUT_S) != 0
    assert time.monotonic() - started < TIMEOUT_S


def test_ranks_whose_torchrun_agent_died_exit(jobs: Jobs) -> None:
    """torchrun's agent killed, and with it the job's store that the ranks heartbeat through: the orphaned ranks
    see their parent or the store gone and exit within the silence bound."""
    orphaned = jobs.orphaned
    ranks = orphaned.rank_pids()
    assert sorted(ranks) == [0, 1]
    os.kill(orphaned.process.pid, signal.SIGKILL)
    orphaned.process.wait(timeout=EXIT_S)
    wait_until(lambda: not any(is_running(pid) for pid in ranks.values()), "the orphaned ranks to exit",
           timeout_s=silence_bound(TIMEOUT_S) + 10)
    log = orphaned.output()
    for rank in ranks:
        assert re.search(f"rank {rank}: .*torchrun agent", log), log


@VIDEO_EXTRA
def test_a_video_model_answers_an_mp4_in_one_process() -> None:
    """The tiny random Wan: the video endpoint answers an MP4, the image endpoint names the model, a drain ends
    the loop with 0."""
    async def ask(client: httpx.AsyncClient) -> list:
        video = await client.post("/v1/videos/generations", json={"prompt": "a wave", "num_frames": 5, "seed": 2})
        return [video, await client.post("/v1/images/generations", json={"prompt": "a wave"})]

    (video, image), box = serve_in_process("tiny-wan", torch.device("cpu"), ask)
    assert video.status_code == 200, video.text
    assert video.headers["content-type"] == "video/mp4" and video.content[4:8] == b"ftyp"
    assert video.headers["x-seed"] == "2"
    assert image.status_code == 400 and image.json()["error"]["param"] == "model"
    assert box == [0]


def test_an_input_image_reaches_a_kontext_pipeline() -> None:
    """The tiny random Flux Kontext in this process: the request's image is the pipeline's input (another image,
    another output); an image that does not decode is refused naming the field."""
    def png(seed: int) -> str:
        buffer = io.BytesIO()
        zoo.random_image(40, 56, seed).save(buffer, format="PNG")
        return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    async def ask(client: httpx.AsyncClient) -> list:
        body = {"prompt": "a lighthouse", "seed": 1, "num_inference_steps": 2}
        return [await client.post("/v1/images/generations", json={**body, "image": png(seed)}) for seed in (1, 2)] \
            + [await client.post("/v1/images/generations", json={**body, "image": "bm90IGFuIGltYWdl"})]

    (first, second, broken), box = serve_in_process("tiny-flux-kontext", torch.device("cpu"), ask)
    assert decoded_images(first)[0].shape == (32, 48, 3) and not np.array_equal(decoded_images(first)[0], decoded_images(second)[0])
    assert broken.status_code == 400 and broken.json()["error"]["param"] == "image"
    assert box == [0]


@pytest.mark.gpu
def test_the_service_on_a_gpu() -> None:
    """The tiny random Flux enabled on one GPU: streamed progress, the same seed twice, a batch of two."""
    async def ask(client: httpx.AsyncClient) -> list:
        body = {"prompt": "a lighthouse", "seed": 5, "num_inference_steps": 3}
        streamed = await client.post("/v1/images/generations", json={**body, "stream": True})
        return [streamed, await client.post("/v1/images/generations", json=body),
                await client.post("/v1/images/generations", json={**body, "n": 2})]

    (streamed, alone, batch), box = serve_in_process("tiny-flux", torch.device("cuda"), ask)
    assert streamed.text.count("event: progress") == 3 and "event: completed" in streamed.text
    completed = json.loads(streamed.text.split("event: completed\ndata: ", 1)[1].split("\n", 1)[0])
    first = decoded_pixels(base64.b64decode(completed["data"][0]["b64_json"]))
    assert np.array_equal(decoded_images(alone)[0], first)
    assert np.abs(decoded_images(batch)[0] - first).max() <= 3  # batched kernels round differently; another draw differs
    assert box == [0]


def test_the_queue_batches_compatible_requests_in_arrival_order() -> None:
    """JobQueue alone: the oldest request first, with the later ones of its batch key up to the most outputs; a
    request with an image alone; a request whose client left dropped; the bound."""
    loop, dropped = asyncio.new_event_loop(), []
    queue = JobQueue(bound=5, max_batch=4, on_drop=dropped.append)

    def job(name: str, n: int = 1, steps: int = 4, image: PIL.Image.Image | None = None) -> Job:
        request = GenerationRequest(id=name, prompt=name, n=n, seed=0, video=False,
                                    options=CallOptions(steps=steps, image=image))
        queue.put(made := Job(request, loop))
        return made

    job("a", n=2), job("b", steps=8), job("c")
    gone = job("gone")
    gone.gone = True
    job("d", n=2)
    with pytest.raises(QueueFull):
        job("over the bound")
    assert [j.request.id for j in queue.take(0)] == ["a", "c"]  # "d" would make 5 outputs
    assert dropped == [gone]
    job("e", image=PIL.Image.new("RGB", (8, 8)))  # "b", "d", "e" wait, "a" and "c" run: the bound
    with pytest.raises(QueueFull):
        job("over the bound with the running batch")
    assert [j.request.id for j in queue.take(0)] == ["b"]
    assert [j.request.id for j in queue.take(0)] == ["d"]
    assert [j.request.id for j in queue.take(0)] == ["e"] and queue.take(0) == []
    loop.close()


def test_a_call_past_its_bound_is_a_failure() -> None:
    failures: list[str] = []
    liveness = Liveness(0, 1, silent_after_s=10, on_failure=failures.append)
    liveness.arm(0.1, "the pipeline call for requests ['x']")
    wait_until(lambda: failures, "the overrun to be reported", timeout_s=10)
    assert failures == ["rank 0: the pipeline call for requests ['x'] ran past its bound"]
    liveness.stop()


def test_the_console_script_takes_the_services_arguments(capsys) -> None:
    from xstage_dit import cli

    with pytest.raises(SystemExit) as exit:
        cli.main(["serve", "--help"])
    assert exit.value.code == 0 and "--queue-bound" in capsys.readouterr().out


def test_the_input_image_is_checked_before_it_reaches_the_ranks() -> None:
    """A pipeline that makes its output from an image (an edit, an image-to-video) refuses a request without one, a
    text-only pipeline one with an image, 400 naming the field, before the queue; each of the zoo's pipelines is
    classed as diffusers names and defines it."""
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    image = base64.b64encode(buffer.getvalue()).decode()

    async def ask(card: ModelCard, body: dict) -> httpx.Response:
        service = pipeline_free_service(card)
        transport = httpx.ASGITransport(app=create_app(service))
        endpoint = "/v1/videos/generations" if card.video else "/v1/images/generations"
        async with httpx.AsyncClient(transport=transport, base_url="http://service") as client:
            response = await client.post(endpoint, json={"prompt": "a lighthouse", **body})
        service.liveness.stop()
        assert len(service.queue) == (1 if response.status_code == 200 else 0)
        return response

    import diffusers

    for card, body in ((stub_card("required"), {}), (stub_card("required", video=True), {}), (stub_card("none"), {"image": image}),
                       (stub_card("none", video=True), {"image": image})):
        response = asyncio.run(asyncio.wait_for(ask(card, body), 30))
        assert response.status_code == 400 and response.json()["error"]["param"] == "image", response.text
    classes = {(entry.pipeline or zoo.FAMILIES[entry.family].pipeline) for entry in zoo.ZOO.values()}
    kinds = {name: loading.image_input(getattr(diffusers, name)) for name in classes}
    assert {name for name, kind in kinds.items() if kind == "required"} == {
        "QwenImageEditPipeline", "QwenImageEditPlusPipeline", "LTXImageToVideoPipeline", "LTX2ImageToVideoPipeline",
        "WanImageToVideoPipeline", "ZImageImg2ImgPipeline", "ZImageInpaintPipeline", "ZImageControlNetInpaintPipeline",
        "ChromaImg2ImgPipeline", "FluxFillPipeline"}
    assert {name for name, kind in kinds.items() if kind == "optional"} == {
        "FluxKontextPipeline", "LTXConditionPipeline", "Flux2Pipeline", "Flux2KleinPipeline", "Flux2KleinKVPipeline",
        "QwenImage21Pipeline"}
    assert loading.uncarried_inputs(diffusers.FluxFillPipeline) == []
    assert loading.uncarried_inputs(diffusers.FluxControlNetPipeline) == ["control_image"]
    assert loading.uncarried_inputs(diffusers.FluxKontextPipeline) == []


def test_the_drain_handler_takes_no_lock() -> None:
    """SIGTERM's handler can run inside itself (a rank gets the signal from its sender and from torchrun) and
    interrupt the main thread while it holds the service's lock: it must not wait for that lock."""
    service = pipeline_free_service(stub_card("none"))
    with service._lock:
        handler = threading.Thread(target=service.drain, args=(signal.SIGTERM, None), daemon=True)
        handler.start()
        handler.join(timeout=5)
        assert not handler.is_alive(), "the handler waited for the service's lock"
    assert service.state is State.DRAINING
    service.liveness.stop()


def test_outputs_are_encoded_as_png_that_decodes_to_the_same_pixels() -> None:
    noise = np.random.default_rng(0)
    for mode, shape in (("RGB", (33, 47, 3)), ("L", (20, 9)), ("RGBA", (8, 5, 4))):
        pixels = noise.integers(0, 256, shape, dtype=np.uint8)
        decoded = PIL.Image.open(io.BytesIO(media.png(PIL.Image.fromarray(pixels, mode))))
        assert decoded.mode == mode and np.array_equal(np.asarray(decoded), pixels)
    palette = PIL.Image.fromarray(noise.integers(0, 256, (6, 7), dtype=np.uint8)).convert("P")
    assert np.array_equal(decoded_pixels(media.png(palette)), np.asarray(palette.convert("RGB")))


def test_the_costs_of_answering_a_1024_image() -> None:
    """What rank 0 adds to a request for a 1024² image besides its call, each part the fastest of 3 (printed with
    -s): the command's pickle (what the broadcast carries), the PNG of a noise image (what random weights make; the
    worst case) against PIL's at zlib's fastest level, and the JSON body with the PNG in base64."""
    import pickle

    from xstage_dit.serve.app import OutputItem, answer_json

    from xstage_dit.serve.ranks import Command

    def fastest(make):
        times, made = [], None
        for _ in range(3):
            started = time.perf_counter()
            made = make()
            times.append(time.perf_counter() - started)
        return min(times), made

    def pil_png(image: PIL.Image.Image) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1)
        return buffer.getvalue()

    request = GenerationRequest(id="0" * 32, prompt=bench_serve.PROMPTS[0], n=1, seed=1, video=False,
                                options=CallOptions(height=1024, width=1024, steps=28))
    image = PIL.Image.fromarray(np.random.default_rng(0).integers(0, 256, (1024, 1024, 3), dtype=np.uint8))
    command_s, command = fastest(lambda: pickle.dumps(Command("run", (request,))))
    png_s, png = fastest(lambda: media.png(image))
    pil_s, _ = fastest(lambda: pil_png(image))
    json_s, body = fastest(lambda: answer_json([OutputItem(1, payload=png)], {}))
    print(f"\n1024x1024: command pickle {command_s * 1e6:.0f} us ({len(command)} bytes), PNG {png_s * 1e3:.1f} ms "
          f"({len(png) / 1e6:.2f} MB; PIL at level 1 {pil_s * 1e3:.1f} ms), its JSON body {json_s * 1e3:.1f} ms")
    assert base64.b64decode(json.loads(body)["data"][0]["b64_json"]) == png
    assert png_s < pil_s
