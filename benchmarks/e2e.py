"""End to end, side by side: TLT vs speculation off vs TRL ``GRPOTrainer`` on a long-tail GRPO workload.

The paper's table in miniature (issue 6), measured in one process on one GPU:

a. ``tlt``: lightning_tlt with speculation (suffix drafter while the EAGLE drafter is cold, then the
   EAGLE drafter co-trained in the stalls by `DrafterCoTrainCallback`) and CUDA graph profiles;
b. ``nospec``: the same engine and graphs with speculation off;
c. ``trl``: TRL's ``GRPOTrainer`` with its default HF ``generate`` on the same policy, task and settings
   (a few steps: its step time is what is compared).

All three start from the same warm-started (SFT) zoo policy, with the same seed and prompts. Per
configuration: step time split into rollout / reward / train / drafter, rollout tokens/s, response
lengths (p50, p90, p99, max), acceptance length over steps, share of rollout time in the tail,
reward per step. Writes JSON under ``benchmarks/results/`` and PNG plots under ``docs/``.

GPU: ``python benchmarks/e2e.py`` (defaults sized for one call of under 10 minutes on an H200).
CPU smoke check: ``python benchmarks/e2e.py --smoke``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig, StepEvent
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.rl.warmstart import warm_start, warm_start_dir
from lightning_tlt.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max of ``values`` (nearest-rank)."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    s = sorted(values)

    def rank(q: float) -> float:
        return float(s[min(len(s) - 1, max(0, round(q * len(s)) - 1))])

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": float(s[-1])}


class StepRecorder(Callback):
    """Per RL step: wall time, its split, lengths, reward and speculation figures.

    The rollout happens while the Trainer fetches the batch (before ``on_train_batch_start``), so a
    step's wall time runs from one ``on_train_batch_end`` to the next; the engine reports its own
    generation time, the reward time comes from the batch's metrics, the train time is timed here
    with device syncs, and step events split rollout time into the tail (active rows at or below
    ``tail_rows``) and the rest.
    """

    def __init__(self, tail_rows: int) -> None:
        self.tail_rows = tail_rows
        self._train_end = 0.0
        self.marker = _TrainEndMarker(self)
        """Put first in the Trainer's callbacks (this recorder last): it stamps the end of the
        training step, so the RL-step boundary work of other callbacks (drafter publishing) is timed apart."""
        self.steps: list[dict[str, Any]] = []
        self._last_end: float | None = None
        self._train_start = 0.0
        self._tail_s = 0.0
        self._bulk_s = 0.0
        self._engine_hooked = False

    def _on_event(self, event: StepEvent) -> None:
        if event.phase == "done":
            return
        if event.active_rows <= self.tail_rows:
            self._tail_s += event.step_time_s
        else:
            self._bulk_s += event.step_time_s

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync()
        self._last_end = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._engine_hooked:  # the engine exists once the first batch was generated
            trainer.datamodule.add_listener(self._on_event)  # type: ignore[attr-defined]
            self._engine_hooked = True
        _sync()
        self._train_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _sync()
        now = time.perf_counter()
        train_end = self._train_end or now
        m = dict(batch.metrics)
        lengths = batch.completion_mask.sum(1).tolist()
        record = {
            "step": len(self.steps),
            "wall_s": now - (self._last_end or now),
            "train_s": train_end - self._train_start,
            "boundary_s": now - train_end,
            "rollout_s": m.get("rollout/time_s", float("nan")),
            "reward_s": m.get("rollout/reward_time_s", float("nan")),
            "tail_s": self._tail_s,
            "bulk_s": self._bulk_s,
            "tokens": float(sum(lengths)),
            "tokens_per_s": m.get("rollout/tokens_per_s", float("nan")),
            "reward": m.get("reward", float("nan")),
            "lengths": lengths,
            "accept_len": m.get("spec/accept_len", float("nan")),
            "spec_fraction": m.get("spec/fraction", float("nan")),
            "metrics": {k: v for k, v in m.items() if isinstance(v, (int, float))},
        }
        cotrain = [c for c in trainer.callbacks if type(c).__name__ == "DrafterCoTrainCallback"]  # type: ignore[attr-defined]
        # drafter time: its training in the stalls (inside the rollout) plus its work at the boundary
        # (GPU time of the steps on the side stream, overlapping decode: CUDA events)
        record["drafter_stall_s"] = float(cotrain[0].last_metrics.get("drafter/train_time_s", 0.0)) if cotrain else 0.0
        record["drafter_s"] = record["drafter_stall_s"] + (record["boundary_s"] if cotrain else 0.0)
        record["eagle_drafting"] = float(trainer.callback_metrics.get("drafter/eagle_drafting", float("nan")))
        self.steps.append(record)
        self._tail_s = self._bulk_s = 0.0
        self._last_end = now


class _TrainEndMarker(Callback):
    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        _sync()
        self.recorder._train_end = time.perf_counter()


def load_policy(policy_dir: Path, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=dtype).to(device)


def grpo_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The GRPO options every configuration shares, by TRL's names (one source for a, b and c)."""
    return {
        "num_generations": args.generations,
        "max_completion_length": args.max_new,
        "temperature": 1.0,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "loss_type": "dapo",
        "beta": 0.0,
    }


def run_lightning(name: str, args: argparse.Namespace, seed: int, policy_dir: Path) -> dict[str, Any]:
    """One GRPO run of ``args.steps`` steps with the kit (configuration a or b)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    pl.seed_everything(seed, workers=False)
    policy = load_policy(policy_dir, device, dtype)
    config = GRPOConfig(**grpo_settings(args))
    module = GRPOModule(policy, config)
    # TLT's cold start: the suffix drafter speculates until the co-trained EAGLE drafter beats it
    speculative = SpeculativeConfig(method="suffix", threshold=args.threshold) if name == "tlt" else None
    data = RolloutDataModule(
        args.task,
        prompts_per_step=args.prompts,
        difficulty=args.difficulty,
        task_size=args.prompts * (args.steps + 2),
        speculative=speculative,
        seed=seed,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new),
        max_batch_size=args.prompts * args.generations,
    )
    recorder = StepRecorder(tail_rows=args.threshold)
    callbacks: list[Callback] = [recorder.marker]
    if name == "tlt" and args.drafter == "eagle":
        from lightning_tlt.callbacks.drafter_cotrain import DrafterCoTrainCallback

        callbacks.append(DrafterCoTrainCallback(stall_threshold=args.threshold, learning_rate=args.drafter_lr))
    callbacks.append(recorder)
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    t0 = time.perf_counter()
    trainer.fit(module, datamodule=data)
    total = time.perf_counter() - t0
    engine = data.engine
    graphs = getattr(engine, "graph_stats", None)
    return {
        "name": name,
        "seed": seed,
        "total_s": total,
        "steps": recorder.steps,
        "graph_stats": dict(graphs) if isinstance(graphs, dict) else None,
    }


def run_trl(args: argparse.Namespace, seed: int, policy_dir: Path) -> dict[str, Any]:
    """Configuration c: TRL's GRPOTrainer with its default HF generation, a few steps."""
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLGRPOConfig
    from trl import GRPOTrainer

    task = get_task(args.task)
    cuda = torch.cuda.is_available()
    dataset = task.make_dataset(args.prompts * (args.trl_steps + 2), difficulty=args.difficulty, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            _sync()
            self.t = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            _sync()
            times.append(time.perf_counter() - self.t)

    out_dir = ROOT / ".cache" / "e2e_trl"
    cfg = TRLGRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=args.prompts * args.generations,
        **grpo_settings(args),
        max_steps=args.trl_steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=seed,
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=str(policy_dir),
        reward_funcs=list(task.reward_funcs),
        args=cfg,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "name": "trl",
        "seed": seed,
        "step_s": times,
        "reward": [h.get("reward") for h in logged],
        "mean_length": [h.get("completions/mean_length") for h in logged],
    }


def summarize(run: dict[str, Any], skip: int) -> dict[str, Any]:
    """Means over the steps after the first ``skip`` (warm-up: compile, graph capture)."""
    steps = run["steps"][skip:] or run["steps"]
    mean = lambda key: statistics.fmean(s[key] for s in steps)  # noqa: E731
    lengths = [n for s in run["steps"] for n in s["lengths"]]
    rollout = mean("rollout_s")
    return {
        "step_s": mean("wall_s"),
        "rollout_s": rollout,
        "reward_s": mean("reward_s"),
        "train_s": mean("train_s"),
        "boundary_s": mean("boundary_s"),
        "drafter_s": mean("drafter_s"),
        "tokens_per_s": statistics.fmean(s["tokens"] for s in steps) / rollout if rollout > 0 else float("nan"),
        "tail_share": mean("tail_s") / max(1e-9, mean("tail_s") + mean("bulk_s")),
        "tail_s": mean("tail_s"),
        "lengths": percentiles([float(n) for n in lengths]),
        "reward_curve": [s["reward"] for s in run["steps"]],
        "accept_len_curve": [s["accept_len"] for s in run["steps"]],
    }


def plot(results: dict[str, Any], out_dir: Path) -> list[str]:
    """Reward curves a vs b, step-time bars, length histogram, acceptance over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    runs = results["runs"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        if run["name"] in ("tlt", "nospec"):
            ax.plot([s["reward"] for s in run["steps"]], label=f"{run['name']} (seed {run['seed']})")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward")
    ax.set_title("Reward per step: TLT vs speculation off")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "e2e_reward.png", dpi=120)
    written.append("e2e_reward.png")

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.5), gridspec_kw={"width_ratios": [2, 1.4]})
    names = [n for n in ("tlt", "nospec") if n in results["summary"]]
    parts = ("rollout_s", "reward_s", "train_s", "boundary_s")
    bottom = [0.0] * len(names)
    for part in parts:
        vals = [results["summary"][n].get(part, 0.0) for n in names]
        ax.bar(names, vals, bottom=bottom, label=part.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("seconds per RL step")
    ax.set_title("Step time split (kit)")
    ax.legend(fontsize=8)
    totals = {n: results["summary"][n]["step_s"] for n in ("tlt", "nospec", "trl") if n in results["summary"]}
    bars = ax2.bar(list(totals), list(totals.values()), color=["C0", "C1", "C3"][: len(totals)])
    ax2.bar_label(bars, fmt="%.2f s")
    ax2.set_title("Whole RL step")
    fig.tight_layout()
    fig.savefig(out_dir / "e2e_step_time.png", dpi=120)
    written.append("e2e_step_time.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    lengths = [n for run in runs if run["name"] == "nospec" for s in run["steps"] for n in s["lengths"]]
    ax.hist(lengths, bins=50)
    ax.set_yscale("log")
    ax.set_xlabel("completion length (tokens)")
    ax.set_ylabel("count")
    ax.set_title("Response lengths (speculation off run)")
    fig.tight_layout()
    fig.savefig(out_dir / "e2e_lengths.png", dpi=120)
    written.append("e2e_lengths.png")

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in runs:
        if run["name"] == "tlt":
            ax.plot([s["accept_len"] for s in run["steps"]], marker="o", label=f"seed {run['seed']}")
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean tokens per verify step")
    ax.set_title("Acceptance length over steps (TLT)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "e2e_acceptance.png", dpi=120)
    written.append("e2e_acceptance.png")
    plt.close("all")
    return written


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="countdown")
    p.add_argument("--difficulty", type=int, default=2)
    p.add_argument("--arch", default="qwen2")
    p.add_argument("--size", default="100m")
    p.add_argument("--sft-steps", type=int, default=400)
    p.add_argument("--sft-batch", type=int, default=64)
    p.add_argument("--sft-lr", type=float, default=5e-4)
    p.add_argument("--steps", type=int, default=10, help="GRPO steps of configurations a and b")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the means (compile, capture)")
    p.add_argument("--trl-steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16, help="prompts per RL step")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--threshold", type=int, default=32, help="speculation gate / stall threshold (active rows)")
    p.add_argument("--drafter", choices=("eagle", "suffix"), default="eagle",
                   help="eagle: suffix first, then the co-trained EAGLE drafter; suffix: suffix only")
    p.add_argument("--drafter-lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--configs", default="tlt,nospec,trl")
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "lightning_tlt"))
    p.add_argument("--out", default=None)
    p.add_argument("--plots", default=str(ROOT / "docs" / "img"))
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a CPU check of the script in a minute or two")
    args = p.parse_args(argv)
    if args.smoke:
        args.size, args.sft_steps, args.sft_batch, args.steps, args.skip = "tiny", 30, 16, 2, 0
        args.trl_steps, args.prompts, args.generations, args.max_new, args.seeds = 1, 2, 4, 48, "0"
        args.difficulty, args.task, args.threshold, args.plots = 1, "arithmetic", 4, None
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    seeds = [int(s) for s in args.seeds.split(",")]
    configs = args.configs.split(",")
    ws = dict(difficulty=args.difficulty, seed=0, steps=args.sft_steps, batch_size=args.sft_batch, lr=args.sft_lr,
              cache_dir=args.cache_dir)
    t0 = time.perf_counter()
    warm_start(args.task, args.arch, args.size, device=device, progress=False, **ws)
    sft_s = time.perf_counter() - t0
    policy_dir = warm_start_dir(args.task, args.arch, args.size, **ws)
    runs = []
    for seed in seeds:
        for name in ("tlt", "nospec"):
            if name in configs:
                runs.append(run_lightning(name, args, seed, policy_dir))
                print(f"[e2e] {name} seed {seed}: {runs[-1]['total_s']:.1f} s", flush=True)
    summary = {}
    for name in ("tlt", "nospec"):
        mine = [summarize(r, args.skip) for r in runs if r["name"] == name]
        if mine:
            summary[name] = {k: (statistics.fmean(m[k] for m in mine) if isinstance(mine[0][k], float) else mine[0][k])
                             for k in mine[0]}
    trl_runs = []
    if "trl" in configs:
        trl_runs.append(run_trl(args, seeds[0], policy_dir))
        steps = trl_runs[0]["step_s"][1:] or trl_runs[0]["step_s"]
        summary["trl"] = {"step_s": statistics.fmean(steps), "first_step_s": trl_runs[0]["step_s"][0]}
    ratios = {}
    if "tlt" in summary and "nospec" in summary:
        a, b = summary["tlt"], summary["nospec"]
        ratios["a_over_b_step"] = b["step_s"] / a["step_s"]
        ratios["a_over_b_rollout"] = b["rollout_s"] / a["rollout_s"]
        ratios["a_over_b_tail"] = b["tail_s"] / a["tail_s"] if a["tail_s"] > 0 else float("nan")
    if "trl" in summary:
        for name in ("tlt", "nospec"):
            if name in summary:
                ratios[f"{name}_over_trl_step"] = summary["trl"]["step_s"] / summary[name]["step_s"]
    results: dict[str, Any] = {
        "benchmark": "e2e",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "card": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "lightning": pl.__version__, "python": platform.python_version()},
        "args": vars(args),
        "sft_s": sft_s,
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
        "trl_runs": trl_runs,
    }
    try:
        import transformers

        results["versions"]["transformers"] = transformers.__version__
        import trl

        results["versions"]["trl"] = trl.__version__
    except ImportError:
        pass
    print_table(results)
    if args.plots:
        results["plots"] = plot(results, Path(args.plots))
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / ("smoke" if args.smoke else "") / (
        f"e2e_{'smoke' if args.smoke else device}.json")  # smoke runs: a git-ignored folder
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, default=float))
    print(f"[e2e] wrote {out}")
    return results


def print_table(results: dict[str, Any]) -> None:
    s = results["summary"]
    print(f"\n{'config':8} {'step s':>8} {'rollout':>8} {'reward':>7} {'train':>7} {'drafter':>7} "
          f"{'tok/s':>9} {'tail%':>6} {'p50':>5} {'p99':>5} {'max':>5} {'acc.len':>7}")
    for name in ("tlt", "nospec"):
        if name in s:
            r = s[name]
            acc = [x for x in r["accept_len_curve"] if x == x]
            print(f"{name:8} {r['step_s']:8.2f} {r['rollout_s']:8.2f} {r['reward_s']:7.3f} {r['train_s']:7.2f} "
                  f"{r['drafter_s']:7.3f} {r['tokens_per_s']:9.0f} {100 * r['tail_share']:6.1f} "
                  f"{r['lengths']['p50']:5.0f} {r['lengths']['p99']:5.0f} {r['lengths']['max']:5.0f} "
                  f"{(statistics.fmean(acc) if acc else float('nan')):7.2f}")
    if "trl" in s:
        print(f"{'trl':8} {s['trl']['step_s']:8.2f}   (first step {s['trl']['first_step_s']:.2f} s)")
    for k, v in results["ratios"].items():
        print(f"  {k}: {v:.2f}x")


if __name__ == "__main__":
    main()
