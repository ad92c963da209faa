"""The service's HTTP surface under hostile clients: one torchrun job of 2 CPU ranks serving the tiny random Flux
Kontext (an input image optional) with API keys and a small body limit. Every refusal is OpenAI's error shape
naming the field at fault (or none), and the next good request is still answered. The edits endpoint is checked
with OpenAI's own client; inpainting and reference-image pipelines, and the video endpoint's URLs, in one process."""
from __future__ import annotations

import asyncio
import base64
import io
import os
import socket
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch

openai = pytest.importorskip("openai", reason="the edits endpoint is checked with OpenAI's client (the test extra)")

import httpx  # noqa: E402
from serve_job import FAIL_PROMPT  # noqa: E402
from service_client import (TIMEOUT_S, VIDEO_EXTRA, ServiceJob, decoded_pixels, end_job,  # noqa: E402
                            launch_service, pipeline_free_service, serve_in_process, stub_card, wait_until_ready)
from xstage_dit.serve.app import create_app  # noqa: E402
from xstage_dit.serve.intake import KEYS_FILE_ENV  # noqa: E402
from xstage_dit.serve.schema import ServeOptions  # noqa: E402

KEY, FILED_KEY = "sk-test-one", "sk-test-two"  # on the command line; in the keys file
BODY_LIMIT = 2**18  # --max-body-mb 0.25
GOOD = {"prompt": "a lighthouse", "num_inference_steps": 2, "seed": 1}


@pytest.fixture(scope="module")
def service(tmp_path_factory) -> ServiceJob:
    folder = tmp_path_factory.mktemp("serve-http")
    (folder / "keys").write_text(f"# the service's keys\n\n{FILED_KEY}\n")
    os.environ[KEYS_FILE_ENV] = str(folder / "keys")  # the job's environment is this process's
    try:
        job = launch_service(folder / "service.log", "--config", "tiny-flux-kontext", "--api-key", KEY,
                      "--max-body-mb", str(BODY_LIMIT / 2**20))
    finally:
        del os.environ[KEYS_FILE_ENV]
    try:
        wait_until_ready(job)
        yield job
    finally:
        end_job(job)


HTTP = httpx.Client(timeout=60, headers={"authorization": f"Bearer {KEY}"})


def _png(height: int = 40, width: int = 56, seed: int = 0) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(
        buffer, format="PNG")
    return buffer.getvalue()


def _blank_png(height: int, width: int) -> bytes:
    """A PNG of many pixels in few bytes."""
    buffer = io.BytesIO()
    PIL.Image.new("RGB", (width, height)).save(buffer, format="PNG")
    return buffer.getvalue()


def _refused(response: httpx.Response, status: int, param: str | None) -> dict:
    """The error of a refusal in OpenAI's shape: exactly its four fields, of their types."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json", response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert error["param"] == param, error
    return error


def _still_answers(job: ServiceJob) -> None:
    response = HTTP.post(f"{job.url}/v1/images/generations", json=GOOD)
    assert response.status_code == 200, response.text
    assert response.json()["data"][0]["seed"] == 1


NESTED = b"[" * 100_000


@pytest.mark.parametrize("content, content_type, status, param", [
    (NESTED, "application/json", 400, None),  # Python's JSON parser recurses
    (b'{"prompt": "a", "n": 2,}', "application/json", 400, None),  # not a byte offset
    (b'{"prompt": "a", "n": 1' + b"0" * 5000 + b"}", "application/json", 400, None),  # past int()'s digits
    (b'"a lighthouse"', "application/json", 422, None),
    (b'{"prompt": "a"}', "text/plain", 415, None),
    (b"prompt=a", "application/x-www-form-urlencoded", 415, None),
], ids=["nested", "comma", "digits", "a-string", "text", "urlencoded"])
def test_a_body_that_does_not_parse(service: ServiceJob, content: bytes, content_type: str, status: int,
                                    param: str | None) -> None:
    response = HTTP.post(f"{service.url}/v1/images/generations", content=content,
                         headers={"content-type": content_type})
    _refused(response, status, param)
    _still_answers(service)


@pytest.mark.parametrize("fields, status, param", [
    ({"n": "2"}, 422, "n"), ({"n": True}, 422, "n"), ({"n": 2.0}, 422, "n"), ({"seed": "1"}, 422, "seed"),
    ({"stream": "yes"}, 422, "stream"), ({"stream": 1}, 422, "stream"), ({"prompt": 7}, 422, "prompt"),
    ({"guidance_scale": "3"}, 422, "guidance_scale"), ({"num_inference_steps": 1.5}, 422, "num_inference_steps"),
    ({"size": "４８x３２"}, 400, "size"), ({"size": "48x32\n"}, 400, "size"),
    ({"size": "48x" + "9" * 5000}, 400, "size"),
    ({"num_frames": 5}, 400, "num_frames"), ({"quality": "hd"}, 400, "quality"), ({"mask": "bWFzaw=="}, 400, "mask"),
    ({"image": base64.b64encode(_blank_png(3000, 4000)).decode()}, 400, "image"),  # past --max-pixels, before decoding
])
def test_strict_fields(service: ServiceJob, fields: dict, status: int, param: str) -> None:
    response = HTTP.post(f"{service.url}/v1/images/generations", json={**GOOD, **fields})
    _refused(response, status, param)
    _still_answers(service)


def test_user_is_taken_and_ignored_and_a_float_is_a_float(service: ServiceJob) -> None:
    response = HTTP.post(f"{service.url}/v1/images/generations", json={**GOOD, "user": "u-1", "guidance_scale": 2})
    assert response.status_code == 200, response.text


def test_routes_and_methods(service: ServiceJob) -> None:
    _refused(HTTP.get(f"{service.url}/v1/images/generations"), 405, None)
    _refused(HTTP.delete(f"{service.url}/health"), 405, None)
    _refused(HTTP.get(f"{service.url}/v1/nothing"), 404, None)
    _refused(HTTP.get(f"{service.url}/v1/files/nothing.png"), 404, "name")
    _refused(HTTP.post(f"{service.url}/v1/images/generations", json={**GOOD, "model": "dall-e-3"}), 404, "model")
    _refused(HTTP.post(f"{service.url}/v1/videos/generations", json=GOOD), 400, "model")
    _still_answers(service)


def test_a_failed_call_and_a_request_uvicorn_cannot_parse(service: ServiceJob) -> None:
    _refused(HTTP.post(f"{service.url}/v1/images/generations", json={**GOOD, "prompt": FAIL_PROMPT}), 500, None)
    host, port = service.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"NOT HTTP \x00\r\n\r\n")
        answer = b""
        while chunk := connection.recv(4096):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"content-type: application/json" in head
    _refused(httpx.Response(400, headers={"content-type": "application/json"}, content=body), 400, None)
    _still_answers(service)


def test_a_body_over_the_limit_is_refused_before_it_is_read(service: ServiceJob) -> None:
    """413 from the Content-Length; and for a chunked body without one, once the bytes read pass the limit: the
    connection is closed, so a client that would send forever is cut off."""
    over = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    _refused(HTTP.post(f"{service.url}/v1/images/generations", content=over,
                       headers={"content-type": "application/json"}), 413, None)
    endless_sent = []

    def endless():
        yield b'{"prompt": "'
        while True:
            endless_sent.append(2**16)
            yield b"a" * 2**16

    try:
        response = HTTP.post(f"{service.url}/v1/images/generations", content=endless(), timeout=30,
                             headers={"content-type": "application/json"})
        assert "content-length" not in response.request.headers
        _refused(response, 413, None)
    except httpx.TransportError:  # the connection closed while the client still wrote
        pass
    assert sum(endless_sent) < 64 * BODY_LIMIT, "the body was read on after the limit"
    _refused(HTTP.post(f"{service.url}/v1/images/edits", files={"image": ("a.png", b"\0" * BODY_LIMIT)},
                       data={"prompt": "a"}), 413, None)  # images count
    _still_answers(service)


def test_keys(service: ServiceJob) -> None:
    """Every path but /health needs a key: one given on the command line or one of the keys file."""
    anonymous = httpx.Client(timeout=60)
    for method, path in (("POST", "/v1/images/generations"), ("POST", "/v1/images/edits"), ("GET", "/v1/models"),
                         ("GET", "/metrics"), ("GET", "/v1/files/x.png"), ("GET", "/v1/unknown")):
        error = _refused(anonymous.request(method, f"{service.url}{path}", json=GOOD), 401, None)
        assert error["type"] == "authentication_error"
    for header in (f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", KEY, f"Basic {KEY}", "Bearer"):
        _refused(anonymous.get(f"{service.url}/v1/models", headers={"authorization": header}), 401, None)
    assert anonymous.get(f"{service.url}/health").status_code == 200
    filed = anonymous.post(f"{service.url}/v1/images/generations", json=GOOD,
                           headers={"authorization": f"Bearer {FILED_KEY}"})
    assert filed.status_code == 200, filed.text
    models = HTTP.get(f"{service.url}/v1/models").json()["data"][0]
    assert models["service"]["keys"] is True and KEY not in str(models)
    _still_answers(service)


def _client(job: ServiceJob, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{job.url}/v1", api_key=key, max_retries=0, timeout=60)


def test_openais_client_generates_and_edits(service: ServiceJob) -> None:
    """`client.images.generate` and `client.images.edit` as an OpenAI user calls them (our fields as extra_body):
    the image to edit is the pipeline's input (another image, another output; the same seed, the same output)."""
    client = _client(service)
    generated = client.images.generate(prompt="a lighthouse", n=2, size="48x32", response_format="b64_json",
                                       extra_body={"seed": 5, "num_inference_steps": 2})
    assert [item.model_extra["seed"] for item in generated.data] == [5, 6]
    assert decoded_pixels(base64.b64decode(generated.data[0].b64_json)).shape == (32, 48, 3)

    def edit(image: bytes, **extra: Any) -> np.ndarray:
        answer = client.images.edit(image=("in.png", image, "image/png"), prompt="a lighthouse", size="48x32",
                                    extra_body={"seed": 5, "num_inference_steps": 2, **extra})
        return decoded_pixels(base64.b64decode(answer.data[0].b64_json))

    first, second = edit(_png(seed=1)), edit(_png(seed=2))
    assert first.shape == (32, 48, 3) and not np.array_equal(first, second)
    assert np.array_equal(edit(_png(seed=1)), first)
    url = client.images.edit(image=("in.png", _png(seed=1), "image/png"), prompt="a lighthouse", size="48x32",
                             response_format="url", extra_body={"seed": 5, "num_inference_steps": 2}).data[0].url
    assert np.array_equal(decoded_pixels(HTTP.get(url).content), first)
    with pytest.raises(openai.AuthenticationError):
        _client(service, "sk-wrong").images.generate(prompt="a lighthouse")
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.edit(image=("in.png", _png(), "image/png"), mask=("mask.png", _png(), "image/png"),
                           prompt="a lighthouse")
    assert refused.value.body["param"] == "mask"
    _still_answers(service)


@pytest.mark.parametrize("files, data, status, param", [
    ({"image": ("in.png", _png())}, {"prompt": "a", "n": "２"}, 422, "n"),  # full-width
    ({"image": ("in.png", _png())}, {"prompt": "a", "n": "1.0"}, 422, "n"),
    ({"image": ("in.png", _png())}, {"prompt": "a", "stream": "yes"}, 422, "stream"),
    ({"image": ("in.png", _png())}, {"prompt": "a", "size": "30x48"}, 400, "size"),
    ({"image": ("in.png", _png())}, {"prompt": "a", "style": "vivid"}, 400, "style"),
    ({"image": ("in.png", _png())}, {"prompt": "a", "image": "text"}, 400, "image"),
    ([("image[]", ("a.png", _png())), ("image[]", ("b.png", _png()))], {"prompt": "a"}, 400, "image"),
    ({"image": ("in.png", b"not an image")}, {"prompt": "a"}, 400, "image"),
    ({"other": ("in.png", _png())}, {"prompt": "a"}, 400, "other"),
    ({}, {"prompt": "a"}, 415, None),  # no file: a urlencoded form
    ({"mask": ("mask.png", _png())}, {"prompt": "a"}, 400, "image"),
    ([("image[]", (f"{i}.png", b"")) for i in range(17)], {"prompt": "a"}, 400, None),  # past the form's files
])
def test_bad_edits(service: ServiceJob, files, data: dict, status: int, param: str | None) -> None:
    _refused(HTTP.post(f"{service.url}/v1/images/edits", files=files, data=data), status, param)
    _still_answers(service)


def test_an_edit_needs_a_pipeline_that_takes_an_image() -> None:
    """A text-only pipeline answers 400 naming `image` (no pipeline runs: the check comes first); anything
    raised in a handler answers 500 in the one shape; with --open-metrics, /metrics needs no key; /openapi.json
    describes the bodies the handlers read themselves."""
    service = pipeline_free_service(stub_card("none"))
    service.options = ServeOptions(timeout_s=TIMEOUT_S, api_keys=(KEY,), open_metrics=True)

    def broken(job) -> None:
        raise RuntimeError("a bug")

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=create_app(service), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://service",
                                     headers={"authorization": f"Bearer {KEY}"}) as client:
            refused = await client.post("/v1/images/edits", files={"image": ("in.png", _png())}, data={"prompt": "a"})
            metrics = await client.get("/metrics", headers={"authorization": ""})
            described = await client.get("/openapi.json")
            service.admit = broken
            return [refused, metrics, described, await client.post("/v1/images/generations", json={"prompt": "a"})]

    refused, metrics, described, crashed = asyncio.run(asyncio.wait_for(ask(), 30))
    service.liveness.stop()
    form = described.json()["paths"]["/v1/images/edits"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert {"image", "mask", "prompt", "seed"} <= set(form["schema"]["properties"])
    _refused(refused, 400, "image")
    assert metrics.status_code == 200 and "xstage_requests_total" in metrics.text
    assert "RuntimeError: a bug" in _refused(crashed, 500, None)["message"]


def _in_process_edits(config: str, ask) -> list:
    """`config` served in this process; `ask(client)` gets an AsyncOpenAI client on it."""
    async def with_openai(client: httpx.AsyncClient) -> list:
        return await ask(openai.AsyncOpenAI(base_url="http://service/v1", api_key="none", http_client=client,
                                            max_retries=0))

    answers, box = serve_in_process(config, torch.device("cpu"), with_openai)
    assert box == [0]
    return answers


def test_an_inpainting_pipeline_takes_the_mask() -> None:
    """The tiny random Flux Fill: OpenAI's edit with a mask inpaints (another mask, another output); without a
    mask, or with guidance the pipeline has no argument for, 400 naming the field."""
    async def ask(client: openai.AsyncOpenAI) -> list:
        async def edit(mask_seed: int | None, **extra: Any) -> Any:
            mask = {} if mask_seed is None else {"mask": ("mask.png", _png(seed=mask_seed), "image/png")}
            try:
                return await client.images.edit(image=("in.png", _png(), "image/png"), prompt="a lighthouse",
                                                **mask, extra_body={"seed": 3, "num_inference_steps": 2, **extra})
            except openai.BadRequestError as error:
                return error.body
        return [await edit(1), await edit(2), await edit(None), await edit(1, guidance_scale=3.0)]

    first, second, unmasked, guided = _in_process_edits("tiny-flux-fill", ask)
    images = [decoded_pixels(base64.b64decode(answer.data[0].b64_json)) for answer in (first, second)]
    assert images[0].shape == (32, 48, 3) and not np.array_equal(*images)
    assert unmasked["param"] == "mask" and guided["param"] == "guidance_scale"


def test_a_reference_image_pipeline_takes_several_images() -> None:
    """The tiny random Qwen-Image Edit Plus: two images to edit from, sent as OpenAI's client sends a list."""
    async def ask(client: openai.AsyncOpenAI) -> list:
        images = [("a.png", _png(seed=1), "image/png"), ("b.png", _png(seed=2), "image/png")]
        return [await client.images.edit(image=images[:n], prompt="a lighthouse",
                                         extra_body={"seed": 3, "num_inference_steps": 1}) for n in (1, 2)]

    one, two = _in_process_edits("tiny-qwenimage-edit-plus", ask)
    assert not np.array_equal(*(decoded_pixels(base64.b64decode(answer.data[0].b64_json)) for answer in (one, two)))


@VIDEO_EXTRA
def test_a_video_answered_as_a_url() -> None:
    async def ask(client: httpx.AsyncClient) -> list:
        body = {"prompt": "a wave", "num_frames": 5, "seed": 2, "num_inference_steps": 2}
        linked = await client.post("/v1/videos/generations", json={**body, "response_format": "url"})
        return [linked, await client.get(linked.json()["data"][0]["url"]),
                await client.post("/v1/images/generations", json={"prompt": "a wave", "num_frames": 5})]

    (linked, video, image), box = serve_in_process("tiny-wan", torch.device("cpu"), ask)
    assert linked.json()["data"][0]["seed"] == 2
    assert video.headers["content-type"] == "video/mp4" and video.content[4:8] == b"ftyp"
    _refused(image, 400, "num_frames")
    assert box == [0]


def test_the_keys_options(tmp_path, monkeypatch, capsys) -> None:
    """Keys from --api-key and the keys file together; a file that cannot be read, or a key a header cannot
    carry, is refused at launch in argparse's words."""
    from xstage_dit.serve.__main__ import parse_args

    keys = tmp_path / "keys"
    keys.write_text(f"{FILED_KEY}\n# a comment\n\n")
    monkeypatch.setenv(KEYS_FILE_ENV, str(keys))
    args = parse_args(["--api-key", KEY, "--open-metrics", "--max-body-mb", "0.5"])
    assert args.api_key == [KEY, FILED_KEY] and args.open_metrics and args.max_body_mb == 0.5
    for argv, environment, words in ((["--api-key", "two words"], None, "printable ASCII without spaces"),
                                     ([], str(tmp_path / "missing"), KEYS_FILE_ENV),
                                     (["--max-body-mb", "0"], None, "--max-body-mb must be positive")):
        monkeypatch.setenv(KEYS_FILE_ENV, environment or str(keys))
        with pytest.raises(SystemExit) as exit:
            parse_args(argv)
        assert exit.value.code == 2 and words in capsys.readouterr().err
