"""The service's API keys (--api-key, or a file named by $XSTAGE_API_KEYS_FILE): where they come from, what one
may be, and the constant-time check of a request's Authorization header against them."""
from __future__ import annotations

import hmac
from pathlib import Path

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
