"""Rank 0's queue: requests in arrival order up to a bound, taken in batches of compatible requests, with each
request's answer and progress handed back to the HTTP handler that waits for it (another thread's event loop)."""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from .calls import Outputs
from .schema import GenerationRequest


@dataclass(frozen=True)
class Answer:
    """How a request ended: HTTP status 200 with its outputs, or an error status and why."""

    status: int
    outputs: Outputs | None = None
    error: str | None = None


@dataclass(frozen=True)
class Progress:
    step: int
    steps: int


@dataclass(eq=False)
class Job:
    """One admitted request, made by its HTTP handler on `loop`; the generation thread finishes it."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    answer: asyncio.Future = field(init=False)
    progress: asyncio.Queue = field(init=False)
    enqueued: float = field(default_factory=time.monotonic)
    started: float | None = None
    gone: bool = False  # the client went away: drop it if it has not started, else cancel its call
    finished: bool = False  # answered (the rank loop's side; the handler may have answered a waiting one itself)

    def __post_init__(self) -> None:
        self.answer = self.loop.create_future()
        self.progress = asyncio.Queue()

    @property
    def deadline(self) -> float:
        return self.enqueued + self.request.deadline_s

    def report(self, step: int, steps: int) -> None:
        self.loop.call_soon_threadsafe(self.progress.put_nowait, Progress(step, steps))

    def finish(self, answer: Answer) -> None:
        self.finished = True

        def settle() -> None:
            if not self.answer.done():
                self.answer.set_result(answer)

        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(settle)


class QueueFull(Exception):
    """The queue holds its bound; `retry_after_s` estimates when a place frees up."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"the queue is full; retry after {retry_after_s} s")
        self.retry_after_s = retry_after_s


class JobQueue:
    """FIFO of requests, at most `bound` of them admitted and not answered (waiting, or in the batch taken last),
    so that an admitted request waits behind at most `bound` - 1 others. `take` returns the oldest live request
    with the later ones that share its batch key, up to `max_batch` outputs; requests whose client went away or
    whose deadline has passed are handed to `on_drop` instead. The loop that takes a batch answers it before it
    takes the next."""

    def __init__(self, bound: int, max_batch: int, on_drop: Callable[[Job], None]) -> None:
        self.bound, self.max_batch, self.on_drop = bound, max_batch, on_drop
        self._jobs: list[Job] = []
        self._taken = 0  # requests in the batch taken last, until the next take
        self._ready = threading.Condition()
        self.service_s = 1.0  # the recent time of one call, for Retry-After

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, job: Job) -> None:
        with self._ready:
            admitted = len(self._jobs) + self._taken
            if admitted >= self.bound:
                raise QueueFull(max(1, round(self.service_s * admitted / self.max_batch)))
            self._jobs.append(job)
            self._ready.notify()

    def take(self, timeout_s: float) -> list[Job]:
        """The next batch, or [] after `timeout_s` without one (the last one taken has been answered)."""
        with self._ready:
            self._taken = 0
            self._ready.wait_for(lambda: self._jobs, timeout=timeout_s)
            now = time.monotonic()
            for job in [j for j in self._jobs if j.gone or j.deadline < now]:
                self._jobs.remove(job)
                self.on_drop(job)
            if not self._jobs:
                return []
            head = self._jobs.pop(0)
            batch, outputs = [head], head.request.n
            key = head.request.batch_key
            for job in list(self._jobs) if key is not None else []:
                if job.request.batch_key == key and outputs + job.request.n <= self.max_batch:
                    self._jobs.remove(job)
                    batch.append(job)
                    outputs += job.request.n
            self._taken = len(batch)
            return batch

    def clear(self) -> list[Job]:
        """Every waiting request, taken out."""
        with self._ready:
            jobs, self._jobs = self._jobs, []
            return jobs
