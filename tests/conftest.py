import gc
import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter (set before any kernel module is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)


def pytest_collection_finish(session):
    # the libraries' objects, loaded by now, are left out of the cyclic garbage collector's passes: traversing them
    # made each full collection take about a second
    gc.freeze()
