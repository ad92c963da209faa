"""No request can stop the service: a torchrun job of 2 CPU ranks serving the tiny random Flux (tests/test_serve.py's
launch), real HTTP clients. A request over the model's limits or its predicted cost answers 400 naming the limit;
a call past its deadline answers 504 and a client that goes away cancels its call, both stopped between two steps
on every rank; a load of 4x the service's capacity mixed with hostile clients leaves it healthy. After each, the
next good request is answered."""
from __future__ import annotations

import asyncio
import json
import math
import statistics
import time
from pathlib import Path

import pytest
import torch

from service_client import (HTTP, ServiceJob, decoded_images, end_job, launch_service, metric_value,
                            pipeline_free_service, post_generation, start_long_call, stub_card, wait_until,
                            wait_until_ready)

import bench_serve
import httpx
from serve_job import STALL_PROMPT
from xstage_dit.serve import cost, loading
from xstage_dit.serve.admission import Job
from xstage_dit.serve.__main__ import model_card
from xstage_dit.serve.loading import CallOptions
from xstage_dit.serve.schema import GenerationRequest, ModelCard, ModelScale, RequestError

MAX_TIMEOUT_S = 30  # the job's --max-timeout-s: the deadline of a request without timeout_s
STEP_TIMEOUT_S = 12  # the job's --timeout-s: a step's bound, shorter than a whole long call
STALL_STEPS = 16  # with STALL_PROMPT, a call of 8 s or more
LOAD_S = 60  # the load test's span of arrivals
OUTCOMES = ("ok", "invalid", "rejected", "unavailable", "failed", "dropped", "cancelled", "deadline")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServiceJob:
    job = launch_service(tmp_path_factory.mktemp("serve-cancel") / "job.log", "--max-timeout-s", str(MAX_TIMEOUT_S),
                  "--timeout-s", str(STEP_TIMEOUT_S))
    try:
        wait_until_ready(job)
        yield job
    finally:
        end_job(job)


def _service(url: str) -> dict:
    [model] = HTTP.get(f"{url}/v1/models", timeout=10).json()["data"]
    return model["service"]


def _step_s(url: str) -> float:
    """A step's price at the model's default size, measured at warm-up."""
    return _service(url)["step_cost"]["seconds"]


def _answered(url: str) -> float:
    return sum(metric_value(url, f'xstage_requests_total{{outcome="{outcome}"}}') for outcome in OUTCOMES)


def _next_good_request_is_answered(url: str) -> None:
    assert len(decoded_images(post_generation(url, seed=5, timeout=30))) == 1
    assert HTTP.get(f"{url}/health", timeout=10).json()["status"] == "ready"


def test_requests_over_the_models_limits_answer_400_naming_the_limit(server: ServiceJob) -> None:
    """Over the pixels the model was released for (the issue's request: 2048² in one step would run for minutes and
    end the job); a predicted call longer than the deadline, by its size, its steps or its outputs; a deadline
    over the service's. None reaches the ranks."""
    service, step = _service(server.url), _step_s(server.url)
    side = math.isqrt(service["max_pixels"]) // 4 * 4  # the largest square the model takes: too slow on a CPU
    steps_over = {"num_inference_steps": 100, "timeout_s": 50 * step}
    outputs_over = {"n": 4, "num_inference_steps": 4, "timeout_s": 10 * step}
    for body, param, words in (({"size": "2048x2048", "num_inference_steps": 1}, "size", "pixels"),
                               ({"size": f"{side}x{side}", "num_inference_steps": 1}, "size", "predicted time"),
                               (steps_over, "num_inference_steps", "100 step(s)"),
                               (outputs_over, "n", "4 output(s)"),
                               ({"timeout_s": MAX_TIMEOUT_S + 1}, "timeout_s", f"at most {MAX_TIMEOUT_S}")):
        started = time.monotonic()
        response = post_generation(server.url, **body)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
        assert time.monotonic() - started < 5, "refused only after running"
    _next_good_request_is_answered(server.url)


def test_a_call_past_its_deadline_answers_504_and_the_service_goes_on(server: ServiceJob) -> None:
    """A call slower than predicted (it pauses half a second a step) stops at the first step past its deadline;
    a request waiting behind a call answers 504 once its deadline passes, while that call, longer than the job's
    --timeout-s (which bounds each step), runs to its end."""
    deadlines = metric_value(server.url, 'xstage_requests_total{outcome="deadline"}')
    timeout_s = max(2.0, 1.1 * _step_s(server.url) * STALL_STEPS)  # admitted: its predicted call fits
    assert timeout_s < 0.5 * STALL_STEPS, f"a step priced at {_step_s(server.url)} s: too busy a machine"
    started = time.monotonic()
    late = post_generation(server.url, prompt=STALL_PROMPT, num_inference_steps=STALL_STEPS, timeout_s=timeout_s)
    took = time.monotonic() - started
    assert late.status_code == 504, late.text
    assert late.json()["error"]["type"] == "timeout_error" and "deadline" in late.json()["error"]["message"]
    assert timeout_s <= took < timeout_s + 3, f"answered after {took:.1f} s, deadline {timeout_s:.1f} s"
    _next_good_request_is_answered(server.url)

    started = time.monotonic()
    long_call, box = start_long_call(server.url, STALL_PROMPT, 2 * STALL_STEPS)  # a call of 16 s or more in front
    waiting_s = max(1.0, 2 * _step_s(server.url))  # one step's call fits
    asked = time.monotonic()
    waiting = post_generation(server.url, num_inference_steps=1, timeout_s=waiting_s)
    assert waiting.status_code == 504 and time.monotonic() - asked < waiting_s + 2, waiting.text
    long_call.join(timeout=60)
    assert box[-1][0] == "completed" and time.monotonic() - started > STEP_TIMEOUT_S
    wait_until(lambda: metric_value(server.url, 'xstage_requests_total{outcome="deadline"}') == deadlines + 2,
           "both deadlines counted")
    _next_good_request_is_answered(server.url)


def test_a_client_that_goes_away_cancels_its_call(server: ServiceJob) -> None:
    """A streaming client that closes its connection at its second step, then one that stops waiting for its
    answer: each call stops within a step, every rank with it (the next request is answered at once, not after
    the rest of the call), and the metrics and the log say so."""
    cancelled = metric_value(server.url, 'xstage_requests_total{outcome="cancelled"}')
    steps_before = metric_value(server.url, "xstage_step_seconds_count")
    leaving, _ = start_long_call(server.url, STALL_PROMPT, 3 * STALL_STEPS, leave_after=2)
    leaving.join(timeout=30)
    started = time.monotonic()
    _next_good_request_is_answered(server.url)
    assert time.monotonic() - started < 10, "the call went on after its client left"
    assert metric_value(server.url, "xstage_step_seconds_count") - steps_before < 3 * STALL_STEPS

    with pytest.raises(httpx.ReadTimeout):
        post_generation(server.url, prompt=STALL_PROMPT, num_inference_steps=3 * STALL_STEPS, timeout=2)
    started = time.monotonic()
    _next_good_request_is_answered(server.url)
    assert time.monotonic() - started < 10, "the call went on after its client left"
    wait_until(lambda: metric_value(server.url, 'xstage_requests_total{outcome="cancelled"}') == cancelled + 2,
           "both calls counted as cancelled")
    assert server.output().count("the client went away; cancelled in its call") >= 2


def test_four_times_capacity_with_hostile_clients_for_a_minute(server: ServiceJob, tmp_path: Path) -> None:
    """bench_serve's hostile load on the real service: good requests at twice its capacity (back-to-back calls of
    the model's default size) and as many hostile ones (bad, oversized, past their deadline, disconnecting, in
    turn) for LOAD_S. Every good request is answered 200 or 429; every hostile one as its kind expects, in words;
    every request the service saw is counted by one outcome; the service is healthy after."""
    args = bench_serve.parse_args(["--url", server.url, "--out", str(tmp_path / "load"), "--capacity-factors", "2",
                                   "--duration", str(LOAD_S), "--hostile", "1"])
    before = _answered(server.url)
    with httpx.Client(base_url=server.url, timeout=120,
                      limits=httpx.Limits(max_connections=bench_serve.CLIENTS + 4)) as client:
        alone = bench_serve.closed_loop(client, args, 1, 4)
        capacity = 1 / statistics.median(s.call_s for s in alone)  # calls per second, back to back
        samples = bench_serve.poisson(client, args, 2 * capacity, 0, 2 * capacity, _service(server.url))
    expected = {"good": {200, 429}, "bad": {400, 422}, "oversized": {400}, "deadline": {200, 429, 504},
                "disconnect": {200, 429, bench_serve.GONE}}
    kinds = {kind: {s.status for s in samples if s.kind == kind} for kind in expected}
    for kind, statuses in kinds.items():
        assert statuses and statuses <= expected[kind], (kind, statuses)
    for sample in samples:
        assert sample.status in (200, bench_serve.GONE) or sample.message, sample
    assert 504 in kinds["deadline"] and bench_serve.GONE in kinds["disconnect"], kinds
    assert any(s.status == 200 for s in samples if s.kind == "good")
    wait_until(lambda: _answered(server.url) == before + 4 + len(samples),
           "every request counted by one outcome", timeout_s=60)
    assert metric_value(server.url, 'xstage_requests_total{outcome="failed"}') == 0
    assert metric_value(server.url, 'xstage_requests_total{outcome="unavailable"}') == 0
    _next_good_request_is_answered(server.url)
    run = bench_serve.summary(samples, {"load": "4x capacity, half hostile"})
    print(f"\n{len(samples)} requests in {LOAD_S} s at {4 * capacity:.2f}/s (capacity {capacity:.2f}/s):"
          f" good {run['answered']}, hostile {run['hostile']}, good latency {run['latency_s']}")


def test_the_benchmarks_hostile_load(server: ServiceJob, tmp_path: Path) -> None:
    """bench_serve --hostile, briefly: the good load alone, then with hostile clients besides, and the good
    requests' latency as ratios to the first."""
    prefix = tmp_path / "hostile"
    bench_serve.main(["--url", server.url, "--rate", "1", "--duration", "8", "--hostile", "2", "--warmup", "0",
                      "--out", str(prefix)])
    clean, hostile = json.loads(prefix.with_suffix(".json").read_text())
    assert clean["lost"] == 0 and hostile["lost"] == 0 and "hostile" not in clean
    assert hostile["clean_load"] == clean["load"] == "Poisson 1/s"
    assert set(hostile["hostile"]) == set(bench_serve.HOSTILE) and set(hostile["hostile"]["oversized"]) == {"400"}
    assert "latency p99 ratio" in prefix.with_suffix(".md").read_text()


def test_a_requests_price_names_the_first_field_over_its_deadline() -> None:
    """cost.bound alone: a step of 96 tokens priced 0.1 s; twice each side is 4x the tokens, 16x the price."""
    card = ModelCard(id="a-model", video=False, image="none", text_encoder=False, size_multiple=4, default_height=32,
                     default_width=48, fps=16, scale=ModelScale(height=32, width=48, frames=1, steps=4, size_multiple=4,
                                                                frames_per_latent=1, max_pixels=512 * 512))
    price = cost.StepCost(tokens=96, seconds=0.1)

    def refused(n: int = 1, deadline_s: float = 1.0, **options) -> str | None:
        request = GenerationRequest(id="r", prompt="p", n=n, seed=0, video=False, options=CallOptions(**options),
                                    deadline_s=deadline_s)
        try:
            cost.bound(request, card, price)
        except RequestError as error:
            return error.param
        return None

    assert refused(height=64, width=96) == "size"  # 1.6 s for one step
    assert refused(height=64, width=96, deadline_s=7) is None  # 4 steps: 6.4 s
    assert refused(height=16, width=16, steps=10) is None  # no cheaper than the step measured: 1 s
    assert refused(steps=20) == "num_inference_steps"
    assert refused(n=4, steps=4) == "n" and refused(n=2, steps=4) is None


def test_the_zoos_models_are_priced_from_their_configs() -> None:
    """The tiny random Flux: released at 128 latents x its VAE's 2 (so up to 512²), requests of the config's size
    and the zoo's steps; the tiny random Wan: its call's 480 x 832 (so up to 960 x 1664), 9 frames in 3 latent
    frames."""
    for config, max_pixels, tokens in (("tiny-flux", 512 * 512, 8 * 12), ("tiny-wan", 4 * 480 * 832, None)):
        loaded = loading.load_pipeline(None, config, loading.family_of(None, config), torch.device("cpu"),
                                       torch.float32)
        scale = model_card(loaded, config).scale
        assert scale.max_pixels == max_pixels and (scale.height, scale.width) == (32, 48), (config, scale)
        assert scale.steps == loading.ZOO_STEPS
        if tokens is not None:
            assert scale.tokens(CallOptions()) == tokens
        else:
            side = scale.tokens(CallOptions(num_frames=1))
            assert scale.frames == 9 and scale.tokens(CallOptions()) == 3 * side


def test_a_call_stops_once_none_of_its_requests_is_wanted() -> None:
    """Service._abandoned alone, at a step's end of a batch of three: the request whose client left answers 499
    and the one past its deadline 504 there, while the call goes on for the third; once its client leaves too,
    the call stops."""
    service, loop = pipeline_free_service(stub_card("none")), asyncio.new_event_loop()
    staying, leaving, late = (Job(GenerationRequest(id=name, prompt=name, n=1, seed=0, video=False,
                                                    deadline_s=deadline_s), loop)
                              for name, deadline_s in (("staying", 60), ("leaving", 60), ("late", 0)))
    leaving.gone = True
    assert not service._abandoned([staying, leaving, late])
    loop.run_until_complete(asyncio.sleep(0))
    assert (leaving.answer.result().status, late.answer.result().status) == (499, 504) and not staying.finished
    staying.gone = True
    assert service._abandoned([staying, leaving, late])
    counted = {outcome: service.metrics.registry.get_sample_value("xstage_requests_total", {"outcome": outcome})
               for outcome in ("cancelled", "deadline")}
    assert counted == {"cancelled": 2, "deadline": 1}
    service.liveness.stop()
    loop.close()
