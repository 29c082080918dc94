"""The benchmark scripts import their siblings (``_common``, ``e2e``) as top-level modules: load them so."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module, with ``benchmarks/`` on the path while it imports."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture
def benchmark_script() -> Callable[[str], ModuleType]:
    """`load_benchmark`, as a fixture."""
    return load_benchmark
