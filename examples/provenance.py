"""Where a benchmark record came from: card, date, command and library versions, one dict for every example."""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Sequence

import torch

import xstage_dit

REPOSITORY = Path(__file__).resolve().parent.parent


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


OUTPUT_DIR = Path("out")  # the examples' default outputs' folder, ignored by git in the checkout


def relative_command(argv: Sequence[str], repository: Path, out: Path | None) -> list[str]:
    """`argv` with each absolute path inside `out` (the run's output folder, $OUT) written relative to it, and each
    other one inside `repository` relative to the repository: a record names its command as it runs from any
    checkout, not the machine's folders."""
    roots = [root.resolve() for root in (out, repository) if root is not None]

    def relative(argument: str) -> str:
        path = Path(argument)
        if not path.is_absolute():
            return argument
        path = path.resolve()
        for root in roots:
            if path.is_relative_to(root):
                return path.relative_to(root).as_posix()
        return argument

    return [relative(argument) for argument in argv]


def provenance() -> dict[str, str]:
    """This process's card (its rank's GPU, or "cpu"), today's date, the command line as launched (torchrun
    when the launcher set LOCAL_RANK; paths relative to the repository and to $OUT) and the versions of torch,
    CUDA, Triton, diffusers and xstage_dit."""
    device = xstage_dit.local_device()
    launcher = "torchrun" if "LOCAL_RANK" in os.environ else "python"
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    return {
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "command": shlex.join([launcher, *relative_command(sys.argv, REPOSITORY, out)]),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "xstage_dit": xstage_dit.__version__,
    }


def write_records(records: list[dict], prefix: Path, title: str, method: str, table: list[str]) -> None:
    """PREFIX.json (the records) and PREFIX.md: a heading with the first record's card, ranks and date, its
    versions and command, `method` (how to read the numbers), then `table` (markdown lines), also printed."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    first = records[0]
    lines = [f"# {title}: {first['card']} x {first['ranks']}, {first['date']}", "",
             f"torch {first['torch']}, CUDA {first['cuda']}, diffusers {first['diffusers']}; `{first['command']}`. "
             + method, "", *table]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(table))
