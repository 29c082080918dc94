"""The package's layers import one way: a test that parses every import and fails on a cycle or an upward import.

Layers, bottom to top (``docs/architecture.md``): ``core`` < ``models`` < ``tasks`` < ``drafters`` <
``rollout`` < ``rl`` < ``data`` < ``callbacks`` < ``integrations`` < the top-level modules (``cli``,
``trainer_cli``, ``__init__``). A module may import its own layer and those below it, never one
above; and no two modules import each other, directly or in a circle. Every import counts: lazy ones
inside functions, relative ones and ``importlib.import_module`` of a literal name. No module is exempt.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lightning_tlt"
LAYERS = ("core", "models", "tasks", "drafters", "rollout", "rl", "data", "callbacks", "integrations")
TOP = len(LAYERS)  # cli.py, trainer_cli.py, __init__.py


def module_name(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) < 2 or parts[1] not in LAYERS:
        return TOP
    return LAYERS.index(parts[1])


def layer_name(module: str) -> str:
    return LAYERS[layer_of(module)] if layer_of(module) < TOP else "top"


def imports_of(path: Path, package: Path = PACKAGE) -> set[str]:
    """``lightning_tlt`` names imported anywhere in the file (module level or inside functions):
    ``import x``, ``from x import y`` (``x`` and ``x.y``, which may be a module; relative ones resolved
    against the file's package) and ``importlib.import_module("x")`` with a literal name."""
    tree = ast.parse(path.read_text())
    here = module_name(path, package).split(".")
    if path.name != "__init__.py":
        here = here[:-1]  # the file's package
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = here[: len(here) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found |= {name} | {f"{name}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            found.add(node.args[0].value)
    return {name for name in found if name == "lightning_tlt" or name.startswith("lightning_tlt.")}


def graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module's imported modules of the package (a name resolves to the longest module it names)."""
    modules = {module_name(p, package): p for p in package.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in imports_of(path, package):
            while imported not in modules and "." in imported:  # "lightning_tlt.x.Y" -> "lightning_tlt.x"
                imported = imported.rsplit(".", 1)[0]
            if imported in modules and imported != name and not (imported == "lightning_tlt" or name == "lightning_tlt"):
                targets.add(imported)
        edges[name] = targets
    return edges


def upward_imports(package: Path = PACKAGE) -> list[str]:
    return sorted(
        f"{src} ({layer_name(src)}) imports {dst} ({layer_name(dst)})"
        for src, dsts in graph(package).items() for dst in dsts if layer_of(dst) > layer_of(src)
    )


def test_no_upward_imports() -> None:
    upward = upward_imports()
    assert not upward, "\n".join(upward)


def test_every_kind_of_upward_import_is_caught(tmp_path: Path) -> None:
    """The check itself, on a small package whose core imports a layer above it in each way there is."""
    root = tmp_path / "lightning_tlt"
    for folder, module in (("core", "sampling"), ("drafters", "eagle"), ("rollout", "engine"), ("rl", "grpo"),
                           ("data", "sources"), ("callbacks", "metrics")):  # fmt: skip
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
        (root / folder / f"{module}.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "cli.py").write_text("")
    (root / "core" / "types.py").write_text(
        "import lightning_tlt.drafters.eagle\n"
        "from ..rollout import engine\n"
        "from lightning_tlt.rl.grpo import GRPOModule\n"
        "from . import sampling\n"  # its own layer: allowed
        "def lazy():\n"
        "    import importlib\n"
        "    from ..data.sources import load\n"
        "    return importlib.import_module('lightning_tlt.callbacks.metrics'), importlib.import_module('lightning_tlt.cli')\n"
    )
    upward = upward_imports(root)
    assert all(line.startswith("lightning_tlt.core.types (core) imports ") for line in upward), upward
    assert {line.split(" imports ")[1].split(" (")[0] for line in upward} == {
        "lightning_tlt.drafters.eagle", "lightning_tlt.rollout", "lightning_tlt.rollout.engine", "lightning_tlt.rl.grpo",
        "lightning_tlt.data.sources", "lightning_tlt.callbacks.metrics", "lightning_tlt.cli",
    }, upward


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
