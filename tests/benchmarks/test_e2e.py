"""benchmarks/e2e/: the report computed from its units (hand-derived ratios, bootstrap intervals, provenance),
every committed report recomputed, the options, ``--carry``, the watchdog, and the whole pipeline's smoke run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
LEGACY = {"e2e_h200_20261202.json", "e2e_h200_20261203.json", "e2e_h200_20261203_d3.json",
          "e2e_h200_20261203_d3_bf16_drafter.json", "e2e_h200_20261203_d3_fp32.json", "e2e_h200_20261203_staged.json",
          "e2e_h200_20261203_warmup.json", "e2e_h200_20261204_two_seeds.json"}
"""The reports written before format 2, left as they were (docs/benchmarks.md quotes them as written)."""


@pytest.fixture(scope="module")
def e2e() -> ModuleType:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import e2e
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return e2e


def _step(wall: float, tokens: float = 100.0, correctness: float = 0.25, **extra: float) -> dict[str, Any]:
    return {"wall_s": wall, "tokens": tokens, "rollout_s": wall / 2, "tail_s": wall / 4, "bulk_s": wall / 4,
            "reward_s": 0.0, "train_s": wall / 2, "boundary_s": 0.0, "drafter_s": 0.0, "lengths": [int(tokens)],
            "correctness": correctness, "reward": correctness, "accept_len": math.nan, "spec_fraction": 0.0,
            "eagle_drafting": 0.0, **extra}


def _unit(name: str, seed: int, walls: list[float], tokens: list[float] | None = None, **extra: float
          ) -> dict[str, Any]:
    tokens = tokens or [100.0] * len(walls)
    return {"name": name, "seed": seed, "total_s": sum(walls), "error": None, "graph_stats": None,
            "start": "as_new_process", "steps": [_step(w, t, **extra) for w, t in zip(walls, tokens)],
            "provenance": {"commit": "abc", "date": "2026-12-04T00:00:00+00:00", "device": "cpu", "measured": True}}


def _trl(step_s: list[float]) -> dict[str, Any]:
    return {"name": "trl", "seed": 0, "step_s": step_s, "total_s": sum(step_s), "lengths": [[10, 20]] * len(step_s),
            "correctness": [0.1] * len(step_s), "generation_dtype": "bfloat16",
            "provenance": {"commit": "abc", "date": "2026-12-04", "device": "cpu", "measured": True}}


def test_the_ratios_are_the_hand_derived_ones_per_seed_and_pooled(e2e: ModuleType) -> None:
    # seed 0: a's steady steps 2 s, b's 4 s: 2x; whole run b 5+4+4+4+4 = 21 over a 10+4+2+2+2 = 20: 1.05x;
    # a drew half b's tokens in its steady steps: per token 50/2 over 100/4 = 1x (a length-fair figure)
    a0 = _unit("tlt", 0, [10, 4, 2, 2, 2], [100, 100, 50, 50, 50], accept_len=3.0, drafter_steps=12.0,
               decode_slowdown=0.04)
    b0 = _unit("nospec", 0, [5, 4, 4, 4, 4, 4])  # one step more than a: cut to a's five (the same prompts)
    # seed 1: a 3 s, b 3 s steady: 1x; step 0: 8 over 4
    a1, b1 = _unit("tlt", 1, [8, 3, 3, 3], accept_len=5.0, drafter_steps=20.0, decode_slowdown=0.06), \
        _unit("nospec", 1, [4, 3, 3, 3])
    out = e2e.section([a0, b0, a1, b1], [_trl([30.0, 10.0, 12.0])], skip=2)
    seed0, seed1, pooled = out["per_seed"]["0"], out["per_seed"]["1"], out["ratios"]
    assert seed0["a_over_b_step"] == pytest.approx(2.0) and seed0["a_over_b_run"] == pytest.approx(21 / 20)
    assert seed0["a_over_b_tokens_per_s"] == pytest.approx(1.0) and seed0["tlt_step0_over_nospec_step0"] == 2.0
    assert seed0["steps"] == [5] and seed1["a_over_b_step"] == pytest.approx(1.0)
    # constant steady steps: every resample gives the same ratio, so the interval is that point
    assert seed0["a_over_b_step_ci95"] == pytest.approx([2.0, 2.0])
    # pooled: b's steady 4+4+4 + 3+3 = 18 over a's 2+2+2 + 3+3 = 12; run 21+13 over 20+17; step 0 9 over 18
    assert pooled["a_over_b_step"] == pytest.approx(18 / 12) and pooled["a_over_b_run"] == pytest.approx(34 / 37)
    assert pooled["tlt_step0_over_nospec_step0"] == pytest.approx(18 / 9)
    # resampled within each seed (each keeps its count of steps), whose steady steps are constant: a point
    assert pooled["a_over_b_step_ci95"] == pytest.approx([1.5, 1.5])
    # a's summary: the whole runs and the first step, means over its seeds; issue 31's figures from its steps
    a = out["summary"]["tlt"]
    assert a["step0_s"] == 9.0 and a["run_s"] == pytest.approx((20 + 17) / 2) and a["step_s"] == pytest.approx(12 / 5)
    assert a["accept_len_mean"] == pytest.approx((3 * 3 + 5 * 2) / 5)
    assert a["drafter_steps_per_rl_step"] == pytest.approx((12 * 3 + 20 * 2) / 5)
    assert a["decode_slowdown_frac"] == pytest.approx((0.04 * 3 + 0.06 * 2) / 5)
    assert "accept_len_mean" not in out["summary"]["nospec"]  # b speculates never: no such figure
    # c: steady = its steps after the first (11 s), against a's steady step; first over first
    assert out["summary"]["trl"]["step_s"] == 11.0
    assert pooled["tlt_over_trl_step"] == pytest.approx(11 / (12 / 5))
    assert pooled["tlt_over_trl_first_step"] == pytest.approx(30 / 9)
    assert pooled["nospec_over_trl_step"] == pytest.approx(11 / (18 / 5))
    # one TRL step: no steady figure, and the first step never stands in for it
    one = e2e.section([a0, b0], [_trl([30.0])], skip=2)
    assert one["summary"]["trl"]["step_s"] is None and one["ratios"]["tlt_over_trl_step"] is None
    assert one["ratios"]["tlt_over_trl_first_step"] == pytest.approx(30 / 10)
    # b alone (a call that ended before a ran): every ratio the issue names is there, unmeasured
    alone = e2e.section([b0], [], skip=2)["ratios"]
    assert {"a_over_b_step", "a_over_b_tokens_per_s", "a_over_b_run", "tlt_step0_over_nospec_step0"} <= alone.keys()
    assert alone["a_over_b_step"] is None and alone["a_over_b_run_ci95"] is None


def test_the_bootstrap_interval_is_seeded_and_covers_the_estimate(e2e: ModuleType) -> None:
    a = _unit("tlt", 0, [9, 5, 2.0, 2.5, 1.5, 3.0, 2.2, 1.8], [50, 60, 70, 40, 90, 30, 80, 55])
    b = _unit("nospec", 0, [6, 5, 4.0, 4.5, 3.0, 5.5, 3.9, 4.4])
    first, again = e2e.section([a, b], [], skip=2), e2e.section([b, a], [], skip=2)
    assert json.dumps(first) == json.dumps(again)  # the same units in any order: the same bounds (NaN as NaN)
    for name in ("a_over_b_step", "a_over_b_tokens_per_s", "a_over_b_run"):
        lo, hi = first["ratios"][f"{name}_ci95"]
        assert lo < first["ratios"][name] < hi, name
        assert first["per_seed"]["0"][f"{name}_ci95"] == [lo, hi]  # one seed: pooled is that seed
    # one steady step: no interval
    short = e2e.section([_unit("tlt", 0, [3, 2, 1]), _unit("nospec", 0, [3, 2, 2])], [], skip=2)
    assert short["ratios"]["a_over_b_step"] == 2.0 and short["ratios"]["a_over_b_step_ci95"] is None


def test_compile_seconds_in_the_steady_steps_are_reported_and_format_2_reports_recompute_without_them(
    e2e: ModuleType,
) -> None:
    from e2e.report import recompute

    a = _unit("tlt", 0, [9, 5, 2, 2, 3])
    for step, compiled in zip(a["steps"], [6.0, 1.0, 0.5, 0.0, 0.25]):
        step["compile_s"] = compiled
    b = _unit("nospec", 0, [5, 4, 4, 5, 4])  # steps without the key (older units): nothing compiled
    summary = e2e.section([a, b], [], skip=2)["summary"]
    assert summary["tlt"]["steady_compile_s"] == 0.75 and summary["tlt"]["compile_s"] == 7.75
    assert summary["nospec"]["steady_compile_s"] == 0.0
    old = recompute({"format": 2, "args": {"skip": 2}, "runs": [a, b], "trl_runs": []})["summary"]["tlt"]
    assert "steady_compile_s" not in old and "compile_s" not in old and old["step_s"] == summary["tlt"]["step_s"]


def test_a_hand_edit_or_a_unit_without_provenance_is_found(e2e: ModuleType, tmp_path: Path) -> None:
    from e2e.report import differences

    runs, trl = [_unit("tlt", 0, [10, 4, 2, 2, 3]), _unit("nospec", 0, [5, 4, 4, 5, 4])], [_trl([30.0, 10.0, 12.0])]
    report = {"format": 4, "args": {"skip": 2}, **e2e.section(runs, trl, 2), "runs": runs, "trl_runs": trl,
              "capped": {"max_new": 1024, **e2e.section(runs[:1], [], 2), "runs": runs[:1], "trl_runs": []}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report, default=float))
    assert differences(json.loads(path.read_text())) == []  # NaN, tuples and int keys survive the JSON
    edited = json.loads(path.read_text())
    edited["per_seed"]["0"]["a_over_b_step"] = 2.5
    edited["capped"]["summary"]["tlt"]["step_s"] = 1.0
    edited["ratios"]["note"] = "1.8x on both seeds"  # prose added by hand
    edited["trl_runs"][0]["provenance"] = {"commit": "abc", "date": "x", "device": "cpu", "measured": False}
    step = edited["ratios"]["a_over_b_step"]
    edited["ratios"]["a_over_b_step"] = step * (1 + 2e-16)  # another machine's last bit: the same figure
    low, high = edited["ratios"]["a_over_b_step_ci95"]
    edited["ratios"]["a_over_b_step_ci95"] = [low * (1 + 2e-16), high]  # the same, inside a list
    assert differences(edited) == ["capped.summary.tlt.step_s", "per_seed.0.a_over_b_step", "ratios.note",
                                   "provenance of trl/seed0: {'commit': 'abc', 'date': 'x', 'device': 'cpu', "
                                   "'measured': False}"]
    edited["ratios"]["a_over_b_step"] = step * (1 + 1e-9)  # far below a hand-rounded figure, and still caught
    assert "ratios.a_over_b_step" in differences(edited)
    edited["ratios"]["a_over_b_step_ci95"] = [low, high * (1 + 1e-9)]
    assert "ratios.a_over_b_step_ci95" in differences(edited)


def test_every_committed_e2e_report_of_format_2_is_its_units_recomputed(e2e: ModuleType) -> None:
    """Reports before format 2 (no units' provenance, a TRL step generated in float32) are not checked:
    their figures are quoted in the docs as they were written, and their units' commits were never recorded."""
    from e2e.report import differences

    reports = sorted(RESULTS.glob("e2e_*.json"))
    old = {p.name for p in reports if json.loads(p.read_text()).get("format", 1) < 2}
    assert old <= LEGACY  # a report committed from now on is of format 2, and checked
    for path in reports:
        report = json.loads(path.read_text())
        if path.name in old:
            continue
        assert differences(report) == [], path.name
        # the names the issue asks for
        assert {"a_over_b_step", "a_over_b_tokens_per_s", "a_over_b_run", "tlt_step0_over_nospec_step0"} <= \
            report["ratios"].keys(), path.name
        assert {r["name"] for r in report["runs"]} <= {"tlt", "nospec"}, path.name


def test_the_options_keep_their_flags_and_checks(e2e: ModuleType) -> None:
    opts = e2e.parse_args(["--stall-steps", "0", "--engine", '{"compile": true}', "--sft-max-length", "64"])
    assert (opts.stall_steps, opts.engine, opts.sft_max_length) == (0, {"compile": True}, 64)
    assert opts.seed_list == [0, 1, 2] and opts.stages == {"warmstart", "ab", "trl", "cap"}
    with pytest.raises(ValueError, match=r"--stall-steps must be >= 0 .*got -1"):
        e2e.parse_args(["--stall-steps", "-1"])
    with pytest.raises(ValueError, match=r"--cap must be in \[1, --max-new = 4096\], got 5000"):
        e2e.parse_args(["--cap", "5000"])
    with pytest.raises(ValueError, match=r"--stage takes warmstart, ab, trl, cap, report or all, got 'ab,tr'"):
        e2e.parse_args(["--stage", "ab,tr"])
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        e2e.parse_args(["--master-weights", "float16"])
    # --smoke's sizes, a flag given explicitly winning; the help is each field's attribute docstring
    smoke = e2e.parse_args(["--smoke", "--steps", "3"])
    assert (smoke.size, smoke.steps, smoke.cap) == ("tiny", 3, 32)
    from e2e.options import parser

    assert "Most drafter steps queued at one stall event" in parser().format_help()
    # a's verification and deterministic mode: its own settings (they key a's runs, never b's)
    plain, coupled = e2e.parse_args([]), e2e.parse_args(["--verification", "coupled", "--deterministic"])
    assert (plain.verification, plain.deterministic, coupled.verification, coupled.deterministic) == \
        ("rejection", False, "coupled", True)
    assert e2e.run_file(plain, "tlt", 0) != e2e.run_file(coupled, "tlt", 0)
    assert e2e.run_file(plain, "nospec", 0) == e2e.run_file(coupled, "nospec", 0)
    with pytest.raises(SystemExit):
        e2e.parse_args(["--verification", "maximal"])
    # the drafter's side stream: auto (DrafterTrainConfig's default), all SMs or a count; a's key alone
    assert [e2e.parse_args(a).side_stream_sms for a in ([], ["--side-stream-sms", "all"],
                                                         ["--side-stream-sms", "32"])] == ["auto", None, 32]
    every = e2e.parse_args(["--side-stream-sms", "all"])
    assert e2e.run_file(plain, "tlt", 0) != e2e.run_file(every, "tlt", 0)
    assert e2e.run_file(plain, "nospec", 0) == e2e.run_file(every, "nospec", 0)
    with pytest.raises(ValueError, match=r"--side-stream-sms takes auto, all or a count >= 1, got 0"):
        e2e.parse_args(["--side-stream-sms", "0"])
    with pytest.raises(SystemExit):
        e2e.parse_args(["--side-stream-sms", "half"])


def test_the_e2e_carries_only_runs_measured_with_this_calls_settings(e2e: ModuleType, tmp_path: Path) -> None:
    args = e2e.parse_args(["--cache-dir", str(tmp_path / "cache" / "lightning_tlt")])
    parts, trl = tmp_path / "runs", tmp_path / "trl"
    parts.mkdir(), trl.mkdir()
    old_args = {k: v for k, v in args.settings().items() if k != "stall_steps"}  # predates --stall-steps
    runs = [_unit("nospec", 0, [1.0, 2.0]), _unit("tlt", 0, [1.0, 2.0])]
    runs[0]["provenance"]["carried_from"], runs[0]["provenance"]["measured"] = "first.json", False
    report = {"format": 2, "workload": e2e.workload_key(args), "args": old_args, "date": "d", "card": "H200",
              "runs": runs, "trl_runs": [_trl([300.0, 100.0])]}
    # a's own setting differs: TRL is taken, the seed's a and b are not (a measured here would be paired
    # with a b from another machine's warm start)
    other = e2e.parse_args(["--cache-dir", args.cache_dir, "--stall-steps", "0"])
    assert e2e.carry(other, report, "old.json", parts, trl) == ["trl"]
    carried = json.loads((trl / "trl.json").read_text())
    assert carried["step_s"] == [300.0, 100.0] and not list(parts.iterdir())
    assert carried["provenance"] == {"commit": "abc", "date": "2026-12-04", "device": "cpu", "measured": False,
                                     "carried_from": "old.json"}
    # units of an older format's start (their versions held across runs: format 3) are never carried
    older = {**report, "runs": [{**r, "start": "dynamo_reset"} for r in runs], "trl_runs": []}
    assert e2e.carry(args, older, "old.json", parts, trl) == [] and not list(parts.iterdir())
    # the report's missing setting counts as its default (4): the pair is taken under this call's settings
    assert e2e.carry(args, report, "old.json", parts, trl) == ["nospec/seed0", "tlt/seed0"]
    b = json.loads((parts / "nospec_seed0.json").read_text())
    assert [s["wall_s"] for s in b["steps"]] == [1.0, 2.0]
    assert b["provenance"]["carried_from"] == "first.json"  # carried twice: the first report it came from
    assert json.loads((parts / e2e.run_file(args, "tlt", 0)).read_text())["provenance"]["carried_from"] == "old.json"
    assert e2e.run_file(args, "tlt", 0) != e2e.run_file(other, "tlt", 0)
    assert e2e.run_file(args, "nospec", 0) == e2e.run_file(other, "nospec", 0)
    # a seed with one run cached here is left alone; TRL from a report before format 2 (float32) never
    (parts / e2e.run_file(args, "tlt", 0)).unlink()
    (trl / "trl.json").unlink()
    assert e2e.carry(args, {**report, "format": 1}, "old.json", parts, trl) == []
    with pytest.raises(ValueError, match=r"--carry takes an earlier report's JSON file, got '.*nope.json' \(no such"):
        e2e.parse_args(["--carry", str(tmp_path / "nope.json")])
    # the cap section's units, under the section's own settings (--cap as max_new, --cap-steps as steps)
    capped = e2e.parse_args(["--cache-dir", args.cache_dir, "--cap", "1024", "--cap-steps", "8"]).capped()
    assert (capped.max_new, capped.steps, capped.seeds) == (1024, 8, "0")
    with_cap = {**report, "args": {**old_args, "cap": 1024, "cap_steps": 8}, "capped": {"runs": runs, "trl_runs": []}}
    cap_parts = tmp_path / "cap"
    cap_parts.mkdir()
    assert e2e.carry(capped, with_cap, "old.json", cap_parts, trl, capped=True) == ["nospec/seed0", "tlt/seed0"]
    assert e2e.carry(capped, {**with_cap, "args": {**old_args, "cap": 1024}}, "old.json", tmp_path, trl, True) == []
    # a report of another workload is refused before any work
    path = tmp_path / "other.json"
    path.write_text(json.dumps({**report, "workload": "countdown_search-d3-100m-0123456789"}))
    with pytest.raises(ValueError, match=r"its workload 'countdown_search-d3-100m-0123456789' is not this call's "
                                         r"'countdown_search-d3-0.5b-"):
        e2e.main(["--carry", str(path), "--cache-dir", args.cache_dir])


def test_the_accuracy_verdict_refuses_what_cannot_show_a_loss(e2e: ModuleType) -> None:
    def run(name: str, correctness: list[float], error: str | None = None) -> dict[str, Any]:
        return {"name": name, "seed": 0, "steps": [{"correctness": c} for c in correctness], "error": error}

    judge = e2e.no_accuracy_loss
    assert judge([run("tlt", [0.0] * 5)], [run("nospec", [0.0] * 5)])["verdict"] == "all_zero"
    stopped = judge([run("tlt", [0.1, 0.0], "FloatingPointError: ...")], [run("nospec", [0.1, 0.2])])
    assert stopped == {"n": 2, "verdict": "stopped_early", "stopped": ["tlt/seed0"]}
    fine = judge([run("tlt", [0.2, 0.4, 0.2, 0.3])], [run("nospec", [0.2, 0.3, 0.3, 0.3])])  # a - b: 0, .1, -.1, 0
    assert fine["verdict"] == "within_2se" and fine["mean_diff"] == pytest.approx(0.0, abs=1e-12)
    assert judge([run("tlt", [0.1] * 4)], [run("nospec", [0.5, 0.5, 0.6, 0.5])])["verdict"] == "tlt_lower"


def test_the_accuracy_verdict_allows_for_policies_that_parted_and_stayed_apart(e2e: ModuleType) -> None:
    def run(name: str, correctness: list[float]) -> dict[str, Any]:
        return {"name": name, "seed": 0, "steps": [{"correctness": c} for c in correctness]}

    # Newey-West by hand: d = [1, 3, 2], mean 2, residuals [-1, 1, 0]; lag 1 (weight 2 (1 - 1/2) = 1):
    # (1 + 1 + 0) + 1 x (-1 + 0) = 1, so the standard error is sqrt(1) / 3; lag 0: sqrt(2) / 3
    assert e2e.newey_west_stderr([[1.0, 3.0, 2.0]], 1) == pytest.approx(1 / 3)
    assert e2e.newey_west_stderr([[1.0, 3.0, 2.0]], 0) == pytest.approx(math.sqrt(2) / 3)
    assert [e2e.autocorr_lag(n) for n in (3, 8, 20)] == [1, 2, 4]
    # one flip at step 16 keeps a 0.05 lower for its last 4 steps: as independent steps, mean -0.01 and
    # standard error 0.0046 (a "loss"); with lag 4 the residuals (+0.01 x 16, -0.04 x 4) give
    # 0.008 + 1.6 x 0.0059 + 1.2 x 0.0038 + 0.8 x 0.0017 - 0.4 x 0.0004 = 0.0232, so 0.0076: within 2 SE
    a, b = run("tlt", [0.2] * 16 + [0.15] * 4), run("nospec", [0.2] * 20)
    assert e2e.no_accuracy_loss([a], [b], autocorrelated=False)["verdict"] == "tlt_lower"
    judged = e2e.no_accuracy_loss([a], [b])
    assert judged["autocorr_lag"] == 4 and judged["stderr_autocorr"] == pytest.approx(math.sqrt(0.0232) / 20)
    assert judged["stderr"] == pytest.approx(0.00459, abs=1e-5) and judged["verdict"] == "within_2se"


def run_in_process(code: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``code`` in a Python process of its own (a watchdog ends its process), from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


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
    run = run_in_process(code, timeout=60)
    assert run.returncode == 3 and "not ended" not in run.stdout
    assert "tlt: WATCHDOG after 0 finished steps" in run.stdout  # which side is stuck, then every stack
    assert "main stream idle" in run.stdout or "(CPU)" in run.stdout
    assert "nvidia-smi" in run.stdout  # busy or idle: a kernel that never ends, or a wait (here: no tool)
    assert 'File "<string>", line 6' in run.stderr  # the main thread, where it waited
    assert "in _hung" in run.stderr  # and the watchdog's own thread


def test_the_e2e_watchdogs_backstop_ends_a_process_whose_hung_call_holds_the_gil() -> None:
    """A hung call that never lets the watchdog's Python thread run (it holds the GIL): faulthandler's C
    thread ends the process 30 s after the bound, with the stacks."""
    code = (
        "import sys, time; sys.path.insert(0, 'benchmarks'); import e2e\n"
        "r = e2e.StepRecorder('tlt', 32, 'c', time.perf_counter(), watchdog_s=0.5)\n"
        "r.arm_watchdog()\n"
        "r._timer.cancel()  # as if the GIL never came back to it\n"
        "time.sleep(60)\n"
        "print('not ended')\n"
    )
    run = run_in_process(code, timeout=90)
    assert run.returncode != 0 and "not ended" not in run.stdout
    assert "Timeout (0:00:30.500000)!" in run.stderr and 'File "<string>", line 5' in run.stderr


@pytest.mark.slow  # about 40 s on 2 cores: two calls of the smoke pipeline
def test_the_whole_pipeline_writes_a_report_its_units_give(e2e: ModuleType, tmp_path: Path) -> None:
    """The smoke run, every stage on the CPU (tiny policy): a, b and c at --max-new, then at the cap; c's
    budget first too short for more than its first step, then (a second call) long enough for three."""
    from e2e.report import differences

    out = tmp_path / "e2e.json"
    argv = ["-m", "benchmarks.e2e", "--smoke", "--cache-dir", str(tmp_path / "cache" / "lightning_tlt"), "--out",
            str(out), "--plots", "", "--commit", "feedbeef"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def call(*more: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        run = subprocess.run([sys.executable, *argv, *more], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        print(f"smoke call: {time.perf_counter() - t0:.1f} s")
        report = json.loads(out.read_text())
        assert report["format"] == 4 and differences(report) == []
        assert all(unit["start"] == "as_new_process" for unit in report["runs"])
        # the child of a background compile, recorded where one ran: the smoke engines compile nothing in one
        assert all(unit["background_compile"] is None for unit in report["runs"])
        # --side-stream-sms auto (the default) on the CPU: no side stream, so no green context
        assert report["args"]["side_stream_sms"] == "auto" and all(u["side_stream_sms"] is None for u in report["runs"])
        # each step's boundary_s by part: the update's finite check, then (a only) the drafter callback's parts
        for unit in report["runs"]:
            for step in unit["steps"]:
                parts = step["boundary_parts"]
                assert ("publish" in parts) == (unit["name"] == "tlt") and "nonfinite_check" in parts
                assert sum(parts.values()) <= step["boundary_s"] + 1e-6
        return report

    first = call("--trl-budget-s", "0.01")  # the next TRL step never fits: one step each
    assert first["recomputed_this_call"] == ["policy warm start", "drafter warm start", "nospec/seed0", "tlt/seed0",
                                             "nospec/seed0/cap32", "tlt/seed0/cap32", "trl/cap32", "trl"]
    for section in (first, first["capped"]):
        assert len(section["trl_runs"][0]["step_s"]) == 1 and section["summary"]["trl"]["step_s"] is None
        assert section["ratios"]["tlt_over_trl_step"] is None and section["ratios"]["tlt_over_trl_first_step"] > 0
    report = call("--stage", "cap,trl")  # a and b cached; c measured again, with its steps this time
    assert report["recomputed_this_call"] == ["trl/cap32", "trl"]
    for section, cap in ((report, 48), (report["capped"], 32)):
        a, b = (next(r for r in section["runs"] if r["name"] == n) for n in ("tlt", "nospec"))
        assert len(a["steps"]) == len(b["steps"]) == 3
        assert section["summary"]["nospec"]["run_s"] == pytest.approx(sum(s["wall_s"] for s in b["steps"]))
        assert max(n for r in (a, b) for s in r["steps"] for n in s["lengths"]) <= cap
        (trl,) = section["trl_runs"]
        assert len(trl["step_s"]) == 3 and section["summary"]["trl"]["step_s"] == pytest.approx(
            (trl["step_s"][1] + trl["step_s"][2]) / 2)
        assert max(n for batch in trl["lengths"] for n in batch) <= cap
        for unit in (a, b, trl):
            assert unit["provenance"]["commit"] == "feedbeef" and unit["provenance"]["measured"] is True
            assert unit["provenance"]["warm_start"]["policy"] == report["warm_start"]["policy"]["dir"]
    assert report["capped"]["max_new"] == 32 and report["args"]["max_new"] == 48


def test_the_figures_of_units_without_a_report_are_those_a_report_computes(
    e2e: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from e2e.figures import main as figures

    runs = [_unit("tlt", 0, [10, 4, 2, 2, 3]), _unit("nospec", 0, [5, 4, 4, 5, 4]), _unit("nospec", 1, [5, 4, 4])]
    paths = []
    for run in runs:
        paths.append(tmp_path / f"{run['name']}_{run['seed']}.json")
        paths[-1].write_text(json.dumps(run))
    results = figures([str(p) for p in paths])
    assert json.dumps(results, default=float) == json.dumps(e2e.section(runs, [], 2), default=float)
    assert results["per_seed"]["0"]["a_over_b_step"] == pytest.approx(13 / 7)  # b's steps 2-4 over a's
    out = capsys.readouterr().out
    assert "3 units (tlt/seed0, nospec/seed0, nospec/seed1) on cpu at abc" in out and "a_over_b_step" in out
    paths[0].write_text(json.dumps({**runs[0], "name": "trl"}))
    with pytest.raises(SystemExit, match=r"units must be runs of a \(tlt\) or b \(nospec\), got \['trl'\]"):
        figures([str(p) for p in paths])
