"""A long ``lightning-tlt fit`` run in chunks of one call each, resumed from checkpoints, against its controls.

Issue 34: at least 200 RL steps of ``configs/grpo_gpu_0.5b.yaml`` (co-trained drafter), and a
frozen-drafter arm of the same run (at least 100 steps), on a machine whose calls last at most 10
minutes. Each call of this script runs one chunk of the first arm not done yet::

    python benchmarks/fit.py        # again and again on the same warm machine, until it says "all done"

A chunk is ``lightning-tlt fit --config <the arm's config>`` (``--ckpt_path`` the last chunk's
``last.ckpt`` when there is one), its output printed and kept. It ends by SIGTERM, which the config's
`InterruptCheckpoint` turns into "finish the RL step in flight, save ``last.ckpt``, exit 143": sent
once the call's ``--budget-s`` would not hold another step (the step's time, and an evaluation's when
one is due, as measured in this chunk, plus ``--save-s``), or after ``--chunk-steps`` RL steps; a run
still going at ``--budget-s`` is killed (its last cadence checkpoint is then the one to resume from).
The arms' folders (``--run-dir``, git-ignored) persist on a warm machine between calls, and hold each
arm's config, each chunk's log, metrics CSV and checkpoints (only the newest chunk's are kept), and
``state.json`` (the chunks: where each resumed from, its first and last steps, exit code, time, card).

The arms (``--arms NAME:STEPS,...``): ``cotrained`` is ``--config`` as written; ``frozen`` is the same
with ``DrafterCoTrainCallback``'s ``freeze_after_warm_start: true`` (the drafter warm-started on the
first rollouts, then never trained or republished, but speculating); a third name runs ``--config`` as
written in a folder of its own (e.g. ``straight`` with a large budget: an unbroken run to compare a
resumed one's steps with). The control of learning is in each run: `EvalCallback`'s held-out
evaluation at step 0 (the warm-start policy) and every N steps.

Once every arm is done (or with ``--report``), the report: ``benchmarks/results/fit_<card>_<date>.json``
(`write_results`) and ``docs/img/fit_heldout_correctness.png``, ``docs/img/fit_accept_len.png``.
``summary`` holds ``heldout_correctness_start`` and ``_end`` (the first arm's held-out correctness at
temperature 1 with ``k`` samples a prompt, at step 0 and at its last evaluation) with ``_ci95`` (the
cluster-robust interval of `lightning_tlt.data.heldout`), ``steps`` and ``resumes`` (that arm's RL steps
and resumed chunks), ``accept_len_cotrained_last50`` and ``accept_len_frozen_last50`` (each arm's mean
``spec/accept_len``, tokens per speculative step, over the last 50 RL steps that both arms ran: the same
steps, like against like). ``targets`` judges the issue's three targets; ``heldout``, ``accept_len``
and ``arms`` hold every evaluation, every step's acceptance and every chunk, ``provenance`` the commit,
date, card and versions. ``--smoke`` runs the whole thing on the CPU (the config shrunk to a tiny
policy, arms of 4 and 2 RL steps, chunks of 2 steps, every chunk in one call) in about half a minute,
under ``.cache/fit_smoke/``, writing into ``benchmarks/results/smoke/``.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from _common import ROOT, add_common_flags, write_results

STEP_LINE = re.compile(r"(?:^|\s)step (\d+)(?:/\d+)? \|.* \| ([\d.]+) s$")
"""`RolloutMetricsCallback`'s per-step line: the optimizer step reached and the step's seconds."""
EVAL_LINE = re.compile(r"(?:^|\s)held-out at step (\d+) .*\| ([\d.]+) s$")
"""`EvalCallback`'s line: the step and the evaluation's seconds."""
HEADLINE = "t1"
"""The summary's held-out figure: correctness at temperature 1, k samples a prompt (``eval/correctness_t1``)."""


# ----------------------------------------------------------------------------- the arms' configs
def callback_init(config: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The ``init_args`` of the trainer callback whose class is ``name`` (``None`` when there is none)."""
    for callback in config["trainer"].get("callbacks") or []:
        if callback["class_path"].rsplit(".", 1)[-1] == name:
            return callback.setdefault("init_args", {})
    return None


def arm_config(base: dict[str, Any], arm: str, steps: int, arm_dir: Path, evaluation: dict[str, int] | None = None
               ) -> dict[str, Any]:
    """``base`` for one arm: ``steps`` RL steps, logs and checkpoints under ``arm_dir``, no progress bar (its
    output goes to a file), ``evaluation`` over the `EvalCallback`'s settings, and for the frozen arm a drafter
    frozen after its warm start."""
    config = json.loads(json.dumps(base))
    trainer = config["trainer"]
    trainer.update(max_steps=steps * iterations(config), default_root_dir=str(arm_dir), enable_progress_bar=False,
                   logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                           "init_args": {"save_dir": str(arm_dir), "name": "chunks",
                                         "flush_logs_every_n_steps": 1}})  # fmt: skip
    if callback_init(config, "InterruptCheckpoint") is None:
        raise SystemExit("the config has no InterruptCheckpoint callback: a chunk could not save when it is stopped")
    held = callback_init(config, "EvalCallback")
    if held is None:
        print("note: the config has no EvalCallback: the report will hold no held-out figures", flush=True)
    elif evaluation:
        held["config"] = {**(held.get("config") or {}), **evaluation}
    if arm == "frozen":
        drafter = callback_init(config, "DrafterCoTrainCallback")
        if drafter is None:
            raise SystemExit("the frozen arm needs a DrafterCoTrainCallback in the config (to warm-start, then freeze)")
        drafter.setdefault("config", {})["freeze_after_warm_start"] = True
    return config


def iterations(config: dict[str, Any]) -> int:
    """Optimizer steps per RL step (GRPO's ``num_iterations``, 1 unless the config says)."""
    return int(((config.get("model") or {}).get("init_args") or {}).get("config", {}).get("num_iterations", 1))


def smoke_config(base: dict[str, Any]) -> dict[str, Any]:
    """``base`` on the CPU at tiny sizes: the zoo's tiny policy (no warm start), arithmetic, short completions,
    every callback kept, the drafter's and the evaluation's settings shrunk."""
    config = json.loads(json.dumps(base))
    trainer = config["trainer"]
    trainer.update(accelerator="cpu", devices=1)
    trainer.pop("precision", None)
    for name, settings in (
        ("DrafterCoTrainCallback", {"stall_threshold": 8, "batch_size": 4, "max_len": 24, "buffer_tokens": 2048,
                                    "warm_start_steps": 10, "max_decode_slowdown": 0.5, "max_steps_per_event": 1,
                                    "eval_every_n_steps": 2, "handoff_margin": None, "deterministic": True,
                                    "drafter_step_cost": 1.0}),
        ("EvalCallback", {"num_prompts": 8, "every_n_steps": 2, "num_samples": 2}),
    ):  # fmt: skip
        init = callback_init(config, name)
        if init is not None:
            init["config"] = {**(init.get("config") or {}), **settings}
    checkpoint = callback_init(config, "ModelCheckpoint")
    if checkpoint is not None:
        checkpoint["every_n_train_steps"] = 2
    model = config["model"]["init_args"]
    model["policy"] = {"arch": "qwen2", "size": "tiny", "seed": 0}
    model["config"] = {**model.get("config", {}), "max_completion_length": 16, "num_generations": 4,
                       "learning_rate": 1e-3, "micro_batch_tokens": None}  # fmt: skip
    config["data"].update(dataset="arithmetic", difficulty=1, task_size=64, prompts_per_step=2,
                          speculative={"method": "suffix", "threshold": 8, "deterministic": True})  # fmt: skip
    return config


# ----------------------------------------------------------------------------- one chunk
@dataclass
class Watch:
    """What a chunk's output says so far: the steps it reached and what they and the evaluations took."""

    iters: int
    every: int | None
    """The evaluation's ``every_n_steps`` (``None``: no evaluation)."""
    first_step: int | None = None
    last_step: int | None = None
    step_s: list[float] = field(default_factory=list)
    eval_s: list[float] = field(default_factory=list)

    def read(self, line: str) -> None:
        text = line.strip()
        if found := STEP_LINE.search(text):
            step = int(found.group(1))
            self.first_step = step if self.first_step is None else self.first_step
            self.last_step = step
            self.step_s.append(float(found.group(2)))
        elif found := EVAL_LINE.search(text):
            self.eval_s.append(float(found.group(2)))

    def next_step_s(self, default_eval_s: float) -> float:
        """A generous guess of the next RL step's time: the slowest of the last five steps, plus an evaluation's
        when the next step ends on one (the slowest seen, else ``default_eval_s``)."""
        step = max(self.step_s[-5:]) if self.step_s else 0.0
        due = self.every is not None and self.last_step is not None and (
            (self.last_step + self.iters) // self.every > self.last_step // self.every)  # fmt: skip
        return step + ((max(self.eval_s) if self.eval_s else default_eval_s) if due else 0.0)


def run_chunk(arm_dir: Path, state: dict[str, Any], args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    """One ``lightning-tlt fit`` chunk of the arm in ``arm_dir`` (resumed from the newest ``last.ckpt``), stopped
    by SIGTERM when the call's time would not hold another step, or after ``--chunk-steps``; its record."""
    config = yaml.safe_load((arm_dir / "config.yaml").read_text())
    iters = iterations(config)
    evaluation = callback_init(config, "EvalCallback")
    every = int(((evaluation or {}).get("config") or {}).get("every_n_steps", 25)) if evaluation is not None else None
    number = len(state["chunks"]) + 1
    resume = latest_checkpoint(arm_dir, state)
    argv = [sys.executable, "-m", "lightning_tlt.cli", "fit", "--config", str(arm_dir / "config.yaml"),
            f"--trainer.logger.init_args.version=chunk{number}"] + (["--ckpt_path", str(resume)] if resume else [])
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    if args.smoke:
        env.setdefault("OMP_NUM_THREADS", "1")
    log_path = arm_dir / f"chunk{number}.log"
    print(f"[fit] {arm_dir.name} chunk {number}: {'resumed from ' + str(resume) if resume else 'from the start'}",
          flush=True)
    start = time.monotonic()
    watch = Watch(iters, every)
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)  # fmt: skip
    with open(log_path, "w") as log:
        reader = threading.Thread(target=_pump, args=(proc, log, watch), daemon=True)
        reader.start()
        stopped_by = _supervise(proc, watch, args, deadline, int((config.get("trainer") or {}).get("max_steps") or 0))
        reader.join(timeout=30)
    ckpt = arm_dir / "chunks" / f"chunk{number}" / "checkpoints" / "last.ckpt"
    record = {
        "chunk": number, "resumed_from": str(resume) if resume else None,
        "resumed_step": checkpoint_step(resume) if resume else 0, "first_step": watch.first_step,
        "last_printed_step": watch.last_step, "saved_step": checkpoint_step(ckpt) if ckpt.is_file() else None,
        "exit_code": proc.returncode, "stopped_by": stopped_by, "wall_s": time.monotonic() - start,
        "device": device_name(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }  # fmt: skip
    if proc.returncode not in (0, 143):
        tail = log_path.read_text(errors="replace")[-3000:]
        print(f"[fit] chunk {number} exited {proc.returncode} ({stopped_by}); the end of its log:\n{tail}", flush=True)
    return record


def _pump(proc: subprocess.Popen[str], log: Any, watch: Watch) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
        log.flush()
        print(line, end="", flush=True)
        watch.read(line)


def _supervise(proc: subprocess.Popen[str], watch: Watch, args: argparse.Namespace, deadline: float,
               max_steps: int = 0) -> str:
    """Wait for the chunk; SIGTERM it once when the next step would not end before ``deadline`` (less the save),
    or after ``--chunk-steps`` RL steps; kill its process group at ``deadline``. Returns why it stopped.

    No signal once the run printed its last step (``max_steps``): it ends by itself, and a signal that came
    after the run had put back the default handler, as it exits, killed it (exit -15 instead of 0)."""
    sent: str | None = None
    while proc.poll() is None:
        time.sleep(0.2)
        now = time.monotonic()
        if now >= deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "killed at the deadline"
        if sent is not None or watch.last_step is None:
            continue  # a signal before the first step would stop the run without a checkpoint
        if max_steps and watch.last_step >= max_steps:
            continue  # the last step: the run saves and exits on its own
        steps = (watch.last_step - (watch.first_step or 0)) // watch.iters + 1
        if args.chunk_steps and steps >= args.chunk_steps:
            sent = f"after {steps} RL steps"
        elif now + watch.next_step_s(args.eval_s) + args.save_s >= deadline:
            sent = "time"
        if sent is not None:
            print(f"[fit] SIGTERM ({sent}): the run finishes its step in flight and saves", flush=True)
            proc.send_signal(signal.SIGTERM)
    return sent or "done"


def latest_checkpoint(arm_dir: Path, state: dict[str, Any]) -> Path | None:
    """The newest chunk's ``last.ckpt`` (a chunk killed before its first save has none: the one before)."""
    for record in reversed(state["chunks"]):
        path = arm_dir / "chunks" / f"chunk{record['chunk']}" / "checkpoints" / "last.ckpt"
        if path.is_file():
            return path
        if record.get("resumed_from"):
            return Path(record["resumed_from"])
    return None


def prune(arm_dir: Path, keep: Path) -> None:
    """Delete the checkpoints of every chunk but the one holding ``keep`` (a 0.5 B run's are several GB each)."""
    for path in (arm_dir / "chunks").glob("chunk*/checkpoints/*.ckpt"):
        if path.parent != keep.parent:
            path.unlink()


def checkpoint_step(path: Path) -> int:
    """The RL-step count a checkpoint holds (its ``global_step``), read memory-mapped."""
    import torch

    return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False)["global_step"])


def device_name() -> str:
    """The GPU's name from ``nvidia-smi`` (no CUDA context in this process), else the CPU's."""
    if shutil.which("nvidia-smi"):
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True)  # fmt: skip
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip().splitlines()[0]
    return f"cpu ({platform.processor() or platform.machine()})"


# ----------------------------------------------------------------------------- reading an arm back
def read_rows(arm_dir: Path, state: dict[str, Any]) -> dict[int, dict[str, float]]:
    """Every chunk's metrics CSV merged by step: a later chunk's row of a step replaces an earlier one's (a
    chunk killed after its last save left steps that the next chunk redid)."""
    rows: dict[int, dict[str, float]] = {}
    for record in state["chunks"]:
        for path in (arm_dir / "chunks" / f"chunk{record['chunk']}").glob("metrics.csv"):
            fresh: dict[int, dict[str, float]] = {}
            with open(path) as f:
                for row in csv.DictReader(f):
                    values = {k: float(v) for k, v in row.items() if k != "step" and v not in ("", None)}
                    fresh.setdefault(int(float(row["step"])), {}).update(values)
            for step, values in fresh.items():
                rows[step] = values
    return rows


def arm_summary(arm_dir: Path, state: dict[str, Any], iters: int) -> dict[str, Any]:
    """An arm's chunks, RL steps, resumes, held-out evaluations and per-step acceptance, from its folder."""
    rows = read_rows(arm_dir, state)
    trained = sorted(s for s, r in rows.items() if "loss" in r)
    evals = [{"step": s // iters, **{k[len("eval/"):]: v for k, v in r.items() if k.startswith("eval/")}}
             for s, r in sorted(rows.items()) if f"eval/correctness_{HEADLINE}" in r]  # fmt: skip
    accept = [[s // iters, rows[s].get("spec/accept_len", math.nan), rows[s].get("spec/fraction", math.nan),
               rows[s].get("drafter/eagle_drafting", math.nan)] for s in trained]  # fmt: skip
    last = trained[-1] // iters if trained else 0
    chunks = state["chunks"]
    resumed = [c for c in chunks if c.get("resumed_from") and c.get("first_step") is not None]
    continuous = all(c["first_step"] == c["resumed_step"] + iters for c in resumed)
    return {
        "steps": last, "resumes": len(resumed), "continuous": continuous,
        "steps_missing": [k for k in range(1, last + 1) if k * iters not in rows or "loss" not in rows[k * iters]],
        "chunks": chunks, "heldout": evals,
        "accept_len": {"columns": ["rl_step", "spec/accept_len", "spec/fraction", "drafter/eagle_drafting"],
                       "rows": accept},
    }  # fmt: skip


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.fmean(finite) if finite else math.nan


def summarize(arms: dict[str, dict[str, Any]], first: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The summary (the issue's keys) and the targets' judgement, from the arms' summaries."""
    main = arms[first]
    held = main["heldout"]
    start = next((e for e in held if e["step"] == 0), None)
    end = held[-1] if held and held[-1]["step"] > 0 else None

    def figure(entry: dict[str, Any] | None) -> tuple[float, list[float]]:
        if entry is None:
            return math.nan, [math.nan, math.nan]
        return entry[f"correctness_{HEADLINE}"], [entry[f"correctness_{HEADLINE}_low"],
                                                   entry[f"correctness_{HEADLINE}_high"]]  # fmt: skip

    (c0, ci0), (c1, ci1) = figure(start), figure(end)
    common = min((a["steps"] for a in arms.values()), default=0)
    window = [max(1, common - 49), common]

    def accept(name: str) -> float:
        if name not in arms:
            return math.nan
        return _mean([r[1] for r in arms[name]["accept_len"]["rows"] if window[0] <= r[0] <= window[1]])

    summary = {
        "heldout_correctness_start": c0, "heldout_correctness_start_ci95": ci0,
        "heldout_correctness_end": c1, "heldout_correctness_end_ci95": ci1,
        "steps": main["steps"], "resumes": main["resumes"],
        "accept_len_cotrained_last50": accept("cotrained"), "accept_len_frozen_last50": accept("frozen"),
    }  # fmt: skip
    targets = {
        "correctness_rise": {"rise": c1 - c0, "target": 0.10, "intervals_apart": ci1[0] > ci0[1],
                             "met": c1 - c0 >= 0.10 and ci1[0] > ci0[1]},
        "accept_len_gain": {"gain": summary["accept_len_cotrained_last50"] - summary["accept_len_frozen_last50"],
                            "target": 0.3, "window_rl_steps": window,
                            "met": summary["accept_len_cotrained_last50"] >= summary["accept_len_frozen_last50"] + 0.3},
        "resumes": {"resumes": main["resumes"], "target": 2, "continuous": main["continuous"],
                    "steps_missing": len(main["steps_missing"]),
                    "met": main["resumes"] >= 2 and main["continuous"] and not main["steps_missing"]},
    }  # fmt: skip
    return summary, targets


# ----------------------------------------------------------------------------- plots
def plot(arms: dict[str, dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    """Held-out correctness against step with its interval band (greedy and sampled, each arm), and each
    arm's acceptance length over RL steps, on one plot each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "fit_heldout_correctness.png", out_dir / "fit_accept_len.png"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for i, (name, arm) in enumerate(arms.items()):
        for kind, style in ((HEADLINE, "-"), ("greedy", "--")):
            points = [e for e in arm["heldout"] if f"correctness_{kind}" in e]
            if not points:
                continue
            x = [e["step"] for e in points]
            ax.plot(x, [e[f"correctness_{kind}"] for e in points], style, marker="o", ms=3, color=f"C{i}",
                    label=f"{name}, {'T=1 x k' if kind == HEADLINE else 'greedy'}")  # fmt: skip
            ax.fill_between(x, [e[f"correctness_{kind}_low"] for e in points],
                            [e[f"correctness_{kind}_high"] for e in points], color=f"C{i}", alpha=0.12)  # fmt: skip
    _finish(fig, ax, "RL step (0: the warm-start policy, the control)", "held-out correctness (95 % interval)",
            f"{title}: held-out correctness", paths[0])
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for i, (name, arm) in enumerate(arms.items()):
        rows = [r for r in arm["accept_len"]["rows"] if r[1] == r[1]]
        ax.plot([r[0] for r in rows], [r[1] for r in rows], color=f"C{i}", lw=1, alpha=0.35)
        running = [_mean([r[1] for r in rows[max(0, j - 9) : j + 1]]) for j in range(len(rows))]
        ax.plot([r[0] for r in rows], running, color=f"C{i}", lw=2, label=f"{name} (10-step mean)")
    _finish(fig, ax, "RL step", "tokens per speculative step",
            f"{title}: acceptance length, co-trained vs frozen drafter", paths[1])
    return paths


def _finish(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- the report
def provenance(commit: str | None) -> dict[str, Any]:
    """The commit (``--commit``, else ``git rev-parse HEAD``), date, card and versions."""
    import lightning
    import torch
    import transformers

    if commit is None:
        done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
        commit = done.stdout.strip() if done.returncode == 0 else "unknown"
    return {"commit": commit, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name(), "versions": {"python": platform.python_version(), "torch": torch.__version__,
            "lightning": lightning.__version__, "transformers": transformers.__version__}}  # fmt: skip


def report(run_root: Path, arms: list[tuple[str, int]], args: argparse.Namespace) -> dict[str, Any]:
    """The JSON and the plots, from every arm folder there is under ``run_root``."""
    summaries: dict[str, dict[str, Any]] = {}
    for name, steps in arms:
        arm_dir = run_root / name
        if (arm_dir / "state.json").is_file():
            config = yaml.safe_load((arm_dir / "config.yaml").read_text())
            summaries[name] = {"target_steps": steps,
                               **arm_summary(arm_dir, json.loads((arm_dir / "state.json").read_text()),
                                             iterations(config))}  # fmt: skip
    if not summaries:
        raise SystemExit(f"nothing to report: no arm has run under {run_root}")
    first = arms[0][0] if arms[0][0] in summaries else next(iter(summaries))
    summary, targets = summarize(summaries, first)
    prov = provenance(args.commit)
    results = {
        "benchmark": "fit", "date": prov["date"], "card": prov["device"], "provenance": prov,
        "settings": {"config": _relative(args.config), "arms": dict(arms), "headline": f"eval/correctness_{HEADLINE}",
                     "summary_arm": first, "smoke": args.smoke},
        "complete": all(summaries.get(n, {}).get("steps", 0) >= s for n, s in arms),
        "summary": summary, "targets": targets,
        "heldout": {n: a["heldout"] for n, a in summaries.items()},
        "accept_len": {n: a["accept_len"] for n, a in summaries.items()},
        "arms": {n: {k: a[k] for k in ("target_steps", "steps", "resumes", "continuous", "steps_missing", "chunks")}
                 for n, a in summaries.items()},
    }  # fmt: skip
    plots = Path(args.plots) if args.plots else (ROOT / "benchmarks" / "results" / "smoke" / "img" if args.smoke
                                                  else ROOT / "docs" / "img")  # fmt: skip
    results["plots"] = [_relative(p) for p in plot(summaries, plots, Path(args.config).stem)]
    s = summary
    print(f"held-out correctness ({HEADLINE}): {s['heldout_correctness_start']:.3f} {_ci(s, 'start')} at step 0 -> "
          f"{s['heldout_correctness_end']:.3f} {_ci(s, 'end')}; {s['steps']} RL steps, {s['resumes']} resumes; "
          f"acceptance co-trained {s['accept_len_cotrained_last50']:.2f}, frozen {s['accept_len_frozen_last50']:.2f}",
          flush=True)  # fmt: skip
    for name, judged in targets.items():
        print(f"  target {name}: {'met' if judged['met'] else 'missed'} ({judged})", flush=True)
    write_results(results, "fit", smoke=args.smoke, cuda="cpu" not in prov["device"], out=args.out)
    return results


def _ci(summary: dict[str, Any], which: str) -> str:
    low, high = summary[f"heldout_correctness_{which}_ci95"]
    return f"[{low:.3f}, {high:.3f}]"


def _relative(path: str | Path) -> str:
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# ----------------------------------------------------------------------------- main
def parse_arms(text: str) -> list[tuple[str, int]]:
    arms = []
    for part in text.split(","):
        name, _, steps = part.partition(":")
        if not name.strip() or not steps.strip().isdigit() or int(steps) < 1:
            raise argparse.ArgumentTypeError(f"--arms wants NAME:STEPS,... (e.g. cotrained:200,frozen:100), got {part!r}")
        arms.append((name.strip(), int(steps)))
    return arms


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "configs" / "grpo_gpu_0.5b.yaml"))
    p.add_argument("--arms", type=parse_arms, default=None, help="NAME:STEPS,... (default cotrained:200,frozen:100)")
    p.add_argument("--budget-s", type=float, default=570.0, help="this call's wall time, the report included")
    p.add_argument("--save-s", type=float, default=60.0, help="time kept for the last step's checkpoint and exit")
    p.add_argument("--eval-s", type=float, default=150.0, help="an evaluation's time until one was measured")
    p.add_argument("--chunk-steps", type=int, default=0, help="stop a chunk after this many RL steps (0: by time)")
    p.add_argument("--chunks", type=int, default=1, help="chunks this call runs at most (0: until done or out of time)")
    p.add_argument("--eval-every", type=int, default=0, help="EvalCallback's every_n_steps (0: the config's)")
    p.add_argument("--eval-samples", type=int, default=0, help="EvalCallback's num_samples (0: the config's)")
    p.add_argument("--eval-prompts", type=int, default=0, help="EvalCallback's num_prompts (0: the config's)")
    p.add_argument("--run-dir", default=None, help="the arms' folders (default .cache/fit/<config name>)")
    p.add_argument("--report", action="store_true", help="write the report now, from what has run")
    p.add_argument("--commit", default=None, help="the commit to record (default: git rev-parse HEAD)")
    p.add_argument("--plots", default=None, help="where the plots go (default docs/img)")
    add_common_flags(p, smoke="the config shrunk to a tiny policy on the CPU, short arms, every chunk in one call")
    args = p.parse_args(argv)
    start = time.monotonic()
    if args.smoke:
        args.arms = args.arms or [("cotrained", 4), ("frozen", 2)]
        args.chunk_steps, args.chunks = args.chunk_steps or 2, 0
    arms = args.arms or [("cotrained", 200), ("frozen", 100)]
    base = yaml.safe_load(Path(args.config).read_text())
    base = smoke_config(base) if args.smoke else base
    run_root = Path(args.run_dir) if args.run_dir else ROOT / ".cache" / ("fit_smoke" if args.smoke else "fit") / Path(
        args.config).stem
    if args.smoke and args.run_dir is None and run_root.exists():
        shutil.rmtree(run_root)  # a smoke run starts afresh
    ran = 0
    for name, steps in arms:
        arm_dir = run_root / name
        arm_dir.mkdir(parents=True, exist_ok=True)
        state_path = arm_dir / "state.json"
        state = json.loads(state_path.read_text()) if state_path.is_file() else {"arm": name, "chunks": []}
        evaluation = {k: v for k, v in (("every_n_steps", args.eval_every), ("num_samples", args.eval_samples),
                                         ("num_prompts", args.eval_prompts)) if v}  # fmt: skip
        config = arm_config(base, name, steps, arm_dir, evaluation)
        (arm_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        while not arm_done(arm_dir, state, steps * iterations(config)):
            if args.chunks and ran >= args.chunks:
                print(f"[fit] {ran} chunk(s) run in this call; call again to go on", flush=True)
                return report(run_root, arms, args) if args.report else None
            deadline = start + args.budget_s
            if deadline - time.monotonic() < 2 * args.save_s:
                print("[fit] too little of this call's time is left for a chunk; call again", flush=True)
                return report(run_root, arms, args) if args.report else None
            record = run_chunk(arm_dir, state, args, deadline)
            state["chunks"].append(record)
            state_path.write_text(json.dumps(state, indent=1))
            ran += 1
            if record["exit_code"] not in (0, 143) and not arm_done(arm_dir, state, steps * iterations(config)):
                log = arm_dir / f"chunk{record['chunk']}.log"
                raise SystemExit(f"{name}: chunk {record['chunk']} failed (exit {record['exit_code']}); its log: {log}")
            newest = latest_checkpoint(arm_dir, state)
            if newest is not None:
                prune(arm_dir, newest)
        print(f"[fit] {name}: done ({steps} RL steps)", flush=True)
    print("[fit] all done", flush=True)
    return report(run_root, arms, args)


def arm_done(arm_dir: Path, state: dict[str, Any], max_steps: int) -> bool:
    """Whether the arm's newest checkpoint reached ``max_steps`` optimizer steps."""
    newest = latest_checkpoint(arm_dir, state)
    return newest is not None and checkpoint_step(newest) >= max_steps


if __name__ == "__main__":
    main()
