"""The package's floors (docs/ARCHITECTURE.md): a module imports only from floors below its own (and from its own
subpackage), and no modules import each other in a circle. Read from the source, imports inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "xstage_dit"
FLOORS = {
    "config": 0, "launcher": 0, "logging_utils": 0, "hooks": 0, "sizes": 0, "testing": 0,
    "runtime": 1, "burst_gap": 1, "kernels": 1, "fusions": 1,
    "cfg": 2, "vae": 2, "precision": 2,
    "sp": 3,
    "patches": 4, "probing": 4,
    "layers": 5,
    "api": 6,
    "serve": 7,
    "cli": 8,
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The xstage_dit modules `path` imports (a `from .x import name` counts as x.name where that is a module)."""
    own = _module_name(path)
    package = own if path.name == "__init__.py" else own.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            elif node.module and node.module.startswith("xstage_dit"):
                base = node.module
            else:
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if candidate in MODULES:
                    found.add(candidate)
                elif base != "xstage_dit":  # the package root: its compiled extension, not a floor
                    found.add(base)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("xstage_dit")}
    return found & MODULES.keys()


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _component(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def test_every_module_has_a_floor():
    components = {_component(m) for m in MODULES} - {""}
    assert components <= FLOORS.keys(), components - FLOORS.keys()


def test_no_module_imports_from_its_floor_or_above():
    wrong = []
    for module, path in MODULES.items():
        if module == "xstage_dit":  # the package's front door re-exports the API
            continue
        mine = _component(module)
        for imported in _imports(path):
            theirs = _component(imported)
            if theirs != mine and FLOORS[theirs] >= FLOORS[mine]:
                wrong.append(f"{module} (floor {FLOORS[mine]}) imports {imported} (floor {FLOORS[theirs]})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = {m: _imports(p) for m, p in MODULES.items() if m != "xstage_dit"}
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for nxt in sorted(graph.get(module, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_no_folder_is_wider_than_fourteen_modules():
    """A folder of the package holds at most 14 modules (its __init__ counted): wider ones hide their subsystems."""
    folders = [PACKAGE, *(path for path in PACKAGE.rglob("*") if path.is_dir() and path.name != "__pycache__")]
    wide = {str(folder.relative_to(PACKAGE)): count for folder in folders
            if (count := len(list(folder.glob("*.py")))) > 14}
    assert not wide, wide
