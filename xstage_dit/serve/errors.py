"""Every answer of the service that is not a 200 in OpenAI's shape, `{"error": {"message", "type", "param",
"code"}}`, whoever makes it: the service's checks, FastAPI and Starlette (unknown routes, wrong methods, anything
raised in a handler) and uvicorn's HTTP parser (a request that is not HTTP). `param` names the request field at
fault, or is null."""
from __future__ import annotations

import json
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .schema import RequestError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
               503: "service_unavailable", 504: "timeout_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error body as a dict: `type` from the status, `code` the status itself."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body."""
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def install_error_handlers(app: FastAPI, on_invalid: Callable[[], None]) -> None:
    """Answers in the one shape for the service's refusals (RequestError; `on_invalid` counts them), FastAPI's
    validation errors, Starlette's HTTP errors (404, 405) and anything else raised in a handler (500)."""
    @app.exception_handler(RequestError)
    async def refused(request: Request, error: RequestError) -> JSONResponse:
        on_invalid()
        return error_response(error.status, error.message, error.param, error.headers)

    @app.exception_handler(RequestValidationError)  # a typed route parameter that does not validate
    async def malformed(request: Request, error: RequestValidationError) -> JSONResponse:
        on_invalid()
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"][1:]) or None
        return error_response(422, f"{param or 'the request'}: {first['msg']}", param)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        message = error.detail
        if error.status_code == 404 and message == "Not Found":
            message = f"no endpoint {request.method} {request.url.path}"
        elif error.status_code == 405:
            message = f"{request.url.path} does not take {request.method}"
        return error_response(error.status_code, message, headers=error.headers)

    @app.exception_handler(Exception)  # Starlette raises the error on after this answer: uvicorn logs it
    async def crashed(request: Request, error: Exception) -> JSONResponse:
        return error_response(500, f"the service failed to answer: {type(error).__name__}: {error}")


def uvicorn_protocol() -> type | str:
    """uvicorn's C HTTP parser (httptools, the `serve` extra), answering a request it cannot parse in the one
    shape; uvicorn's own choice without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return "auto"

    class OneShapeProtocol(HttpToolsProtocol):
        def send_400_response(self, msg: str) -> None:
            body = json.dumps(error_body(400, msg)).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()

    return OneShapeProtocol
