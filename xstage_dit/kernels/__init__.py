"""Triton kernels. A kernel here knows shapes, strides and pointers, never models."""
from __future__ import annotations

import os

import torch


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels run on `device`: a GPU, or the CPU in Triton's interpreter (the CPU tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
