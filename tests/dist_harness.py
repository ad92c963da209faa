"""Run a function on N real processes joined by a gloo group started from launcher-style environment
variables, the way torchrun starts them; fail the calling test with the workers' error or on a deadline."""
from __future__ import annotations

import faulthandler
import gc
import os
import sys
import time
from typing import Any, Callable

import torch.multiprocessing as mp

from xstage_dit.runtime.distributed import free_port


def _worker(rank: int, world_size: int, port: int, deadline_s: float, fn: Callable[..., Any], args: tuple) -> None:
    # a rank still running shortly before the caller's deadline prints where each of its threads is stuck
    faulthandler.dump_traceback_later(max(1.0, deadline_s - 10), exit=False)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        fn(*args)
    finally:
        if dist.is_initialized():
            gc.collect()  # CUDA graphs holding NCCL collectives hang the destroy while they live (pytorch#115388)
            dist.destroy_process_group()
    # A passing worker exits here, without interpreter shutdown: library threads still alive at shutdown (as
    # torch.compile's can be: "terminate called without an active exception") must not fail a test whose
    # checks all passed. Failures never get here: they propagate to torch.multiprocessing, which reports them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def share_one_gpu() -> None:
    """This process's ranks share GPU 0 (also on a host with more GPUs): call in a worker before CUDA starts."""
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, deadline_s: float = 300.0) -> None:
    """Call fn(*args) on `world_size` spawned processes; re-raise the first worker failure."""
    context = mp.start_processes(
        _worker, args=(world_size, free_port(), deadline_s, fn, args), nprocs=world_size, join=False,
        start_method="spawn"
    )
    end = time.monotonic() + deadline_s
    while not context.join(timeout=1.0):
        if time.monotonic() > end:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{world_size} ranks running {fn.__name__} did not finish in {deadline_s:.0f}s")
