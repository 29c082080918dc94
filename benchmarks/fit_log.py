"""A ``lightning-tlt fit`` run's printed per-step lines, as a results JSON and a correctness plot.

Where a run's CSV did not come back (a remote call ended by its time limit keeps only the log), the
lines `RolloutMetricsCallback` prints (`lightning_tlt.callbacks.rollout_metrics.summary_line`) still
hold each RL step's reward, correctness, format, lengths, throughput, speculation and step time::

    python benchmarks/fit_log.py run.log --name grpo_gpu_0.5b --card "NVIDIA H200"

writes ``benchmarks/results/fit_<name>_<card>_<date>.json`` (the steps, and ``summary``: correctness
by quarter of the steps run, first and last ten steps' means, the mean step time after the first
two steps) and ``docs/img/fit_<name>_correctness.png`` (per step and a ten-step running mean).
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import statistics
from pathlib import Path
from typing import Any

from _common import ROOT, add_common_flags, write_results

_NUMBER = r"([-\d.,]+)"
_FIELDS = {
    "reward": rf"\| reward {_NUMBER} ± {_NUMBER}",
    "correctness": rf"correctness {_NUMBER}",
    "format": rf"format {_NUMBER}",
    "mean_length": rf"\| len {_NUMBER} \(clipped {_NUMBER}%\)",
    "tokens_per_s": rf"\| {_NUMBER} tok/s",
    "spec_fraction": rf"\| spec {_NUMBER}%",
    "accept_len": rf"accept {_NUMBER}",
    "step_s": rf"\| {_NUMBER} s$",
}


def parse_steps(text: str) -> list[dict[str, float]]:
    """Every ``step N/M | reward ...`` line of ``text``, in order, as numbers (a field a line lacks is
    left out); a later line of the same step (a resumed run) replaces the earlier one."""
    steps: dict[int, dict[str, float]] = {}
    for line in text.splitlines():
        head = re.match(r"^step (\d+)(?:/(\d+))? \| ", line.strip())
        if head is None:
            continue
        row: dict[str, float] = {"step": float(head.group(1))}
        for name, pattern in _FIELDS.items():
            found = re.search(pattern, line.strip())
            if found is None:
                continue
            values = [float(v.replace(",", "")) for v in found.groups()]
            row[name] = values[0]
            if name == "reward":
                row["reward_std"] = values[1]
            elif name == "mean_length":
                row["clipped"] = values[1] / 100
            elif name == "spec_fraction":
                row[name] = values[0] / 100
        steps[int(row["step"])] = row
    return [steps[k] for k in sorted(steps)]


def summarize(steps: list[dict[str, float]], skip: int = 2) -> dict[str, Any]:
    """Correctness by quarter of the steps run, first and last ten steps' means, mean step time."""
    if not steps:
        raise ValueError("no per-step lines ('step N/M | reward ...') found: is this a lightning-tlt fit log?")
    corr = [s["correctness"] for s in steps if "correctness" in s]
    cuts = [round(i * len(corr) / 4) for i in range(5)]  # four runs of steps, every step in one
    times = [s["step_s"] for s in steps[skip:] if "step_s" in s]
    return {
        "steps": len(steps),
        "last_step": int(steps[-1]["step"]),
        "correctness_by_quarter": [statistics.fmean(corr[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a],
        "correctness_first10": statistics.fmean(corr[:10]) if corr else float("nan"),
        "correctness_last10": statistics.fmean(corr[-10:]) if corr else float("nan"),
        "step_s": statistics.fmean(times) if times else float("nan"),
    }


def plot(steps: list[dict[str, float]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [s["step"] for s in steps if "correctness" in s]
    y = [s["correctness"] for s in steps if "correctness" in s]
    running = [statistics.fmean(y[max(0, i - 9) : i + 1]) for i in range(len(y))]
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    ax.plot(x, y, color="0.7", lw=1, label="per RL step")
    ax.plot(x, running, color="C0", lw=2, label="mean of the last 10 steps")
    ax.set_xlabel("RL step")
    ax.set_ylabel("correctness")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log", type=Path, help="the run's printed output")
    p.add_argument("--name", required=True, help="the config's name, e.g. grpo_gpu_0.5b")
    p.add_argument("--card", default="cpu", help="where the run ran (the log does not say)")
    p.add_argument("--date", default=None, help="when it ran (ISO date; default: the log file's time)")
    add_common_flags(p, smoke=False)
    p.add_argument("--plots", default=str(ROOT / "docs" / "img"))
    args = p.parse_args(argv)
    if not args.log.is_file():
        raise SystemExit(f"no such log: {args.log}")
    steps = parse_steps(args.log.read_text(errors="replace"))
    date = args.date or dt.datetime.fromtimestamp(args.log.stat().st_mtime, dt.timezone.utc).isoformat(timespec="seconds")
    results = {"benchmark": f"fit_{args.name}", "date": date, "card": args.card, "source_log": args.log.name,
               "summary": summarize(steps), "steps": steps}  # fmt: skip
    plot(steps, f"{args.name}: correctness over RL steps ({args.card})", Path(args.plots) / f"fit_{args.name}_correctness.png")
    s = results["summary"]
    print(f"{s['steps']} steps (last {s['last_step']}); correctness by quarter "
          f"{' -> '.join(f'{c:.3f}' for c in s['correctness_by_quarter'])}; first 10 {s['correctness_first10']:.3f}, "
          f"last 10 {s['correctness_last10']:.3f}; {s['step_s']:.2f} s a step")  # fmt: skip
    write_results(results, f"fit_{args.name}", smoke=False, cuda="H200" in args.card, out=args.out)
    return results


if __name__ == "__main__":
    main()
