"""The documentation against the code it describes: every module of patches/ and sp/ is named (by its path
relative to xstage_dit/, e.g. `sp/attention/fused.py`) in patches/README.md or docs/ARCHITECTURE.md, and every
such path they name exists; the README stays short and opens with the two commands that .ci/run shares with it;
relative links lead to files. Text only: nothing is imported."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "xstage_dit"
MODULE_DOCS = [ROOT / "patches" / "README.md", ROOT / "docs" / "ARCHITECTURE.md"]
DOCUMENTED_FOLDERS = ("patches", "sp")
README_LINES = 160
COMMANDS_WITHIN = 40
GENERATE = "torchrun --nproc_per_node 2 examples/generate.py"

# a module path as the docs write it, alone or after "xstage_dit/": `sp/plan.py` but not `mysp/plan.py`
_NAMED_PATH = r"(?:(?<=xstage_dit/)|(?<![\w/])){}(?![\w/])"


def _documented_modules() -> list[str]:
    """Every module of the documented folders, by its path relative to xstage_dit/; an empty file (a folder's
    `__init__.py` that only makes it a package) holds nothing to describe."""
    return sorted(path.relative_to(PACKAGE).as_posix() for folder in DOCUMENTED_FOLDERS
                  for path in (PACKAGE / folder).rglob("*.py") if path.read_text().strip())


def _module_docs() -> str:
    return "\n".join(doc.read_text() for doc in MODULE_DOCS)


def test_every_module_of_patches_and_sp_is_named_in_the_docs():
    docs = _module_docs()
    missing = [m for m in _documented_modules() if not re.search(_NAMED_PATH.format(re.escape(m)), docs)]
    assert not missing, f"named in neither {[str(d.relative_to(ROOT)) for d in MODULE_DOCS]}: {missing}"


def test_every_module_the_docs_name_exists():
    folders = "|".join(DOCUMENTED_FOLDERS)
    named = set(re.findall(_NAMED_PATH.format(rf"((?:{folders})/[\w/]+\.py)"), _module_docs()))
    assert named, "the module docs name no module"
    gone = sorted(path for path in named if not (PACKAGE / path).is_file())
    assert not gone, f"the docs name modules that do not exist: {gone}"


def _ci_commands() -> tuple[str, str]:
    """(install, test): .ci/run's pip install without its -q, and its pytest command, as a user types them."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    install = next(line for line in lines if line.startswith("pip install"))
    test = next(line for line in lines if line.startswith("python -m pytest"))
    return " ".join(word for word in install.split() if word != "-q"), test


def test_the_readme_is_short_and_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines, at most {README_LINES}"
    opening = "\n".join(lines[:COMMANDS_WITHIN])
    install, test = _ci_commands()
    for command in (install, test, GENERATE):
        assert command in opening, f"{command!r} is not in README.md's first {COMMANDS_WITHIN} lines"


def test_relative_links_lead_to_files():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "patches" / "README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            path = target.split("#", 1)[0]
            if path and "://" not in path and not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert not broken, broken
