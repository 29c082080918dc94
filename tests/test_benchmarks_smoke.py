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
    # each script's smoke output goes to benchmarks/results/smoke/: its own path, or _common.write_results'
    routed = '"smoke" if args.smoke else ""'
    assert '"smoke" if smoke else ""' in (ROOT / "benchmarks" / "_common.py").read_text()
    for script in SCRIPTS:
        text = (ROOT / "benchmarks" / script).read_text()
        assert routed in text or "write_results(results, " in text, script
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


def _e2e() -> object:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return e2e


def _run(name: str, correctness: list[float], error: str | None = None) -> dict[str, object]:
    return {"name": name, "seed": 0, "steps": [{"correctness": c} for c in correctness], "error": error}


def test_the_e2e_accuracy_judgement_refuses_what_cannot_show_a_loss() -> None:
    e2e = _e2e()
    judge = e2e.no_accuracy_loss  # type: ignore[attr-defined]
    # curves of zeros: equal, and yet nothing was learned or lost
    assert judge([_run("tlt", [0.0] * 5)], [_run("nospec", [0.0] * 5)])["judgement"] == (
        "cannot be judged: correctness is 0 at every step of a and b"
    )
    # an arm stopped by a policy that is no longer finite
    stopped = judge([_run("tlt", [0.1, 0.0], "FloatingPointError: ...")], [_run("nospec", [0.1, 0.2])])
    assert stopped["judgement"] == "cannot be judged: tlt seed 0 stopped early (see its error)"
    # a real comparison: a - b = (0, +0.1, -0.1, 0): mean 0, within 2 SE
    fine = judge([_run("tlt", [0.2, 0.4, 0.2, 0.3])], [_run("nospec", [0.2, 0.3, 0.3, 0.3])])
    assert fine["judgement"].startswith("no accuracy loss: within two standard errors of zero (a - b = +0.000")
    lower = judge([_run("tlt", [0.1, 0.1, 0.1, 0.1])], [_run("nospec", [0.5, 0.5, 0.6, 0.5])])
    assert lower["judgement"].startswith("accuracy LOSS: TLT lower by more than 2 SE")


def test_the_e2e_refuses_a_negative_stall_step_count_before_any_work() -> None:
    e2e = _e2e()
    assert e2e.parse_args(["--stall-steps", "0"]).stall_steps == 0  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"--stall-steps must be >= 0 .*got -1"):
        e2e.parse_args(["--stall-steps", "-1"])  # type: ignore[attr-defined]


def test_train_step_benchmark_compares_one_gradient_cut_two_ways(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import train_step
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    out = train_step.main(["--smoke", "--out", str(tmp_path / "t.json")])
    rows, tokens = out["summary"]["rows"], out["summary"]["tokens"]
    assert out["gradient_gap"] < 1e-5  # the same gradient, cut into 4 forwards of 4 rows or 2 packed ones
    assert (rows["forwards"], tokens["forwards"]) == (4, 2) and tokens["rows_per_forward"] == [8, 8]
    assert set(out["ratios"]) == {"tokens_over_rows_update", "cudnn_attention_speedup"}
    assert all(r > 0 for r in out["ratios"].values())
    with pytest.raises(ValueError, match="--rows, --tokens and --repeats must be >= 1"):
        train_step.main(["--smoke", "--tokens", "0"])
