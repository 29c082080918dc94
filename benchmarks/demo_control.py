"""The README's main job against a control: does correctness rise because GRPO learns?

Runs ``lightning-tlt fit --config configs/demo_cpu.yaml`` as the README does, and beside it the same
command with the learning rate at ``--control-lr`` (1e-12: the same rollouts, rewards, speculation
and co-training, but updates too small to move the policy), for each of ``--seeds`` (the config's
``seed_everything`` and ``data.seed``, which keys the prompts' order and the rollouts' sampling noise;
the warm-started policy is the same cached one). Correctness is compared between the
first and the last pass over the task's 128 prompts (RL steps 1-8 and 33-40), as
``tests/rl/test_grpo_demo.py`` does.

Writes ``benchmarks/results/demo_control_<card>_<date>.json``: per seed and arm the first and last
pass's correctness and their difference; ``summary``: each arm's mean rise over the seeds and its
range; ``ratios``: none (a difference of rises, ``rise_over_control``, is in ``summary``). The runs'
metrics CSVs go under ``--work-dir``.

    python benchmarks/demo_control.py --seeds 0,1
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import ROOT, add_common_flags, write_results

CORRECTNESS = "rewards/countdown_search_correctness/mean"
STEPS_PER_PASS = 8  # task_size 128 / prompts_per_step 16


def run(config: Path, seed: int, lr: float | None, work: Path) -> dict[str, Any]:
    """One fit; its correctness per RL step, from its metrics CSV."""
    name = f"seed{seed}_{'trained' if lr is None else 'control'}"
    argv = [sys.executable, "-m", "lightning_tlt.cli", "fit", "--config", str(config), f"--seed_everything={seed}",
            f"--data.seed={seed}",
            f"--trainer.logger.init_args.save_dir={work / name}", f"--trainer.default_root_dir={work / name}",
            "--trainer.enable_progress_bar=false"]  # fmt: skip
    if lr is not None:
        argv.append(f"--model.init_args.config.learning_rate={lr}")
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: lightning-tlt fit exited {done.returncode}:\n{done.stderr[-3000:]}")
    (path,) = sorted((work / name).glob("*/version_*/metrics.csv"))[-1:]
    correct = [float(r[CORRECTNESS]) for r in csv.DictReader(open(path)) if r.get(CORRECTNESS)]
    if len(correct) < 2 * STEPS_PER_PASS:
        raise RuntimeError(f"{name}: {len(correct)} RL steps logged, fewer than two passes")
    first = statistics.fmean(correct[:STEPS_PER_PASS])
    last = statistics.fmean(correct[-STEPS_PER_PASS:])
    print(f"{name}: correctness {first:.3f} (first pass) -> {last:.3f} (last pass), {last - first:+.3f}, "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    return {"seed": seed, "arm": "trained" if lr is None else "control", "learning_rate": lr,
            "correctness": correct, "first_pass": first, "last_pass": last, "rise": last - first,
            "wall_s": time.perf_counter() - start}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=ROOT / "configs" / "demo_cpu.yaml")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--control-lr", type=float, default=1e-12)
    p.add_argument("--work-dir", type=Path, default=ROOT / ".cache" / "demo_control")
    add_common_flags(p, smoke=False)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.config.is_file():
        raise SystemExit(f"--config {args.config}: no such file")
    if not 0 < args.control_lr < 1e-8:
        raise SystemExit(f"--control-lr {args.control_lr}: must be in (0, 1e-8) (the module refuses 0; larger moves)")
    runs = [run(args.config, seed, lr, args.work_dir) for seed in seeds for lr in (None, args.control_lr)]

    def arm(name: str) -> dict[str, Any]:
        rises = [r["rise"] for r in runs if r["arm"] == name]
        return {"rise_mean": statistics.fmean(rises), "rise_min": min(rises), "rise_max": max(rises),
                "first_pass_mean": statistics.fmean(r["first_pass"] for r in runs if r["arm"] == name),
                "last_pass_mean": statistics.fmean(r["last_pass"] for r in runs if r["arm"] == name)}  # fmt: skip

    summary = {"trained": arm("trained"), "control": arm("control")}
    summary["rise_over_control"] = summary["trained"]["rise_mean"] - summary["control"]["rise_mean"]
    results = {
        "benchmark": "demo_control",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "card": f"cpu ({platform.processor() or platform.machine()})",
        "versions": {"python": platform.python_version(), "torch": __import__("torch").__version__},
        "settings": {"config": str(args.config.relative_to(ROOT)) if args.config.is_relative_to(ROOT) else str(args.config),
                     "seeds": seeds, "control_lr": args.control_lr},  # fmt: skip
        "summary": summary,
        "runs": runs,
    }
    for name in ("trained", "control"):
        s = summary[name]
        print(f"{name:8s} correctness {s['first_pass_mean']:.3f} -> {s['last_pass_mean']:.3f}: rise {s['rise_mean']:+.3f} "
              f"(seeds {s['rise_min']:+.3f} .. {s['rise_max']:+.3f})")
    print(f"rise over the control: {summary['rise_over_control']:+.3f}")
    write_results(results, "demo_control", smoke=False, cuda=False, out=args.out)
    return results


if __name__ == "__main__":
    main()
