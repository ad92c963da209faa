"""Readies a process for the CPU tests: the test session imports it first, and so does the fork server its ranks
come from (tests/dist_harness.py).

- Every module that defines a Triton kernel is imported now. Triton reads TRITON_INTERPRET when a kernel is
  defined: the tests define all of them interpreted, whatever a test later sets to steer the library's calls.
- Every tiny pipeline of the zoo is built once: the lazy imports a first build triggers in diffusers, transformers
  and peft (seconds of CPU) then happen here, once, instead of in every forked rank."""
import importlib
import pkgutil

from .. import kernels
from . import zoo

for _module in pkgutil.iter_modules(kernels.__path__, f"{kernels.__name__}."):
    importlib.import_module(_module.name)

for _name in zoo.ZOO:
    if _name.startswith("tiny-"):
        zoo.build_pipeline(_name)
