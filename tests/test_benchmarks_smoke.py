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


def test_the_e2e_carries_only_runs_measured_with_this_calls_settings(tmp_path: Path) -> None:
    import json

    e2e = _e2e()
    args = e2e.parse_args(["--cache-dir", str(tmp_path / "cache" / "lightning_tlt")])  # type: ignore[attr-defined]
    parts, trl = tmp_path / "runs", tmp_path / "trl"
    parts.mkdir(), trl.mkdir()
    old_args = {k: v for k, v in vars(args).items() if k not in ("stages", "stall_steps")}  # predates --stall-steps
    report = {"workload": e2e.workload_key(args), "args": old_args,  # type: ignore[attr-defined]
              "runs": [_run("nospec", [0.1, 0.2]), _run("tlt", [0.2, 0.3])], "trl_runs": [{"step_s": [300.0]}]}
    source = tmp_path / "old.json"
    source.write_text(json.dumps(report))
    # a's own setting differs: TRL is taken, the seed's a and b are not (a measured here would be paired
    # with a b from another machine's warm start)
    other = e2e.parse_args(["--cache-dir", args.cache_dir, "--stall-steps", "0"])  # type: ignore[attr-defined]
    assert e2e.carry(other, source, parts, trl) == ["trl"]  # type: ignore[attr-defined]
    assert json.loads((trl / "trl.json").read_text()) == {"step_s": [300.0]} and not list(parts.iterdir())
    # the report's missing setting counts as its default (4): the pair is taken under this call's settings
    assert e2e.carry(args, source, parts, trl) == ["nospec, seed 0", "tlt, seed 0"]  # type: ignore[attr-defined]
    b = json.loads((parts / "nospec_seed0.json").read_text())
    assert b["steps"] == [{"correctness": 0.1}, {"correctness": 0.2}] and b["carried_from"] == "old.json"
    assert (parts / e2e.run_file(args, "tlt", 0)).is_file()  # type: ignore[attr-defined]
    assert e2e.run_file(args, "tlt", 0) != e2e.run_file(other, "tlt", 0)  # type: ignore[attr-defined]
    assert e2e.run_file(args, "nospec", 0) == e2e.run_file(other, "nospec", 0)  # type: ignore[attr-defined]
    # a seed with one run cached here is left alone
    (parts / e2e.run_file(args, "tlt", 0)).unlink()  # type: ignore[attr-defined]
    assert e2e.carry(args, source, parts, trl) == []  # type: ignore[attr-defined]
    # another workload is refused, and a missing file before any work
    smaller = e2e.parse_args(["--cache-dir", args.cache_dir, "--size", "100m"])  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"its workload 'countdown_search-d3-0.5b-.*' is not this call's 'countdown_search-d3-100m-"):
        e2e.carry(smaller, source, parts, trl)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"--carry takes an earlier report's JSON file, got '.*nope.json' \(no such file\)"):
        e2e.parse_args(["--carry", str(tmp_path / "nope.json")])  # type: ignore[attr-defined]


def test_the_e2e_step_watchdog_ends_a_hung_step_with_every_threads_stack() -> None:
    code = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); import e2e\n"
        "r = e2e.StepRecorder('tlt', 32, 'c', time.perf_counter() + 600, watchdog_s=30, step_timeout_s=1)\n"
        "r.arm_watchdog()  # step 0: only the deadline (630 s away)\n"
        "time.sleep(1.5)\n"
        "r.arm_watchdog(after_first_step=True)  # later steps: 1 s\n"
        "time.sleep(30)\n"
        "print('not ended')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "not ended" not in run.stdout
    assert "Timeout (0:00:01)!" in run.stderr  # the stack follows, from <string>
    assert 'File "<string>", line 6' in run.stderr


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
