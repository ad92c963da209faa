"""A pytest plugin for running diffusers' own model tests as a peer check of xstage_dit (loaded with
`-p diffusers_peer`; tests/run_diffusers_peer.py runs it): with XSTAGE_PEER_ENABLE=1 every transformer xstage_dit
supports is enabled at degree 1 as soon as it is built (its class's __init__ returns) or loaded
(`ModelMixin.from_pretrained` returns); with XSTAGE_PEER_REPORT=FILE each test's outcome is written to FILE as
JSON ({test id: "passed" | "failed" | "skipped"}); with XSTAGE_PEER_COMPILE_ON_CPU=1 diffusers' torch.compile
tests run without an accelerator. Without these variables it does nothing."""
from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

_loading = 0  # from_pretrained calls in progress: the models they build are enabled once loaded, not before


@contextlib.contextmanager
def _loading_model() -> Iterator[None]:
    global _loading
    _loading += 1
    try:
        yield
    finally:
        _loading -= 1


def _enable_when_built(cls: type) -> Callable[[], None]:
    """`cls(...)` returns the model enabled (not a subclass's: its own __init__ does that); returns the undo."""
    import xstage_dit

    built = cls.__dict__["__init__"]

    @functools.wraps(built)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        built(self, *args, **kwargs)
        if type(self) is cls and not _loading:
            xstage_dit.enable(self)

    cls.__init__ = __init__
    return lambda: setattr(cls, "__init__", built)


def _enable_when_loaded(model_mixin: type, supported: tuple[type, ...]) -> Callable[[], None]:
    """`from_pretrained` returns a supported model enabled, after its weights are in; returns the undo."""
    import xstage_dit

    original = model_mixin.__dict__["from_pretrained"]
    load: Callable[..., Any] = original.__func__

    @functools.wraps(load)
    def from_pretrained(cls: type, *args: Any, **kwargs: Any) -> Any:
        with _loading_model():
            model = load(cls, *args, **kwargs)
        if type(model) in supported:
            xstage_dit.enable(model)
        return model

    model_mixin.from_pretrained = classmethod(from_pretrained)
    return lambda: setattr(model_mixin, "from_pretrained", original)


def install() -> Callable[[], None]:
    """Every supported transformer enabled as soon as it is built or loaded; returns the undo."""
    from diffusers import ModelMixin

    from xstage_dit.patches import supported_models

    undo = [_enable_when_built(cls) for cls in supported_models()]
    undo.append(_enable_when_loaded(ModelMixin, supported_models()))
    return lambda: [step() for step in reversed(undo)]


ACCELERATOR_GATE = "test requires a hardware accelerator"  # diffusers' require_accelerator skip reason


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """With XSTAGE_PEER_COMPILE_ON_CPU=1, diffusers' torch.compile tests run on the CPU too: their classes'
    accelerator gate is lifted (no other test's)."""
    if os.environ.get("XSTAGE_PEER_COMPILE_ON_CPU") != "1":
        return
    for item in items:
        cls = getattr(item, "cls", None)
        if cls is None or not any(base.__name__ == "TorchCompileTesterMixin" for base in cls.__mro__):
            continue
        for node in item.listchain():
            node.own_markers[:] = [mark for mark in node.own_markers
                                   if not (mark.name == "skipif" and mark.kwargs.get("reason") == ACCELERATOR_GATE)]


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("XSTAGE_PEER_ENABLE") == "1":
        install()
    if os.environ.get("XSTAGE_PEER_REPORT"):
        config.pluginmanager.register(OutcomeReport(Path(os.environ["XSTAGE_PEER_REPORT"])), "xstage-peer-report")


class OutcomeReport:
    """Each test's outcome: failed if any phase failed (an error in set-up or teardown included), else skipped if
    it was skipped, else passed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.skipped and self.outcomes.get(report.nodeid) != "failed":
            self.outcomes[report.nodeid] = "skipped"
        elif report.when == "call" and report.passed:
            self.outcomes.setdefault(report.nodeid, "passed")

    def pytest_sessionfinish(self) -> None:
        self.path.write_text(json.dumps(self.outcomes, indent=1, sort_keys=True) + "\n")
