"""The ranks' loops. Rank 0 admits requests (its HTTP thread), takes batches from its queue, tells every rank to
run each one and answers each request; every other rank follows its commands. A call that raises on every rank
answers 500 and the service goes on; a rank that stops answering, or the job's store gone with its torchrun agent,
fails the service: its requests answer 503 and the ranks exit 1, so that torchrun or an orchestrator restarts the
job. SIGTERM (to the ranks, the agent, or both) drains: the running call finishes, waiting and new requests answer
503, and the ranks exit 0, within DRAIN_S of the call's end (or exit 1 with every thread's stack)."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from .admission import Answer, Job, JobQueue
from .calls import Outputs, StepReport, run_batch
from .loading import LoadedPipeline
from .metrics import ServiceMetrics
from .ranks import IDLE_S, CallStatus, Command, Liveness, RanksOutOfStep, SideChannel, silence_bound
from .schema import GenerationRequest, Limits, ModelCard

logger = logging.getLogger(__name__)

FAIL_GRACE_S = 1.0  # a failed service's answers get this long to reach their clients before the process exits


@dataclass(frozen=True)
class ServeOptions:
    """The service's knobs (its command line; `enable`'s are applied before it starts)."""

    host: str = "127.0.0.1"
    port: int = 8000
    queue_bound: int = 16
    max_batch: int = 1
    timeout_s: float = 600.0
    limits: Limits = Limits()
    enable: dict[str, Any] = field(default_factory=dict)  # what `enable` was given, for /v1/models to report
    max_body_bytes: int = 8 * 2**20  # a request's body, its images included
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # none: no key needed
    open_metrics: bool = False  # /metrics needs no key (for a Prometheus scraper)

    def describe(self, ranks: int) -> dict[str, Any]:
        return {"ranks": ranks, "queue_bound": self.queue_bound, "max_batch": self.max_batch,
                "timeout_s": self.timeout_s, "max_body_bytes": self.max_body_bytes, "keys": bool(self.api_keys),
                "enable": self.enable}


class State(Enum):
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


class Unavailable(Exception):
    """The service takes no new request (draining or failed)."""


class Service:
    """Rank 0's side: the queue, the state /health reports, and the loop that runs the batches."""

    def __init__(self, loaded: LoadedPipeline, card: ModelCard, options: ServeOptions, channel: SideChannel,
                 metrics: ServiceMetrics) -> None:
        self.loaded, self.card, self.options, self.channel, self.metrics = loaded, card, options, channel, metrics
        self.queue = JobQueue(options.queue_bound, options.max_batch, on_drop=self._dropped)
        self.state, self.reason, self.signal = State.READY, "", 0
        self.running: list[Job] = []
        self._lock = threading.Lock()
        self.liveness = Liveness(channel.rank, channel.world, silence_bound(options.timeout_s),
                                 on_failure=self._fail)

    # -- the HTTP thread's side
    def admit(self, job: Job) -> None:
        """Queue `job`, or raise Unavailable / QueueFull."""
        with self._lock:
            if self.state is not State.READY:
                raise Unavailable(self.reason)
            self.queue.put(job)
        self.metrics.queue_depth.set(len(self.queue))

    # -- the main thread's side
    def run(self) -> int:
        """Serve until drained (returns 0); a rank out of step ends the process with 1."""
        while True:
            if self.state is State.DRAINING:
                logger.warning("signal %d: draining (no call runs now; waiting and new requests answer 503, the "
                               "ranks stop)", self.signal)
                with self._lock:  # no request is admitted after this
                    waiting = self.queue.clear()
                self._answer_all(waiting, Answer(503, error=self.reason))
                self.channel.command(Command("stop"))
                self.liveness.stop()
                return 0
            batch = self.queue.take(IDLE_S)
            self.metrics.queue_depth.set(len(self.queue))
            try:
                if batch:
                    self._run(batch)
                else:
                    self.channel.command(Command("idle"))
            except RanksOutOfStep as error:
                self._fail(f"a rank stopped answering: {error}")

    def drain(self, signum: int, frame: object) -> None:
        """SIGTERM's and SIGINT's handler. A rank can get the signal twice at once (from whoever sent it and from
        torchrun's agent, which passes it on), and the second call can interrupt the first anywhere: it takes no
        lock and logs nothing; the loop does the rest once the running call has ended."""
        if self.state is State.READY:
            self.reason, self.signal = "the service is shutting down", signum
            self.state = State.DRAINING
            self.liveness.drain()

    def _run(self, jobs: list[Job]) -> None:
        started = time.monotonic()
        for job in jobs:
            job.started = started
            self.metrics.queue_time.observe(started - job.enqueued)
        self.running = jobs
        requests = [job.request for job in jobs]
        self.channel.command(Command("run", tuple(requests)))
        self.metrics.batch_size.observe(sum(r.n for r in requests))

        def on_step(step: int, steps: int, seconds: float) -> None:
            self.metrics.step_time.observe(seconds)
            for job in jobs:
                job.report(step, steps)

        outputs, error = call_on_this_rank(self.loaded, requests, self.liveness, self.options.timeout_s, on_step)
        statuses = self.channel.statuses(CallStatus(0, error))
        self.running = []
        self.queue.service_s = time.monotonic() - started
        failed = [s for s in statuses if s.error is not None]
        if failed:
            message = "; ".join(f"rank {s.rank}: {s.error}" for s in failed)
            self._answer_all(jobs, Answer(500, error=f"the pipeline call failed: {message}"))
            return
        for job, output in zip(jobs, outputs):
            self._answer(job, Answer(200, outputs=output))

    def _answer(self, job: Job, answer: Answer) -> None:
        outcome = {200: "ok", 500: "failed", 503: "unavailable"}[answer.status]
        self.metrics.count(outcome)
        if answer.status == 200:
            self.metrics.latency.observe(time.monotonic() - job.enqueued)
        job.finish(answer)

    def _answer_all(self, jobs: list[Job], answer: Answer) -> None:
        for job in jobs:
            self._answer(job, answer)

    def _dropped(self, job: Job) -> None:
        self.metrics.count("dropped")
        job.finish(Answer(499, error="the client went away"))

    def _fail(self, reason: str) -> None:
        """Answer every request 503, report the failure on /health, exit 1 (from whichever thread saw it first;
        another thread that sees it too waits for that exit)."""
        with self._lock:
            first = self.state is not State.FAILED
            if first:
                self.state, self.reason = State.FAILED, reason
        if first:
            logger.critical("the service failed: %s; exiting", reason)
            self._answer_all([*self.running, *self.queue.clear()], Answer(503, error=reason))
        time.sleep(FAIL_GRACE_S)
        logging.shutdown()
        os._exit(1)


def call_on_this_rank(loaded: LoadedPipeline, requests: list[GenerationRequest], liveness: Liveness,
                      timeout_s: float, on_step: StepReport | None = None) -> tuple[list[Outputs], str | None]:
    """This rank's share of one batch, bounded by `timeout_s`: (outputs, None), or ([], what it raised)."""
    liveness.arm(timeout_s, f"the pipeline call for requests {[r.id for r in requests]}")
    try:
        return run_batch(loaded, requests, on_step), None
    except Exception as error:  # the call's error is the request's answer; the service goes on
        logger.exception("rank %d: the pipeline call failed", liveness.rank)
        return [], f"{type(error).__name__}: {error}"
    finally:
        liveness.disarm()


def follow(loaded: LoadedPipeline, channel: SideChannel, timeout_s: float) -> int:
    """Every rank but 0: run rank 0's commands until it says stop (0); exit 1 when it stops answering."""
    liveness = Liveness(channel.rank, channel.world, silence_bound(timeout_s))

    def leave_to_rank_0(signum: int, frame: object) -> None:
        """This rank stops when rank 0 has drained; like rank 0's handler, it takes no lock and logs nothing."""
        liveness.drain()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, leave_to_rank_0)
    try:
        while True:
            command = channel.command()
            if command.kind == "stop":
                liveness.stop()
                return 0
            if command.kind == "run":
                _, error = call_on_this_rank(loaded, list(command.batch), liveness, timeout_s)
                channel.statuses(CallStatus(channel.rank, error))
    except RanksOutOfStep as error:
        logger.critical("rank %d: rank 0 stopped answering: %s; exiting", channel.rank, error)
        return 1

