"""Where a benchmark record came from: card, date, command and library versions, one dict for every example."""
from __future__ import annotations

import datetime
import importlib.metadata
import os
import shlex
import sys

import torch

import xstage_dit


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def provenance() -> dict[str, str]:
    """This process's card (its rank's GPU, or "cpu"), today's date, the command line as launched (torchrun
    when the launcher set LOCAL_RANK) and the versions of torch, CUDA, Triton, diffusers and xstage_dit."""
    device = xstage_dit.local_device()
    launcher = "torchrun" if "LOCAL_RANK" in os.environ else "python"
    return {
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "command": shlex.join([launcher, *sys.argv]),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "xstage_dit": xstage_dit.__version__,
    }
