"""Rank 0's HTTP API (FastAPI), OpenAI-compatible where OpenAI has the endpoint: POST /v1/images/generations,
POST /v1/images/edits (a multipart form), POST /v1/videos/generations (an MP4), GET /v1/models, GET /v1/files/{name}
(the outputs asked for as `url`), GET /health, GET /metrics. `stream: true` answers as Server-Sent Events:
`progress` (step i of n), then `completed` (the answer's JSON) or `error`. Every other answer than a 200 is
OpenAI's error body (errors.py); with API keys, every path but /health needs one (and /metrics, unless open)."""
from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .admission import Answer, Job, QueueFull
from .errors import error_body, error_response, install_error_handlers
from .intake import key_matches, read_form, read_json
from .schema import ImageBody, Uploads, VideoBody, check
from .service import Service, State, Unavailable, past_deadline

POLL_S = 0.1  # how often a waiting handler looks whether its client went away
KEPT_FILES = 256  # outputs answered as URLs stay fetchable until this many newer ones were made


@dataclass(frozen=True)
class Encoded:
    """A request's outputs as PNG or MP4 bytes, one per seed, and the seconds encoding them took."""

    payloads: list[bytes]
    seconds: float


@dataclass(frozen=True)
class OutputItem:
    """One output of an answer: its bytes (sent as base64) or the URL it can be fetched from."""

    seed: int
    payload: bytes | None = None
    url: str | None = None


def answer_json(items: list[OutputItem], extra: dict[str, str]) -> bytes:
    """An answer's JSON: OpenAI's `data` and `created`, then `extra`'s fields. Base64 is spliced in as bytes: it
    needs no escaping, and a JSON encoder would scan and copy megabytes of it."""
    data = [b'{"b64_json":"' + base64.b64encode(item.payload) + b'","seed":' + str(item.seed).encode() + b"}"
            if item.payload is not None else json.dumps({"url": item.url, "seed": item.seed}).encode()
            for item in items]
    fields = json.dumps({"created": int(time.time()), **extra}).encode()
    return b'{"data":[' + b",".join(data) + b"]," + fields[1:]


class FileStore:
    """The last KEPT_FILES outputs answered as URLs."""

    def __init__(self) -> None:
        self._files: OrderedDict[str, tuple[bytes, str]] = OrderedDict()

    def put(self, data: bytes, suffix: str) -> str:
        name = f"{uuid.uuid4().hex}.{suffix}"
        self._files[name] = (data, "video/mp4" if suffix == "mp4" else "image/png")
        while len(self._files) > KEPT_FILES:
            self._files.popitem(last=False)
        return name

    def get(self, name: str) -> tuple[bytes, str] | None:
        return self._files.get(name)


class KeyCheck:
    """ASGI middleware: a request to a path not in `open_paths` needs one of `keys` as its bearer token (401
    otherwise, before any handler sees it)."""

    def __init__(self, app: Callable, keys: tuple[str, ...], open_paths: frozenset[str]) -> None:
        self.app, self.keys, self.open_paths = app, tuple(key.encode() for key in keys), open_paths

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), None)
        if key_matches(authorization, self.keys):
            return await self.app(scope, receive, send)
        message = ("give an API key as `Authorization: Bearer KEY`" if authorization is None
                   else "the API key is not one of this service's")
        response = error_response(401, message, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="xstage_dit", version="1")
    files = FileStore()
    card, metrics, options = service.card, service.metrics, service.options
    install_error_handlers(app, on_invalid=lambda: metrics.count("invalid"))
    if options.api_keys:
        app.add_middleware(KeyCheck, keys=options.api_keys,
                           open_paths=frozenset({"/health", *(["/metrics"] if options.open_metrics else [])}))

    @app.post("/v1/images/generations", openapi_extra=_documented(ImageBody, "application/json"))
    async def images(request: Request) -> Response:
        return await _generate(await read_json(request, options.max_body_bytes, ImageBody), request)

    @app.post("/v1/images/edits", openapi_extra=_documented(ImageBody, "multipart/form-data"))
    async def edits(request: Request) -> Response:
        body, uploads = await read_form(request, options.max_body_bytes, ImageBody)
        return await _generate(body, request, uploads)

    @app.post("/v1/videos/generations", openapi_extra=_documented(VideoBody, "application/json"))
    async def videos(request: Request) -> Response:
        return await _generate(await read_json(request, options.max_body_bytes, VideoBody), request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": card.id, "object": "model", "owned_by": "xstage_dit", "video": card.video,
            "image": card.image, "max_images": card.max_images, "mask": card.mask, "service": service.describe()}]}

    @app.get("/v1/files/{name}")
    async def file(name: str) -> Response:
        found = files.get(name)
        if found is None:
            return error_response(404, f"no file {name} (outputs are kept until {KEPT_FILES} newer ones were "
                                       f"made)", "name")
        return Response(found[0], media_type=found[1])

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = service.state is State.READY
        body = {"status": service.state.value, "model": card.id, "ranks": service.channel.world,
                "queue": len(service.queue)}
        if not ready:
            body["reason"] = service.reason
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    async def _generate(body: ImageBody, request: Request, uploads: Uploads | None = None) -> Response:
        checked = check(body, card, options.limits, uuid.uuid4().hex, uploads)
        service.bound(checked)
        job = Job(checked, asyncio.get_running_loop())
        try:
            service.admit(job)
        except QueueFull as error:
            metrics.count("rejected")
            return error_response(429, str(error), headers={"Retry-After": str(error.retry_after_s)})
        except Unavailable as error:
            metrics.count("unavailable")
            return error_response(503, str(error))
        if body.stream:
            return StreamingResponse(_events(job, body, request), media_type="text/event-stream",
                                     headers={"x-request-id": checked.id})
        answer = await _wait(job, request)
        if answer is None:
            return error_response(499, "the client went away")
        if answer.status != 200:
            return error_response(answer.status, answer.error)
        encoded = await _encode(answer)
        headers = {"x-request-id": checked.id, **_timing(job, answer, encoded)}
        if checked.video and body.response_format != "url":  # a video's default answer: the MP4 itself
            headers["x-seed"] = str(answer.outputs.seeds[0])
            return Response(encoded.payloads[0], media_type="video/mp4", headers=headers)
        return Response(_result(encoded, answer, body, request), media_type="application/json", headers=headers)

    async def _encode(answer: Answer) -> Encoded:
        """The answer's PNGs or MP4, made in a worker thread: the ranks' loop goes on with the next call."""
        started = time.perf_counter()
        payloads = await asyncio.to_thread(answer.outputs.files)
        encoded = Encoded(payloads, time.perf_counter() - started)
        metrics.encode_time.observe(encoded.seconds)
        return encoded

    async def _wait(job: Job, request: Request) -> Answer | None:
        """The job's answer; None (and the job dropped, if it has not started) when the client goes away."""
        while True:
            done, _ = await asyncio.wait({job.answer}, timeout=POLL_S)
            if done:
                return job.answer.result()
            if _expired_waiting(job):
                return Answer(504, error=past_deadline(job))
            if await request.is_disconnected():
                job.gone = True
                return None

    async def _events(job: Job, body: ImageBody, request: Request) -> AsyncIterator[bytes]:
        try:
            while not job.answer.done() or not job.progress.empty():
                try:
                    progress = await asyncio.wait_for(job.progress.get(), POLL_S)
                except asyncio.TimeoutError:
                    if _expired_waiting(job):
                        yield _event("error", {"error": {"message": past_deadline(job), "code": 504}})
                        return
                    if await request.is_disconnected():
                        job.gone = True
                        return
                    continue
                yield _event("progress", {"step": progress.step, "steps": progress.steps})
            answer = job.answer.result()
            if answer.status == 200:
                encoded = await _encode(answer)
                yield _event("completed", _result(encoded, answer, body, request, _timing(job, answer, encoded)))
            else:
                yield _event("error", error_body(answer.status, answer.error))
        finally:
            if not job.answer.done() and not _expired_waiting(job):
                job.gone = True

    def _result(encoded: Encoded, answer: Answer, body: ImageBody, request: Request,
                extra: dict[str, str] | None = None) -> bytes:
        suffix = "mp4" if isinstance(body, VideoBody) else "png"
        items = [OutputItem(seed, url=f"{request.base_url}v1/files/{files.put(payload, suffix)}")
                 if body.response_format == "url" else OutputItem(seed, payload=payload)
                 for payload, seed in zip(encoded.payloads, answer.outputs.seeds)]
        return answer_json(items, extra or {})

    return app


def _documented(model: type[ImageBody], media_type: str) -> dict[str, Any]:
    """An endpoint's body in its OpenAPI description (/docs): the handlers read their bodies themselves (intake.py),
    so FastAPI does not see them."""
    schema = model.model_json_schema()
    if media_type == "multipart/form-data":  # the input image and mask as files
        files = {"type": "string", "format": "binary"}
        schema["properties"] |= {"image": {"anyOf": [files, {"type": "array", "items": files}]}, "mask": files}
        schema["required"] = [*schema.get("required", []), "image"]
    return {"requestBody": {"required": True, "content": {media_type: {"schema": schema}}}}


def _expired_waiting(job: Job) -> bool:
    """A request still waiting past its deadline: its handler answers 504 (the queue drops it when it comes to it,
    counting it)."""
    return job.started is None and time.monotonic() > job.deadline


def _timing(job: Job, answer: Answer, encoded: Encoded) -> dict[str, str]:
    """In seconds: the request's wait in the queue, its pipeline call, encoding its outputs, and the whole time
    from admission to its answer."""
    now = time.monotonic()
    return {"x-queue-seconds": f"{(job.started or now) - job.enqueued:.4f}",
            "x-call-seconds": f"{answer.outputs.call_s:.4f}", "x-encode-seconds": f"{encoded.seconds:.4f}",
            "x-total-seconds": f"{now - job.enqueued:.4f}"}


def _event(name: str, data: dict[str, Any] | bytes) -> bytes:
    """A Server-Sent Event whose data is `data`'s JSON (or `data` itself, JSON already)."""
    encoded = data if isinstance(data, bytes) else json.dumps(data).encode()
    return b"event: " + name.encode() + b"\ndata: " + encoded + b"\n\n"
