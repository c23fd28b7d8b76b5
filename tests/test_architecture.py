"""The layers of docs/design/architecture.md hold in the code: no import runs back up a layer,
no two modules import each other (directly or round a loop), and the page names every folder.

Read statically from the source with ``ast`` (imports inside functions count; those under
``if TYPE_CHECKING:`` do not, as they never run).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Dict, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainbridge"

# Lower number, lower layer. A module may import its own part and any lower layer; the
# parts of one layer stand beside each other and import none of each other, except SIDEWAYS.
LAYERS = {
    # what everything may use: the one-line error, the version
    "errors": 0, "version": 0,
    # optional packages, users' own classes by name, the random streams
    "optional": 1, "plugins": 1, "random_state": 1,
    # which launcher started this process; what the API and trainbridge.hvd share (the timeout,
    # the watchdog thread, atomic files)
    "launch": 2, "runtime": 2,
    # the collective libraries, Horovod's API on them, and the built-in workloads' pieces
    "backends": 3, "hvd": 3, "data": 3, "models": 3,
    # the public API, and the tasks built from data and models
    "api": 4, "tasks": 4,
    # the engine of trainbridge train, on the API
    "training": 5,
    # the command line
    "cli": 6,
    # import trainbridge, python -m trainbridge, python -m trainbridge.train
    "__init__": 7, "__main__": 7, "train": 7,
}
SIDEWAYS = {("hvd", "backends")}  # trainbridge.hvd names a broken real Horovod as the backend does


def module_name(path: Path) -> Tuple[str, bool]:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if is_package else parts), is_package


def imported_modules(path: Path, modules: Set[str]) -> Set[str]:
    """The trainbridge modules ``path`` imports (``from pkg import module`` names the module)."""
    name, is_package = module_name(path)
    tree = ast.parse(path.read_text())
    type_only = {id(node) for branch in ast.walk(tree)
                 if isinstance(branch, ast.If) and "TYPE_CHECKING" in ast.unparse(branch.test)
                 for node in ast.walk(branch)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if is_package else name.split(".")[:-1]
                here = here[:len(here) - (node.level - 1)]
                base = ".".join(here + ([node.module] if node.module else []))
            targets = [(base, alias.name) for alias in node.names]
        else:
            continue
        for target, member in targets:
            if member and f"{target}.{member}" in modules:
                found.add(f"{target}.{member}")
            elif target in modules:
                found.add(target)
    found.discard(name)
    return found


def import_graph() -> Dict[str, Set[str]]:
    paths = {module_name(path)[0]: path for path in PACKAGE.rglob("*.py")}
    return {name: imported_modules(path, set(paths)) for name, path in paths.items()}


def part(module: str) -> str:
    """The folder (or top-level module) of ``module``: trainbridge.api.job -> api; trainbridge -> __init__."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_part_of_the_package_has_a_layer():
    parts = {part(name) for name in import_graph()}
    assert parts <= set(LAYERS), f"give these a layer here and in docs/design/architecture.md: {parts - set(LAYERS)}"


def test_no_import_runs_back_up_a_layer_or_sideways():
    wrong = []
    for module, imports in sorted(import_graph().items()):
        for target in sorted(imports):
            a, b = part(module), part(target)
            if a == b or (a, b) in SIDEWAYS:
                continue
            if LAYERS[b] >= LAYERS[a]:
                wrong.append(f"{module} imports {target} ({a}, layer {LAYERS[a]} -> {b}, layer {LAYERS[b]})")
    assert not wrong, "\n".join(wrong)


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    assert not cycles(import_graph())


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_architecture_page_names_every_folder():
    page = (ROOT / "docs" / "design" / "architecture.md").read_text()
    named = set(re.findall(r"^  ([a-z_]+)/ ", page, re.MULTILINE))
    folders = {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    assert named == folders, (f"folders not on the page: {folders - named}; "
                              f"on the page, not in the code: {named - folders}")
