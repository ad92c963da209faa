"""What crosses the service's ranks: rank 0's commands, its word at each step's end on whether the running call
stops there, and each call's outcome over a gloo group of their own
(bounded by its timeout, and no NCCL watchdog sees it while the service is idle), and each rank's heartbeat in the
job's store, so that rank 0 sees a rank gone silent, every rank sees the store gone (its torchrun agent died) and
its own call or drain run past its bound."""
from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Literal

import torch
import torch.distributed as dist

from ..runtime.distributed import waiting_for
from .schema import GenerationRequest

logger = logging.getLogger(__name__)

IDLE_S = 1.0  # rank 0 tells the ranks it is idle this often, so their wait for its next command never times out
BEAT_S = 0.5  # each rank's heartbeat
SILENT_S = 10.0  # a rank or store silent this long (or timeout_s, if shorter) has failed
DRAIN_S = 10.0  # after SIGTERM, a rank ends within this long of its running call's end (or of the signal)


def silence_bound(timeout_s: float) -> float:
    """How long a rank or the job's store may be silent before the service fails."""
    return min(SILENT_S, timeout_s)


@dataclass(frozen=True)
class Command:
    """Rank 0's word to every rank: run a batch, keep waiting, or stop."""

    kind: Literal["run", "idle", "stop"]
    batch: tuple[GenerationRequest, ...] = ()


@dataclass(frozen=True)
class CallStatus:
    """How one rank's call went: None, or what it raised."""

    rank: int
    error: str | None


class RanksOutOfStep(RuntimeError):
    """A rank did not answer over the service's group: the ranks can no longer make the same calls."""


class SideChannel:
    """The service's own gloo group across the job's ranks; every wait on it gives up after `timeout_s`."""

    def __init__(self, timeout_s: float) -> None:
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.group = (dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
                      if self.world > 1 else None)

    def command(self, command: Command | None = None) -> Command:
        """Rank 0 sends `command`; every other rank receives it."""
        if self.group is None:
            return command
        box = [command]
        try:
            with waiting_for("the service's next command from rank 0"):
                dist.broadcast_object_list(box, src=0, group=self.group)
        except RuntimeError as error:
            raise RanksOutOfStep(str(error)) from error
        return box[0]

    def agree(self, stop: bool) -> bool:
        """Rank 0's `stop` on every rank, at the end of a step of the running call (every rank asks after the same
        step, so that they stop it after the same one)."""
        if self.group is None:
            return stop
        word = torch.tensor([int(stop)], dtype=torch.uint8)
        try:
            with waiting_for("rank 0's word on whether the running call stops after this step"):
                dist.broadcast(word, src=0, group=self.group)
        except RuntimeError as error:
            raise RanksOutOfStep(str(error)) from error
        return bool(word.item())

    def statuses(self, status: CallStatus) -> list[CallStatus]:
        """Every rank's status of the call just made (all ranks wait here: afterwards they are in step)."""
        if self.group is None:
            return [status]
        gathered: list[CallStatus | None] = [None] * self.world
        try:
            with waiting_for("every rank's outcome of the service's pipeline call"):
                dist.all_gather_object(gathered, status, group=self.group)
        except RuntimeError as error:
            raise RanksOutOfStep(str(error)) from error
        return gathered


class Liveness:
    """A daemon thread per rank: it bumps this rank's counter in the job's store; on rank 0 it reads the others'
    counters. A failure: a call armed with `arm` that runs past its deadline; (on rank 0) a rank whose counter has
    not moved for `silent_after_s`; this rank's torchrun agent gone, or the store failing to answer within
    `silent_after_s` (the agent that holds it is gone): the job is over; after `drain`, the rank still running
    DRAIN_S after its call ended. On a failure: `on_failure(why)` once, or without it the process ends with
    exit 1."""

    def __init__(self, rank: int, world: int, silent_after_s: float,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.rank, self.world, self.silent_after_s = rank, world, silent_after_s
        self.on_failure = on_failure or _exit
        self._deadline: float | None = None
        self._drain_until: float | None = None
        self._store = _store(silent_after_s) if world > 1 else None
        # under torchrun, the agent that started this rank (an orphan's parent is another process)
        self._agent = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None
        self._stop = threading.Event()
        self._prefix = f"xstage_serve/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/" \
                       f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/beat/"
        self._thread = threading.Thread(target=self._run, name="xstage-serve-liveness", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * BEAT_S)
        self._store = None

    def arm(self, seconds: float, what: str) -> None:
        self._deadline, self._what = time.monotonic() + seconds, what

    def disarm(self) -> None:
        self._deadline = None
        if self._drain_until is not None:
            self._drain_until = time.monotonic() + DRAIN_S

    def drain(self) -> None:
        """The job is ending: from now on the store may go first (torchrun's agent may end before this rank) and
        silent ranks no longer matter once no call runs, but the rank must end within DRAIN_S of its running
        call's end, or of now."""
        if self._drain_until is None:
            self._drain_until = time.monotonic() + DRAIN_S

    def _run(self) -> None:
        seen = {r: (0, time.monotonic()) for r in range(self.world) if r != self.rank}
        while not self._stop.is_set():
            failure = self._overrun() or self._silence(seen)
            if failure is not None:
                self.on_failure(failure)
                return
            self._stop.wait(BEAT_S)

    def _overrun(self) -> str | None:
        now, deadline = time.monotonic(), self._deadline
        if deadline is not None and now > deadline:
            return f"rank {self.rank}: {self._what} ran past its bound"
        if deadline is None and self._drain_until is not None and now > self._drain_until:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            return f"rank {self.rank}: still running {DRAIN_S:.0f} s after its drain began or its last call ended " \
                   f"(every thread's stack is above)"
        return None

    def agent_gone(self) -> str | None:
        """This rank's torchrun agent gone, in words (the root cause of whatever else failed with it: the job's
        store and the other ranks go with the agent); None while it runs, or outside torchrun."""
        if self._agent is not None and os.getppid() != self._agent:
            return f"rank {self.rank}: its torchrun agent (process {self._agent}) is gone"
        return None

    def _silence(self, seen: dict[int, tuple[int, float]]) -> str | None:
        draining = self._drain_until is not None
        if not draining and (gone := self.agent_gone()):
            return gone
        if self._store is None:
            return None
        try:
            silent = self._beat(seen)
        except (RuntimeError, dist.DistError) as error:
            if draining:  # torchrun's agent ends with the job: its store may be gone before this rank is
                self._store = None
                return None
            return f"rank {self.rank}: the job's store at {os.environ.get('MASTER_ADDR')}:" \
                   f"{os.environ.get('MASTER_PORT')} is gone or silent (the torchrun agent that holds it ended?): " \
                   f"{str(error).splitlines()[0]}"
        return None if draining and self._deadline is None else silent

    def _beat(self, seen: dict[int, tuple[int, float]]) -> str | None:
        """Bump this rank's counter; on rank 0, read the others': a rank gone silent, or None."""
        self._store.add(self._prefix + str(self.rank), 1)
        if self.rank != 0:
            return None
        now = time.monotonic()
        for rank, (count, since) in seen.items():
            current = self._store.add(self._prefix + str(rank), 0)
            if current != count:
                seen[rank] = (current, now)
            elif now - since > self.silent_after_s:
                return f"rank {rank} stopped answering (no heartbeat for {self.silent_after_s:.0f} s)"
        return None


def _exit(why: str) -> None:
    logger.critical("%s; exiting", why)
    logging.shutdown()
    os._exit(1)


def _store(timeout_s: float) -> dist.Store:
    """A client of the job's rendezvous store (torchrun's), apart from the process group's."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=timeout_s))
