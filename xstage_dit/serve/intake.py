"""What a request brings to rank 0's handlers: its API key (checked against the service's keys, from --api-key or a
file named by $XSTAGE_API_KEYS_FILE, in constant time) and its body, as the handlers take it: read up to the
service's byte limit (413 from its Content-Length, or, for a body sent without one, as soon as the bytes read pass
the limit: never read whole), parsed by its content type (JSON; a multipart form on the edits endpoint; 415 for
another), then validated with strict types: 400 for a body that does not parse or a field the endpoint does not
have, 422 for a field of the wrong type."""
from __future__ import annotations

import hmac
import json
import re
import typing
from pathlib import Path
from typing import AsyncIterator

from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request

from .schema import RequestError, Uploads

MAX_FORM_FILES = 16  # an edit's images and its mask
MAX_FORM_FIELDS = 32
_INTEGER = re.compile(r"-?[0-9]{1,19}")  # a form's number: ASCII digits, as JSON writes it
_NUMBER = re.compile(r"-?[0-9]{1,19}(\.[0-9]{1,19})?([eE][-+]?[0-9]{1,3})?")
_BOOLEANS = {"true": True, "false": False}


Body = typing.TypeVar("Body", bound=BaseModel)


async def read_json(request: Request, limit: int, model: type[Body]) -> Body:
    """The request's JSON body as `model`."""
    media = _media_type(request)
    if media and media != "application/json" and not media.endswith("+json"):
        raise RequestError(None, f"{request.url.path} takes application/json, got {media}", 415)
    body = b"".join([chunk async for chunk in _limited(request, limit)])
    try:
        data = json.loads(body)
    except RecursionError as error:
        raise RequestError(None, "the body is not JSON: it nests too deeply") from error
    except ValueError as error:  # invalid JSON or UTF-8, or a number of more than Python's 4300 digits
        raise RequestError(None, f"the body is not JSON: {error}") from error
    return validated(model, data, request.url.path)


async def read_form(request: Request, limit: int, model: type[Body]) -> tuple[Body, Uploads]:
    """A multipart form as OpenAI's edits endpoint takes it: its files `image` (several as `image[]`, as OpenAI's
    clients send them) and `mask`, and its other fields as `model`'s, each text converted to the field's type
    (ASCII digits for numbers, true or false)."""
    media = _media_type(request)
    if media != "multipart/form-data":
        raise RequestError(None, f"{request.url.path} takes multipart/form-data, got {media or 'no content type'}",
                           415)
    parser = MultiPartParser(request.headers, _limited(request, limit), max_files=MAX_FORM_FILES,
                             max_fields=MAX_FORM_FIELDS)
    try:
        form = await parser.parse()
    except MultiPartException as error:
        raise RequestError(None, f"the form does not parse: {error.message}") from error
    fields: dict[str, str] = {}
    images: list[bytes] = []
    mask: bytes | None = None
    try:
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                data = await value.read()
                if name in ("image", "image[]"):
                    images.append(data)
                elif name == "mask" and mask is None:
                    mask = data
                else:
                    raise RequestError(name, "not a file of this form (its files: image, one or more, and mask)")
            elif name in ("image", "image[]", "mask"):
                raise RequestError(name, "give it as a file")
            elif name in fields:
                raise RequestError(name, "given twice")
            else:
                fields[name] = value
    finally:
        await form.close()
    if not images:
        raise RequestError("image", "give the image to edit as a file")
    typed = {name: _typed(model, name, value) for name, value in fields.items()}
    return validated(model, typed, request.url.path), Uploads(tuple(images), mask)


def validated(model: type[Body], data: object, endpoint: str) -> Body:
    """`data` as `model`: 400 naming a field the endpoint does not have, 422 naming one of the wrong type."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        if first["type"] == "extra_forbidden":
            raise RequestError(param, f"{endpoint} has no field {param} (its fields: "
                                      f"{', '.join(model.model_fields)})") from error
        raise RequestError(param, f"{param or 'the body'}: {first['msg']}", 422) from error


def _typed(model: type[BaseModel], name: str, text: str) -> object:
    """A form field's text as the type of `model`'s field `name` (unchanged for a field it does not have)."""
    field = model.model_fields.get(name)
    kinds = set(typing.get_args(field.annotation)) | {field.annotation} if field is not None else set()
    if bool in kinds:
        if text not in _BOOLEANS:
            raise RequestError(name, f"must be true or false, got {text!r}", 422)
        return _BOOLEANS[text]
    if int in kinds:
        if not _INTEGER.fullmatch(text):
            raise RequestError(name, f"must be an integer, got {text!r}", 422)
        return int(text)
    if float in kinds:
        if not _NUMBER.fullmatch(text):
            raise RequestError(name, f"must be a number, got {text!r}", 422)
        return float(text)
    return text


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def _limited(request: Request, limit: int) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive; RequestError 413 once its Content-Length or the bytes so far pass
    `limit`."""
    # the connection is closed after the answer: the rest of the body is not read
    too_large = RequestError(None, f"the body is over this service's limit of {limit} bytes", 413,
                             headers={"Connection": "close"})
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        yield chunk


KEYS_FILE_ENV = "XSTAGE_API_KEYS_FILE"  # names a file of keys, one a line (# starts a comment)


def read_keys(path: str) -> list[str]:
    """The keys of a file, one a line; blank lines and lines starting with # are skipped."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key (None: it can): a header carries it, so printable ASCII without spaces."""
    if not key:
        return "a key is empty"
    if not key.isascii() or not key.isprintable() or " " in key:
        return "a key must be printable ASCII without spaces"
    return None


def key_matches(authorization: bytes | None, keys: tuple[bytes, ...]) -> bool:
    """Whether an Authorization header carries one of `keys` as its bearer token, compared with every key in
    constant time (no key's prefix shows in how long the answer takes)."""
    scheme, _, token = (authorization or b"").partition(b" ")
    token = token.strip() if scheme.lower() == b"bearer" else b""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token, key)
    return matched
