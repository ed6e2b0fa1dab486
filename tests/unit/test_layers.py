"""The house's floors (`[tool.logfold.layers]` in pyproject.toml, the one place they are named):
every import of the project's code — at the top of a module, inside a function, or under
`TYPE_CHECKING` — goes to its own floor or one below it, and no modules or packages import each
other round in a circle."""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["logfold"]["layers"]
FLOORS: list[list[str]] = CONFIG["floors"]  # from the ground up: module prefixes on each


def modules() -> dict[str, Path]:
    """Every module of the project's packages (tests aside), by dotted name."""
    found = {}
    for prefix in (p for floor in FLOORS for p in floor):
        top = prefix.split(".")[0]
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = modules()


def floor_of(module: str) -> int:
    """The floor of `module`: that of the longest prefix naming it."""
    best, floor = -1, -1
    for i, prefixes in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), i
    assert floor >= 0, f"{module} is on no floor: name it in [tool.logfold.layers]"
    return floor


def imports(module: str) -> Iterator[tuple[str, int]]:
    """The project modules `module` imports, anywhere in it, with the line."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for name in names:
            target = _module(name)
            if target is not None and target != module:
                yield target, node.lineno


def _module(name: str) -> str | None:
    """The project module `name` is, or is in (`pkg.mod.Name` is in `pkg.mod`)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def edges() -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for module in MODULES:
        for target, _ in imports(module):
            # `import pkg.mod` also runs pkg/__init__: an arrow to the package's own init
            # module only when it is imported as such.
            found[module].add(target)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_on_a_floor() -> None:
    for module in MODULES:
        floor_of(module)


def test_no_import_goes_up_a_floor() -> None:
    up = sorted(
        {
            f"{module}:{line} imports {target} (floor {floor_of(target)} above {floor_of(module)})"
            for module in MODULES
            for target, line in imports(module)
            if floor_of(target) > floor_of(module)
        }
    )
    assert not up, "\n".join(up)


def test_no_modules_import_each_other_in_a_circle() -> None:
    graph = edges()
    found = cycles(graph)
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_no_packages_import_each_other_in_a_circle() -> None:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges().items():
        for target in targets:
            a, b = module.split(".")[0], target.split(".")[0]
            if a != b:
                graph[a].add(b)
    found = cycles(graph)
    assert not found, "\n".join(" <-> ".join(c) for c in found)
