"""The code's layout: imports point down (flows -> tasks -> marsrl_core), no package or module of
marsrl_core imports one that imports it back, and no module holds more than one idea's worth of lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGES = ("marsrl_core", "flows", "tasks")
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `path` imports when it runs (imports only for type checkers left out)."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name for name in names if name in known}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _unit(module: str) -> str:
    """A module's unit of layering: its subpackage of marsrl_core (or the module itself at the top)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "marsrl_core" else parts[0]


def test_no_import_cycles_and_imports_point_down():
    modules = _modules()
    imports = {name: _imports(path, modules) for name, path in modules.items()}
    assert _cycle({m: targets - {m} for m, targets in imports.items()}) is None
    units: dict[str, set[str]] = {}
    for module, targets in imports.items():
        for target in targets:
            if _unit(target) != _unit(module):
                units.setdefault(_unit(module), set()).add(_unit(target))
    assert (cycle := _cycle(units)) is None, f"packages import each other: {' -> '.join(cycle)}"
    upward = [
        (m, t)
        for m, targets in imports.items()
        for t in targets
        if (m.startswith("tasks") and t.startswith("flows"))
        or (m.startswith("marsrl_core") and t[:5] in ("flows", "tasks"))
    ]
    assert upward == []


def test_no_module_is_longer_than_one_idea():
    long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"modules over {MAX_LINES} lines: {long}"
