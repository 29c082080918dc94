"""Benchmark ``--smoke`` runs write into a git-ignored folder, never beside the tracked results."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_a_smoke_run_leaves_the_checkout_clean() -> None:
    assert {"cotrain.py", "e2e.py", "engine.py", "speculative.py"} <= set(SCRIPTS)
    for script in SCRIPTS:  # each script's smoke output goes to benchmarks/results/smoke/
        assert '"smoke" if args.smoke else ""' in (ROOT / "benchmarks" / script).read_text(), script
    assert git("check-ignore", "-q", "benchmarks/results/smoke/any.json").returncode == 0
    before = git("status", "--porcelain", "--untracked-files=all", "benchmarks").stdout
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OUT": ""}
    argv = ["benchmarks/engine.py", "--size", "tiny", "--smoke", "--skip-hf", "--no-compile", "--no-graphs"]
    run = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    (wrote,) = [line.split(" ", 1)[1] for line in run.stdout.splitlines() if line.startswith("wrote ")]
    assert Path(wrote).parent == ROOT / "benchmarks" / "results" / "smoke"
    Path(wrote).unlink()
    assert git("status", "--porcelain", "--untracked-files=all", "benchmarks").stdout == before
