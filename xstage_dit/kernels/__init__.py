"""Triton kernels. A kernel here knows shapes, strides and pointers, never models."""
from __future__ import annotations

import importlib.util
import os

import torch

_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None  # optional: torch's CUDA wheels bring it


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels run on `device`: a GPU, or the CPU in Triton's interpreter (the CPU tests)."""
    return _TRITON_INSTALLED and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
