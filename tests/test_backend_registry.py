"""The backend registry loads its own list of backend modules: with Triton each one offers its choice, in the
list's order, and without Triton asking for the fused backend says that it needs it."""
from __future__ import annotations

import subprocess
import sys

from xstage_dit.sp.attention.backends import BACKEND_MODULES, available_backends, backends


def test_every_listed_module_offers_its_choice_in_the_lists_order():
    assert available_backends() == sorted(module.name for module in BACKEND_MODULES)
    assert [backend.name for backend in backends()] == ["reference", "overlap", "fused"]


# the registry in a process where Triton cannot be imported: prints why the fused backend is unavailable
WITHOUT_TRITON = """
import sys; sys.modules["triton"] = None
import torch
from xstage_dit.sp.attention.backends import available_backends, resolve_backend

assert available_backends() == ["auto", "overlap", "reference"], available_backends()
try:
    resolve_backend("fused", torch.device("cpu"))
except ValueError as error:
    print(error)
"""


def test_a_backend_whose_dependency_is_missing_says_what_it_needs():
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("xstage_dit backend 'fused' needs triton: "), result.stdout
