"""Run a function on N real processes joined by a gloo group started from launcher-style environment
variables, the way torchrun starts them; fail the calling test with the workers' error or on a deadline.

Without a GPU the ranks are forked from a server process that imports the heavy libraries once (`PRELOADED`): a
freshly spawned rank spends seconds importing them, which made up most of the CPU suite's time. With a GPU they
are spawned (importing those libraries initialises CUDA, which a forked process cannot use). Each rank gets the
caller's environment as it is at the call, as a spawned process would."""
from __future__ import annotations

import contextlib
import faulthandler
import gc
import logging
import os
import pkgutil
import sys
import time
import traceback
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from xstage_dit import kernels
from xstage_dit.runtime.distributed import free_port

# every module that defines a Triton kernel: Triton reads TRITON_INTERPRET when a kernel is defined, so the test
# session (conftest.py) and the fork server import them all first, defining every kernel alike whatever a test later
# sets to steer the library's calls; then the zoo's tiny pipelines, built once (xstage_dit.testing.preload), and
# Dynamo, which every rank of a compile test would otherwise import anew
KERNEL_MODULES = [module.name for module in pkgutil.iter_modules(kernels.__path__, f"{kernels.__name__}.")]
PRELOADED = ["torch", "torch.distributed", "xstage_dit", *KERNEL_MODULES, "xstage_dit.testing.preload", "torch._dynamo"]
START_METHOD = "spawn" if torch.cuda.is_available() else "forkserver"
mp.set_forkserver_preload(PRELOADED)


def _worker(rank: int, world_size: int, port: int, deadline: float, environment: dict[str, str],
            fn: Callable[..., Any], args: tuple) -> None:
    # what the rank inherited from the server (the preloaded libraries' objects) is left out of the cyclic garbage
    # collector's passes: traversing it took about a second per collection and copied the shared memory pages
    gc.freeze()
    # a rank still running shortly before the caller's deadline (wall clock: a rank starts after the caller's
    # clock did) prints where each of its threads is stuck
    faulthandler.dump_traceback_later(max(1.0, deadline - time.time() - 10), exit=False)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(world_size))  # one node, unless the test pretends several
    torch.set_num_threads(1)
    # how far each rank got shows in the test's captured stderr when it fails or runs out of time
    try:
        fn(*args)
        print(f"rank {rank}: {fn.__name__} returned", file=sys.stderr, flush=True)
    except BaseException as error:
        # said before the group's teardown, which may itself hang and hide the failure; the failed call's locals
        # (a pipeline whose CUDA graphs hold NCCL collectives hangs the teardown: pytorch#115388) are let go
        print(f"rank {rank}: {fn.__name__} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        if dist.is_initialized():
            gc.collect()  # CUDA graphs holding NCCL collectives hang the destroy while they live (pytorch#115388)
            dist.destroy_process_group()
            print(f"rank {rank}: process group destroyed", file=sys.stderr, flush=True)
    # A passing worker exits here, without interpreter shutdown: library threads still alive at shutdown (as
    # torch.compile's can be: "terminate called without an active exception") must not fail a test whose
    # checks all passed. Failures never get here: they propagate to torch.multiprocessing, which reports them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextlib.contextmanager
def xstage_warnings() -> Iterator[list[str]]:
    """The warnings xstage_dit logs meanwhile (in a rank's process, where pytest's caplog does not reach)."""
    found: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: found.append(record.getMessage())
    logger = logging.getLogger("xstage_dit")
    logger.addHandler(handler)
    try:
        yield found
    finally:
        logger.removeHandler(handler)


def share_one_gpu() -> None:
    """This process's ranks share GPU 0 (also on a host with more GPUs): call in a worker before CUDA starts. The
    job's placement then has more ranks than GPUs; torch's flag lets symmetric memory map one device twice."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, deadline_s: float = 300.0) -> None:
    """Call fn(*args) on `world_size` processes; re-raise the first worker failure."""
    end = time.monotonic() + deadline_s
    context = mp.start_processes(
        _worker, args=(world_size, free_port(), time.time() + deadline_s, dict(os.environ), fn, args),
        nprocs=world_size, join=False, start_method=START_METHOD
    )
    while not context.join(timeout=1.0):
        if time.monotonic() > end:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in {deadline_s:.0f}s")
