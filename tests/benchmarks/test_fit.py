"""benchmarks/fit.py: the printed lines it reads, the chunks' metrics merged, the summary by hand, and the whole
chunked run on the CPU (--smoke): resumed, steps continuous, the report's keys."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from lightning_tlt.callbacks.heldout_eval import eval_line
from lightning_tlt.callbacks.rollout_metrics import summary_line

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"heldout_correctness_start", "heldout_correctness_start_ci95", "heldout_correctness_end",
                "heldout_correctness_end_ci95", "steps", "resumes", "accept_len_cotrained_last50",
                "accept_len_frozen_last50"}  # fmt: skip


@pytest.fixture
def fit(benchmark_script) -> ModuleType:  # noqa: ANN001
    return benchmark_script("fit")


def test_the_printed_lines_it_watches_are_the_callbacks_own(fit: ModuleType) -> None:
    watch = fit.Watch(iters=2, every=4)
    metrics = {"eval/num_prompts": 256.0, "eval/num_samples": 4.0, "eval/correctness_greedy": 0.4,
               "eval/correctness_greedy_low": 0.3, "eval/correctness_greedy_high": 0.5, "eval/correctness_t1": 0.35,
               "eval/correctness_t1_low": 0.3, "eval/correctness_t1_high": 0.4, "eval/len_mean": 300.0,
               "eval/len_p50": 250.0, "eval/len_p90": 700.0, "eval/len_p99": 2100.0, "eval/clipped_ratio": 0.01,
               "eval/seconds": 31.2}  # fmt: skip
    for line in [eval_line(0, metrics, 1.0), summary_line(2, {"reward": 1.0}, {"step_time": 3.5}, 200),
                 "noise | 9 s", summary_line(4, {"reward": 1.2}, {"step_time": 4.25}, 200)]:
        watch.read("INFO: " + line + "\n")  # a logging prefix changes nothing
    assert (watch.first_step, watch.last_step, watch.step_s, watch.eval_s) == (2, 4, [3.5, 4.25], [31.2])
    assert watch.next_step_s(default_eval_s=100.0) == 4.25  # step 6 is no evaluation step (every 4)
    watch.read(summary_line(6, {"reward": 1.2}, {"step_time": 2.0}, 200))
    assert watch.next_step_s(default_eval_s=100.0) == 4.25 + 31.2  # step 8 is: the slowest step and evaluation


def test_chunks_merge_by_step_the_later_one_winning(fit: ModuleType, tmp_path: Path) -> None:
    """Chunk 1 logged steps 1-3 but was killed after its save at step 2; chunk 2 resumed at 2 and redid step 3."""
    for chunk, text in ((1, "step,loss,spec/accept_len,eval/correctness_t1\n0,,,0.2\n1,0.5,2.0,\n2,0.4,2.5,\n3,0.3,9.0,\n"),
                        (2, "step,loss,spec/accept_len\n3,0.35,3.0\n4,0.2,3.5\n")):  # fmt: skip
        folder = tmp_path / "chunks" / f"chunk{chunk}"
        folder.mkdir(parents=True)
        (folder / "metrics.csv").write_text(text)
    state = {"chunks": [{"chunk": 1, "resumed_from": None, "resumed_step": 0, "first_step": 1},
                        {"chunk": 2, "resumed_from": "x", "resumed_step": 2, "first_step": 3}]}  # fmt: skip
    rows = fit.read_rows(tmp_path, state)
    assert rows[3] == {"loss": 0.35, "spec/accept_len": 3.0} and rows[0] == {"eval/correctness_t1": 0.2}
    arm = fit.arm_summary(tmp_path, state, iters=1)
    assert (arm["steps"], arm["resumes"], arm["continuous"], arm["steps_missing"]) == (4, 1, True, [])
    assert [r[:2] for r in arm["accept_len"]["rows"]] == [[1, 2.0], [2, 2.5], [3, 3.0], [4, 3.5]]
    state["chunks"][1]["first_step"] = 4  # a resumed chunk that skipped a step is not continuous
    assert not fit.arm_summary(tmp_path, state, iters=1)["continuous"]


def _arm(steps: int, accept: list[float], heldout: list[tuple[int, float, float, float]], resumes: int = 2
         ) -> dict[str, object]:
    return {"steps": steps, "resumes": resumes, "continuous": True, "steps_missing": [],
            "accept_len": {"rows": [[i + 1, a, 0.5, 1.0] for i, a in enumerate(accept)]},
            "heldout": [{"step": s, "correctness_t1": c, "correctness_t1_low": lo, "correctness_t1_high": hi}
                        for s, c, lo, hi in heldout]}  # fmt: skip


def test_the_summary_and_targets_by_hand(fit: ModuleType) -> None:
    # co-trained: 120 steps, acceptance 2.0 in steps 1-70 and 3.0 after; frozen: 100 steps at 2.5. The common
    # window is steps 51-100: co-trained (20 x 2.0 + 30 x 3.0) / 50 = 2.6, frozen 2.5
    cotrained = _arm(120, [2.0] * 70 + [3.0] * 50, [(0, 0.30, 0.26, 0.34), (50, 0.4, 0.35, 0.45),
                                                     (120, 0.45, 0.41, 0.49)])  # fmt: skip
    frozen = _arm(100, [2.5] * 100, [(0, 0.30, 0.26, 0.34)], resumes=1)
    summary, targets = fit.summarize({"cotrained": cotrained, "frozen": frozen}, "cotrained")
    assert set(summary) == SUMMARY_KEYS
    assert (summary["heldout_correctness_start"], summary["heldout_correctness_end"]) == (0.30, 0.45)
    assert (summary["heldout_correctness_start_ci95"], summary["heldout_correctness_end_ci95"]) == ([0.26, 0.34],
                                                                                                   [0.41, 0.49])
    assert (summary["steps"], summary["resumes"]) == (120, 2)
    assert summary["accept_len_cotrained_last50"] == pytest.approx(2.6) and summary["accept_len_frozen_last50"] == 2.5
    assert targets["correctness_rise"]["met"] and targets["correctness_rise"]["rise"] == pytest.approx(0.15)
    assert targets["accept_len_gain"]["window_rl_steps"] == [51, 100] and not targets["accept_len_gain"]["met"]
    assert targets["resumes"]["met"]
    # intervals that touch are not apart, whatever the rise
    touching = _arm(120, [2.0] * 120, [(0, 0.30, 0.26, 0.42), (120, 0.45, 0.41, 0.49)])
    assert not fit.summarize({"cotrained": touching}, "cotrained")[1]["correctness_rise"]["met"]
    assert math.isnan(fit.summarize({"cotrained": touching}, "cotrained")[0]["accept_len_frozen_last50"])


@pytest.mark.slow  # about 30 s on 2 cores: three lightning-tlt fit processes
def test_the_smoke_run_resumes_continues_and_reports(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "fit.json"
    done = subprocess.run([sys.executable, "benchmarks/fit.py", "--smoke", "--run-dir", str(tmp_path / "runs"),
                           "--out", str(out), "--plots", str(tmp_path / "img")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["summary"]) == SUMMARY_KEYS and report["complete"]
    assert {"commit", "date", "device", "versions"} <= set(report["provenance"])
    cotrained = report["arms"]["cotrained"]
    assert report["summary"]["steps"] == 4 and report["summary"]["resumes"] == cotrained["resumes"] >= 1
    assert cotrained["continuous"] and cotrained["steps_missing"] == []
    for chunk in cotrained["chunks"][1:]:  # each resumed chunk's first step is the one after its checkpoint
        assert chunk["exit_code"] in (0, 143) and chunk["first_step"] == chunk["resumed_step"] + 1 > 1
    assert [e["step"] for e in report["heldout"]["cotrained"]] == [0, 2, 4]  # step 0 (the control), every 2
    assert report["heldout"]["cotrained"][0]["num_prompts"] == 8
    assert [r[0] for r in report["accept_len"]["cotrained"]["rows"]] == [1, 2, 3, 4]
    assert [r[0] for r in report["accept_len"]["frozen"]["rows"]] == [1, 2]
    assert all((tmp_path / "img" / name).is_file() for name in ("fit_heldout_correctness.png", "fit_accept_len.png"))
    # only the newest chunk's checkpoints are kept
    assert len(list((tmp_path / "runs" / "cotrained").rglob("*.ckpt"))) <= 2
