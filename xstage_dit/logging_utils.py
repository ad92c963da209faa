"""Library logging: one logger tree under "xstage_dit", warnings about fallbacks emitted once."""
from __future__ import annotations

import contextlib
import logging
from typing import Iterator

logger = logging.getLogger("xstage_dit")
_already_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log `message` as a warning the first time it is seen in this process."""
    if message not in _already_warned:
        _already_warned.add(message)
        logger.warning(message)


def warnings_seen() -> frozenset[str]:
    """The messages `warn_once` has said in this process."""
    return frozenset(_already_warned)


@contextlib.contextmanager
def fresh_warnings() -> Iterator[None]:
    """Inside the block `warn_once` says each message again the first time, as if none had been said (a test that
    checks a warning does not depend on the tests before it); after it, what was said before counts again."""
    before = set(_already_warned)
    _already_warned.clear()
    try:
        yield
    finally:
        _already_warned.clear()
        _already_warned.update(before)
