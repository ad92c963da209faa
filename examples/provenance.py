"""Where a benchmark record came from: card, date, the code's commit, the whole launch command and library versions,
one dict for every example."""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence

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


# launchers whose command line starts the ranks: a rank names its parent's command, the launcher's arguments included
LAUNCHERS = ("torchrun", "accelerate", "torch.distributed.run", "torch.distributed.launch")
COMMIT_VARIABLE = "XSTAGE_COMMIT"  # names the commit where the code runs from a copy without .git (the device)


def readable_command(argv: Sequence[str]) -> list[str]:
    """A process's argv as a person types it: the interpreter as `python`, a launcher's entry script by its name
    (`python /usr/bin/torchrun ...` -> `torchrun ...`)."""
    if not argv:
        return []
    program = Path(argv[0]).name
    if not program.startswith("python"):
        return [program, *argv[1:]]
    if len(argv) > 1 and Path(argv[1]).name in LAUNCHERS:
        return [Path(argv[1]).name, *argv[2:]]
    return ["python", *argv[1:]]


def _process_command(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def launch_command() -> list[str]:
    """The command that started this run. Under a launcher (LOCAL_RANK set) that is the launcher's own command line,
    its arguments included (the rank's parent process); where it cannot be read, one rebuilt from the launcher's
    environment. Otherwise this process's command line, `-m` included."""
    if "LOCAL_RANK" not in os.environ:
        return readable_command(sys.orig_argv)
    parent = _process_command(os.getppid())
    if parent and any(Path(part).name in LAUNCHERS for part in parent[:3]):
        return readable_command(parent)
    nodes = os.environ.get("GROUP_WORLD_SIZE", "1")
    return ["torchrun", "--nnodes", nodes, "--nproc_per_node", os.environ.get("LOCAL_WORLD_SIZE", "1"), *sys.argv]


def code_commit(repository: Path = REPOSITORY) -> str:
    """The commit the code ran at: $XSTAGE_COMMIT where it is set (the device machine gets a copy of the working tree,
    whose .git, where one comes, is not this checkout's); else git's, `+dirty` where tracked files differ from it;
    "unknown" where neither tells."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repository), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()

    try:
        commit = git("rev-parse", "--short=12", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def provenance() -> dict[str, str]:
    """This process's card (its rank's GPU, or "cpu"), today's date, the code's commit, the whole command as
    launched (`launch_command`; paths relative to the repository and to $OUT) and the versions of torch, CUDA,
    Triton, diffusers and xstage_dit."""
    import torch  # here, not at import: generate.py takes OUTPUT_DIR from this module and answers --help at once

    device = xstage_dit.local_device()
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else None
    return {
        "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.date.today().isoformat(),
        "commit": code_commit(),
        "command": shlex.join(relative_command(launch_command(), REPOSITORY, out)),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": _version("triton"),
        "diffusers": _version("diffusers"),
        "xstage_dit": xstage_dit.__version__,
    }


def described(env: dict) -> str:
    """A record's heading sentence: its versions, the code's commit and its command."""
    return (f"torch {env['torch']} (CUDA {env['cuda']}), Triton {env['triton']}, diffusers {env['diffusers']}, "
            f"xstage_dit {env['xstage_dit']} at {env.get('commit', 'an unrecorded commit')}; `{env['command']}`.")


def write_records(records: list[dict], prefix: Path, title: str, method: str, table: list[str]) -> None:
    """PREFIX.json (the records) and PREFIX.md: a heading with the first record's card, ranks and date, its
    versions and command, `method` (how to read the numbers), then `table` (markdown lines), also printed."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(records, indent=1) + "\n")
    first = records[0]
    lines = [f"# {title}: {first['card']} x {first['ranks']}, {first['date']}", "",
             described(first) + " " + method, "", *table]
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(table))
