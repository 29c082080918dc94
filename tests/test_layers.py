"""The package's layers import one way: a test that parses every import and fails on a cycle or an upward import.

Layers, bottom to top (``docs/architecture.md``): ``core`` < ``models`` < ``tasks`` < ``drafters`` <
``rollout`` < ``rl`` < ``data`` < ``callbacks`` < ``integrations`` < the top-level modules (``cli``,
``trainer_cli``, ``__init__``). A module may import its own layer and those below it, never one
above; and no two modules import each other, directly or in a circle (lazy imports inside
functions count too). No module is exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_tlt"
LAYERS = ("core", "models", "tasks", "drafters", "rollout", "rl", "data", "callbacks", "integrations")
TOP = len(LAYERS)  # cli.py, trainer_cli.py, __init__.py


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return TOP
    return LAYERS.index(parts[1])


def imports_of(path: Path) -> set[str]:
    """``lightning_tlt`` modules imported anywhere in the file (module level or inside functions)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_tlt"):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("lightning_tlt")}
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path):
            # "from lightning_tlt.x import y" may name a module y: resolve to the longest known module
            while imported not in modules and "." in imported:
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name and not (imported == "lightning_tlt" or name == "lightning_tlt"):
                targets.add(imported)
        edges[name] = targets
    return edges


def test_no_upward_imports() -> None:
    upward = [
        f"{src} ({LAYERS[layer_of(src)] if layer_of(src) < TOP else 'top'}) imports {dst} "
        f"({LAYERS[layer_of(dst)] if layer_of(dst) < TOP else 'top'})"
        for src, dsts in graph().items() for dst in dsts if layer_of(dst) > layer_of(src)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_cycles() -> None:
    edges = graph()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_core_imports_nothing_else_of_the_kit() -> None:
    bad = sorted(f"{src} imports {dst}" for src, dsts in graph().items() if layer_of(src) == 0
                 for dst in dsts if layer_of(dst) != 0)
    assert not bad, bad
