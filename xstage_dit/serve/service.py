"""The ranks' loops. Rank 0 warms up (a call that prices a step), admits requests (its HTTP thread), takes batches
from its queue, tells every rank to run each one and answers each request; every other rank follows its commands.
A call that raises on every rank answers 500 and the service goes on; at each step's end the ranks agree whether
the call stops there: once each of its requests is past its deadline (504) or its client went away, it stops, and
the service goes on. A rank that stops answering, a step that runs past --timeout-s, or the job's store gone with
its torchrun agent, fails the service: its requests answer 503 and the ranks exit 1, so that torchrun or an
orchestrator restarts the job. SIGTERM (to the ranks, the agent, or both) drains: the running call finishes,
waiting and new requests answer 503, and the ranks exit 0, within DRAIN_S of the call's end (or exit 1 with every
thread's stack)."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from enum import Enum
from typing import Any, Callable

import PIL.Image

from . import cost
from .admission import Answer, Job, JobQueue
from .calls import Cancelled, Outputs, StepReport, run_batch
from .loading import CallOptions, LoadedPipeline
from .metrics import ServiceMetrics
from .ranks import IDLE_S, CallStatus, Command, Liveness, RanksOutOfStep, SideChannel, silence_bound
from .schema import GenerationRequest, ModelCard, ServeOptions

logger = logging.getLogger(__name__)

FAIL_GRACE_S = 1.0  # a failed service's answers get this long to reach their clients before the process exits
WARMUP_STEPS = 2  # steps of each warm-up call
WARMUP_CALLS = 3  # the first one warms up (compilation, caches); the fastest of the others prices a step
GONE = "the client went away"


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
        self.step_cost: cost.StepCost | None = None  # measured by warm_up
        self._lock = threading.Lock()
        self.liveness = Liveness(channel.rank, channel.world, silence_bound(options.timeout_s),
                                 on_failure=self._fail)

    def describe(self) -> dict[str, Any]:
        """The service's options and the model's limits, for /v1/models."""
        scale, step = self.card.scale, self.step_cost
        limits = {} if scale is None else {
            "max_pixels": min(scale.max_pixels, self.options.limits.max_pixels), "default_steps": scale.steps}
        measured = {} if step is None else {"step_cost": {"tokens": step.tokens, "seconds": step.seconds}}
        return {**self.options.describe(self.channel.world), **limits, **measured}

    # -- the HTTP thread's side
    def bound(self, request: GenerationRequest) -> None:
        """RequestError where the request's predicted call time is longer than its deadline (once warmed up)."""
        if self.step_cost is not None and self.card.scale is not None:
            cost.bound(request, self.card, self.step_cost)

    def admit(self, job: Job) -> None:
        """Queue `job`, or raise Unavailable / QueueFull."""
        with self._lock:
            if self.state is not State.READY:
                raise Unavailable(self.reason)
            self.queue.put(job)
        self.metrics.queue_depth.set(len(self.queue))

    # -- the main thread's side
    def warm_up(self) -> None:
        """Calls of the model's default size on every rank, the fastest warm one timed: the price of a step that
        `bound` scales to each request. SystemExit (and the ranks stopped) where a call fails."""
        scale = self.card.scale
        if scale is None:
            logger.warning("%s has no default size in its call or its config: requests are bounded by the "
                           "service's limits and their deadlines, not by their predicted cost", self.card.id)
            return
        image = PIL.Image.new("RGB", (scale.width, scale.height), (127, 127, 127)) \
            if self.card.image == "required" else None
        options = CallOptions(height=scale.height, width=scale.width,
                              num_frames=scale.frames if self.card.video else None, steps=WARMUP_STEPS, image=image)
        request = GenerationRequest(id="warm-up", prompt="warm-up", n=1, seed=0, video=self.card.video,
                                    options=options)
        timed = []
        for _ in range(WARMUP_CALLS):
            outputs, statuses = self._call([request])
            failed = [s for s in statuses if s.error is not None]
            if failed:
                self.channel.command(Command("stop"))
                self.liveness.stop()
                raise SystemExit("xstage_dit.serve: the warm-up call failed: " +
                                 "; ".join(f"rank {s.rank}: {s.error}" for s in failed))
            timed.append(outputs[0].call_s)
        self.step_cost = cost.StepCost(scale.tokens(options), min(timed[1:]) / WARMUP_STEPS)
        logger.info("warmed up: a step of %d tokens takes at most %.4f s; a request whose predicted call is longer "
                    "than its deadline answers 400", self.step_cost.tokens, self.step_cost.seconds)

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
                self._fail(self.liveness.agent_gone() or f"a rank stopped answering: {error}")

    def drain(self, signum: int, frame: object) -> None:
        """SIGTERM's and SIGINT's handler. A rank can get the signal twice at once (from whoever sent it and from
        torchrun's agent, which passes it on), and the second call can interrupt the first anywhere: it takes no
        lock and logs nothing; the loop does the rest once the running call has ended."""
        if self.state is State.READY:
            self.reason, self.signal = "the service is shutting down", signum
            self.state = State.DRAINING
            self.liveness.drain()

    def _call(self, requests: list[GenerationRequest], on_step: StepReport | None = None,
              cancel: Callable[[], bool] = lambda: False) -> tuple[list[Outputs], list[CallStatus]]:
        """`requests` run as one call on every rank: rank 0's outputs and every rank's status."""
        self.channel.command(Command("run", tuple(requests)))
        outputs, error = call_on_this_rank(self.loaded, requests, self.liveness, self.channel,
                                           self.options.timeout_s, on_step, cancel)
        return outputs, self.channel.statuses(CallStatus(0, error))

    def _run(self, jobs: list[Job]) -> None:
        started = time.monotonic()
        for job in jobs:
            job.started = started
            self.metrics.queue_time.observe(started - job.enqueued)
        self.running = jobs
        requests = [job.request for job in jobs]
        self.metrics.batch_size.observe(sum(r.n for r in requests))

        def on_step(step: int, steps: int, seconds: float) -> None:
            self.metrics.step_time.observe(seconds)
            for job in jobs:
                job.report(step, steps)

        outputs, statuses = self._call(requests, on_step, lambda: self._abandoned(jobs))
        self.running = []
        self.queue.service_s = time.monotonic() - started
        failed = [s for s in statuses if s.error is not None]
        if failed:
            message = "; ".join(f"rank {s.rank}: {s.error}" for s in failed)
            self._answer_all(jobs, Answer(500, error=f"the pipeline call failed: {message}"))
            return
        for job, output in zip(jobs, outputs):
            self._answer(job, Answer(200, outputs=output))

    def _abandoned(self, jobs: list[Job]) -> bool:
        """At a step's end of the running call: its requests whose client went away answered 499, those past their
        deadline 504; True once none is left (the call stops after this step)."""
        now = time.monotonic()
        for job in jobs:
            if job.finished:
                continue
            if job.gone:
                logger.info("request %s: the client went away; cancelled in its call", job.request.id)
                self._answer(job, Answer(499, error=GONE))
            elif now > job.deadline:
                logger.info("request %s: past its deadline of %g s; cancelled in its call", job.request.id,
                            job.request.deadline_s)
                self._answer(job, Answer(504, error=past_deadline(job)))
        return all(job.finished for job in jobs)

    def _answer(self, job: Job, answer: Answer) -> None:
        """`answer` to a request not answered yet."""
        if job.finished:
            return
        outcome = {200: "ok", 499: "cancelled", 500: "failed", 503: "unavailable", 504: "deadline"}[answer.status]
        self.metrics.count(outcome)
        if answer.status == 200:
            self.metrics.latency.observe(time.monotonic() - job.enqueued)
        job.finish(answer)

    def _answer_all(self, jobs: list[Job], answer: Answer) -> None:
        for job in jobs:
            self._answer(job, answer)

    def _dropped(self, job: Job) -> None:
        """A waiting request whose client went away (dropped) or whose deadline passed (504)."""
        if job.gone:
            self.metrics.count("dropped")
            job.finish(Answer(499, error=GONE))
        else:
            self._answer(job, Answer(504, error=past_deadline(job)))

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


def past_deadline(job: Job) -> str:
    return f"the request ran past its deadline of {job.request.deadline_s:g} s (`timeout_s`)"


def call_on_this_rank(loaded: LoadedPipeline, requests: list[GenerationRequest], liveness: Liveness,
                      channel: SideChannel, timeout_s: float, on_step: StepReport | None = None,
                      cancel: Callable[[], bool] = lambda: False) -> tuple[list[Outputs], str | None]:
    """This rank's share of one batch, each step bounded by `timeout_s`, stopped after the step where rank 0's
    `cancel` says so: (outputs, None), ([], None) where it stopped, or ([], what it raised)."""
    what = f"the pipeline call for requests {[r.id for r in requests]}"
    liveness.arm(timeout_s, what)

    def stop() -> bool:
        liveness.arm(timeout_s, f"a step of {what}")  # a step is bounded, not the whole call
        return channel.agree(cancel() if channel.rank == 0 else False)

    try:
        return run_batch(loaded, requests, on_step, stop), None
    except Cancelled as stopped:
        logger.info("rank %d: %s %s", liveness.rank, what, stopped)
        return [], None
    except RanksOutOfStep:
        raise
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
                _, error = call_on_this_rank(loaded, list(command.batch), liveness, channel, timeout_s)
                channel.statuses(CallStatus(channel.rank, error))
    except RanksOutOfStep as error:
        why = liveness.agent_gone() or f"rank {channel.rank}: rank 0 stopped answering: {error}"
        logger.critical("%s; exiting", why)
        return 1

