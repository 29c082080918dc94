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
SOURCES = {"e2e.py": "e2e/main.py"}
"""A script that is a shim of a package: where its code writes the results."""


def git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_a_smoke_run_leaves_the_checkout_clean() -> None:
    assert {"cotrain.py", "e2e.py", "engine.py", "speculative.py"} <= set(SCRIPTS)
    # each script's smoke output goes to benchmarks/results/smoke/: its own path, or _common.write_results'
    routed = '"smoke" if args.smoke else ""'
    assert '"smoke" if smoke else ""' in (ROOT / "benchmarks" / "_common.py").read_text()
    for script in SCRIPTS:
        text = (ROOT / "benchmarks" / SOURCES.get(script, script)).read_text()
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


def test_a_fit_log_is_read_back_into_the_numbers_it_printed(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import fit_log
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from lightning_tlt.callbacks.rollout_metrics import summary_line

    metrics = {"reward": 1.406, "reward_std": 0.509, "rewards/countdown_search_correctness/mean": 0.414,
               "rewards/countdown_search_format/mean": 0.992, "completions/mean_length": 1044.5,
               "completions/clipped_ratio": 0.01, "rollout/tokens_per_s": 13969.0, "spec/fraction": 0.17,
               "spec/accept_len": 2.04}  # fmt: skip
    lines = ["noise", summary_line(2, metrics, {"step_time": 1.84}, 80),
             summary_line(3, {"reward": 1.0, "rewards/countdown_search_correctness/mean": 0.25}, {}, 80)]
    log = "\n".join(lines + [summary_line(3, {"reward": 1.5, "rewards/countdown_search_correctness/mean": 0.5}, {}, 80)])
    steps = fit_log.parse_steps(log)  # the resumed run's line of step 3 replaces the first
    assert steps[0] == {"step": 2.0, "reward": 1.406, "reward_std": 0.509, "correctness": 0.414, "format": 0.992,
                        "mean_length": 1044.5, "clipped": 0.01, "tokens_per_s": 13969.0, "spec_fraction": 0.17,
                        "accept_len": 2.04, "step_s": 1.84}  # fmt: skip
    assert steps[1]["correctness"] == 0.5 and "step_s" not in steps[1] and len(steps) == 2
    summary = fit_log.summarize(steps, skip=0)
    assert summary["correctness_by_quarter"] == pytest.approx([0.414, 0.5])  # two steps: two runs of one
    seven = [{"step": float(i), "correctness": float(i)} for i in range(7)]  # no step left out: 0-1, 2-3, 4, 5-6
    assert fit_log.summarize(seven)["correctness_by_quarter"] == pytest.approx([0.5, 2.5, 4.0, 5.5])
    assert summary["step_s"] == 1.84 and summary["last_step"] == 3
    with pytest.raises(ValueError, match="no per-step lines"):
        fit_log.summarize(fit_log.parse_steps("nothing here"))


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
