"""What crosses the service's ranks: rank 0's commands and each call's outcome over a gloo group of their own
(bounded by its timeout, and no NCCL watchdog sees it while the service is idle), and each rank's heartbeat in the
job's store, so that rank 0 sees a rank gone silent and every rank sees its own call run past its bound."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Literal

import torch.distributed as dist

from ..runtime.distributed import waiting_for
from .schema import GenerationRequest

logger = logging.getLogger(__name__)

IDLE_S = 1.0  # rank 0 tells the ranks it is idle this often, so their wait for its next command never times out
BEAT_S = 0.5  # each rank's heartbeat


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
    counters. A call armed with `arm` that runs past its deadline, or (on rank 0) a rank whose counter has not moved
    for `silent_after_s`, is a failure: `on_failure(why)` once, or without it the process ends with exit 1."""

    def __init__(self, rank: int, world: int, silent_after_s: float,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.rank, self.world, self.silent_after_s = rank, world, silent_after_s
        self.on_failure = on_failure or _exit
        self._deadline: float | None = None
        self._store = _store() if world > 1 else None
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

    def _run(self) -> None:
        seen = {r: (0, time.monotonic()) for r in range(self.world) if r != self.rank}
        while not self._stop.is_set():
            deadline = self._deadline
            failure = f"rank {self.rank}: {self._what} ran past its bound" \
                if deadline is not None and time.monotonic() > deadline else None
            if failure is None and self._store is not None:
                try:
                    failure = self._beat(seen)
                except (RuntimeError, dist.DistError) as error:  # the store is gone: the job is ending
                    logger.debug("rank %d: heartbeat failed: %s", self.rank, error)
            if failure is not None:
                self.on_failure(failure)
                return
            self._stop.wait(BEAT_S)

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


def _store() -> dist.Store:
    """A client of the job's rendezvous store (torchrun's), apart from the process group's."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=timedelta(seconds=30))
