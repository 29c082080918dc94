"""The report's plots: correctness a vs b, the step-time split, response lengths, acceptance over steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(results: dict[str, Any], runs: list[dict[str, Any]], out_dir: Path) -> list[str]:
    """Correctness curves a vs b, step-time split, length histogram, acceptance over steps, every step's wall
    time per seed (headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    summary = results["summary"]

    def save(fig: Any, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=120)
        written.append(str(out_dir / name))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        style = "-" if run["name"] == "tlt" else "--"
        ax.plot([s["correctness"] for s in run["steps"]], style, label=f"{run['name']} (seed {run['seed']})")
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("correctness (step mean)")
    ax.set_title("Correctness per step: TLT vs speculation off")
    ax.legend(fontsize=8)
    save(fig, "e2e_correctness.png")

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.5), gridspec_kw={"width_ratios": [2, 1.4]})
    names = [n for n in ("tlt", "nospec") if n in summary]
    bottom = [0.0] * len(names)
    once = {n: summary[n].get("capture_s_per_step", 0.0) for n in names}  # compiling, capturing: one-time
    rest = {n: summary[n]["rollout_s"] - summary[n]["tail_s"] - once[n] for n in names}
    for part, label in (
        ("tail_s", "rollout: tail"),
        ("once", "rollout: compile + capture (once)"),
        ("rest", "rollout: rest"),
        ("reward_s", "reward"),
        ("train_s", "train"),
    ):
        vals = [once[n] if part == "once" else rest[n] if part == "rest" else summary[n][part] for n in names]
        ax.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    # the drafter trains on a side stream inside the tail: its GPU time overlaps the tail, not added to it
    ax.bar(names, [summary[n]["drafter_s"] for n in names], width=0.5, fill=False, hatch="//",
           edgecolor="C7", label="drafter (GPU, beside the tail)")  # fmt: skip
    ax.set_ylabel("seconds per RL step")
    ax.set_title("Step time split (kit)")
    ax.legend(fontsize=7)
    totals = {n: summary[n]["step_s"] for n in ("tlt", "nospec", "trl") if n in summary}
    bars = ax2.bar(list(totals), list(totals.values()), color=["C0", "C1", "C3"][: len(totals)])
    ax2.bar_label(bars, fmt="%.1f s")
    ax2.set_title("Whole RL step")
    save(fig, "e2e_step_time.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    lengths = [n for run in runs if run["name"] == "nospec" for s in run["steps"] for n in s["lengths"]]
    ax.hist(lengths, bins=50)
    ax.set_yscale("log")
    ax.set_xlabel("completion length (tokens)")
    ax.set_ylabel("count")
    ax.set_title("Response lengths (speculation off)")
    save(fig, "e2e_lengths.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        if run["name"] == "tlt":
            ax.plot([s["accept_len"] for s in run["steps"]], marker="o", label=f"seed {run['seed']}")
    ax.set_xlabel("RL step")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.set_ylabel("tokens per verify step")
    ax.set_title("Acceptance length over steps (TLT)")
    ax.legend(fontsize=8)
    save(fig, "e2e_acceptance.png")

    # every step's wall time, a and b side by side per seed; the steps that compiled marked (a one-time
    # cost that lands wherever a step function is first used: step 0, or the step the EAGLE drafter
    # first drives speculation)
    seeds = sorted({run["seed"] for run in runs})
    fig, axes = plt.subplots(1, len(seeds), figsize=(4 * len(seeds), 3.2), sharey=True, squeeze=False)
    for ax, seed in zip(axes[0], seeds):
        for run in (r for r in runs if r["seed"] == seed):
            walls = [s["wall_s"] for s in run["steps"]]
            color = "C0" if run["name"] == "tlt" else "C1"
            ax.plot(walls, "-" if run["name"] == "tlt" else "--", color=color, label=run["name"])
            hot = [(i, w) for i, (s, w) in enumerate(zip(run["steps"], walls)) if s.get("compile_s", 0.0) > 0.5]
            if hot:
                ax.plot(*zip(*hot), "x", color=color, markersize=8)
        ax.set_yscale("log")
        ax.set_xlabel("RL step")
        ax.set_title(f"seed {seed}")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axes[0][0].set_ylabel("wall seconds (x: the step compiled)")
    axes[0][0].legend(fontsize=8)
    save(fig, "e2e_step_wall.png")
    plt.close("all")
    return written
