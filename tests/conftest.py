import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in Triton's CPU interpreter (set before any kernel module is imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the suite computes tiny models on the CPU: a second thread gains little on ops that small and makes each op
    # wait for a core whenever the cores are shared (the ranks of the harness, other jobs on the machine); the ranks
    # run one thread each likewise (dist_harness), and the processes that tests start inherit the setting
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    # the libraries' objects, loaded by now, are left out of the cyclic garbage collector's passes: traversing them
    # made each full collection take about a second
    gc.freeze()
