"""Library logging: one logger tree under "xstage_dit", warnings about fallbacks emitted once."""
from __future__ import annotations

import logging

logger = logging.getLogger("xstage_dit")
_already_warned: set[str] = set()


def warn_once(message: str) -> None:
    """Log `message` as a warning the first time it is seen in this process."""
    if message not in _already_warned:
        _already_warned.add(message)
        logger.warning(message)
