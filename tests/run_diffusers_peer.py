"""Run diffusers' own transformer model tests with xstage_dit enabled, against the same tests on stock diffusers,
and list the tests that pass on stock but fail enabled (a peer check of the plugin; not part of the default test
run, since it needs a checkout of diffusers' tests).

    python tests/run_diffusers_peer.py PATH/TO/DIFFUSERS [--only flux.py chroma] [--out FILE] [-- PYTEST ARGS]

PATH/TO/DIFFUSERS is a checkout of diffusers' repository (its tests/ folder, ideally at the tag of the installed
version; the sdist on the package index does not ship the model tests). Every test file under
tests/models/transformers/ that names a transformer class xstage_dit supports runs twice in a process of its own:
stock, and with the plugin tests/diffusers_peer.py enabling each such model at degree 1 as soon as it is built or
loaded, diffusers' torch.compile tests included (their accelerator gate lifted on a CPU). Failures enabled that
tests/diffusers_peer_exceptions.txt excuses are counted apart, with their reason."""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXCEPTIONS = HERE / "diffusers_peer_exceptions.txt"


@dataclass
class FileResult:
    """One test file's outcomes: stock and enabled, by test id."""

    path: str
    stock: dict[str, str]
    enabled: dict[str, str]
    regressions: list[str] = field(default_factory=list)  # passed on stock, failed enabled, not excused
    excused: dict[str, str] = field(default_factory=dict)  # the same, excused: test id -> reason


def exceptions(path: Path = EXCEPTIONS) -> list[tuple[str, str]]:
    """(test id pattern, reason) per line `PATTERN | reason` of the exceptions file; # starts a comment."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            pattern, _, reason = (part.strip() for part in line.partition("|"))
            found.append((pattern, reason))
    return found


def test_files(checkout: Path, only: list[str]) -> list[Path]:
    """diffusers' transformer model test files that name a supported class (and any of `only` in their name)."""
    from xstage_dit.patches import supported_models

    names = re.compile(r"\b(" + "|".join(cls.__name__ for cls in supported_models()) + r")\b")
    folder = checkout / "tests" / "models" / "transformers"
    return [path for path in sorted(folder.glob("test_*.py"))
            if names.search(path.read_text()) and (not only or any(word in path.name for word in only))]


def run(checkout: Path, test_file: Path, enabled: bool, compile_on_cpu: bool,
        pytest_args: list[str]) -> dict[str, str]:
    """The outcomes of one test file run in a process of its own, stock or enabled."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "outcomes.json"
        environment = {**os.environ, "XSTAGE_PEER_REPORT": str(report), "XSTAGE_PEER_ENABLE": "1" if enabled else "0",
                       "XSTAGE_PEER_COMPILE_ON_CPU": "1" if compile_on_cpu else "0",
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), str(HERE.parent),
                                                                   os.environ.get("PYTHONPATH")]))}
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "diffusers_peer", "-p", "no:cacheprovider",
                        "-p", "no:warnings", str(test_file.relative_to(checkout)), *pytest_args],
                       cwd=checkout, env=environment, stdout=subprocess.DEVNULL, check=False)
        if not report.exists():
            raise SystemExit(f"run_diffusers_peer: pytest wrote no outcomes for {test_file} (enabled={enabled})")
        return json.loads(report.read_text())


def compare(path: str, stock: dict[str, str], enabled: dict[str, str], excused: list[tuple[str, str]]) -> FileResult:
    result = FileResult(path, stock, enabled)
    for test, outcome in sorted(stock.items()):
        if outcome != "passed" or enabled.get(test) != "failed":
            continue
        reason = next((why for pattern, why in excused if fnmatch.fnmatch(test, pattern)), None)
        if reason is None:
            result.regressions.append(test)
        else:
            result.excused[test] = reason
    return result


def counts(outcomes: dict[str, str]) -> str:
    return ", ".join(f"{sum(v == kind for v in outcomes.values())} {kind}" for kind in ("passed", "failed", "skipped"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkout", type=Path, help="a checkout of diffusers' repository (its tests/ folder)")
    parser.add_argument("--only", nargs="+", default=[], help="test files whose name contains one of these words")
    parser.add_argument("--out", type=Path, help="also write every outcome and the comparison here (JSON)")
    parser.add_argument("--no-compile-on-cpu", action="store_true",
                        help="keep diffusers' accelerator gate on its torch.compile tests (they are slow on a CPU)")
    parser.epilog = "Arguments after `--` go to pytest (e.g. -- -k lora)."
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    args.pytest_args = argv[split + 1:]
    if not (args.checkout / "tests" / "models" / "transformers").is_dir():
        parser.error(f"{args.checkout} has no tests/models/transformers: give the root of a diffusers checkout")
    files = test_files(args.checkout.resolve(), args.only)
    if not files:
        parser.error(f"no test file of a supported family in {args.checkout} matches --only {' '.join(args.only)}")
    excused = exceptions()
    results = []
    for test_file in files:
        stock, enabled = (run(args.checkout.resolve(), test_file, enable, not args.no_compile_on_cpu,
                              args.pytest_args) for enable in (False, True))
        result = compare(test_file.name, stock, enabled, excused)
        results.append(result)
        print(f"{test_file.name}: stock {counts(stock)}; enabled {counts(enabled)}; pass on stock but fail enabled: "
              f"{len(result.regressions)} (+{len(result.excused)} excused)", flush=True)
        for test in result.regressions:
            print(f"  {test}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([vars(r) for r in results], indent=1) + "\n")
    total = sum(len(r.regressions) for r in results)
    print(f"{total} test(s) pass on stock but fail enabled, in {len(results)} file(s)")
    sys.exit(1 if total else 0)


if __name__ == "__main__":
    main()
