"""Drafter co-training over RL steps: acceptance with co-training vs a frozen drafter, and its cost.

Three GRPO runs of the same warm-started policy, seed, prompts and settings (issue 4's benchmark):

a. ``cotrain``: EAGLE speculation, the drafter co-trained in the stalls by `DrafterCoTrainCallback`
   and published every RL step;
b. ``frozen``: EAGLE speculation with the cold drafter, never trained (no callback);
c. ``nospec_cotrain`` / ``nospec``: speculation off, with and without the callback, so the only
   difference in rollout time is the co-training itself (target: at most 2 % slower).

Per RL step: the engine's acceptance length (``spec/accept_len``), rollout time and tokens/s, the
callback's drafter steps, loss, held-out acceptance and stall time available vs used. Prints a
table and writes JSON under ``benchmarks/results/`` with the device, versions and date.

GPU: ``python benchmarks/cotrain.py`` (one call of a few minutes on an H200).
CPU smoke check: ``python benchmarks/cotrain.py --smoke``.
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

from lightning_tlt.callbacks.drafter_cotrain import DrafterCoTrainCallback, DrafterCoTrainConfig
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("cotrain", "frozen", "nospec_cotrain", "nospec")


class Recorder(Callback):
    """The batch's rollout metrics and the co-training callback's figures, per RL step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        m = dict(batch.metrics)
        record: dict[str, Any] = {
            "step": len(self.steps),
            "rollout_s": m.get("rollout/time_s", float("nan")),
            "tokens": float(batch.completion_mask.sum()),
            "tokens_per_s": m.get("rollout/tokens_per_s", float("nan")),
            "accept_len": m.get("spec/accept_len", float("nan")),
            "spec_fraction": m.get("spec/fraction", float("nan")),
            "reward": m.get("reward", float("nan")),
        }
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, DrafterCoTrainCallback):
                record.update({k.removeprefix("drafter/"): v for k, v in cb.last_metrics.items()})
        self.steps.append(record)


def build_policy(args: argparse.Namespace, device: str) -> torch.nn.Module:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if args.sft_steps > 0:
        from lightning_tlt.models.warmstart import warm_start

        model, _ = warm_start(
            args.task, args.arch, args.size, difficulty=args.difficulty, steps=args.sft_steps,
            cache_dir=args.cache_dir, device=device, progress=False,
        )  # fmt: skip
    else:
        from lightning_tlt.models.zoo import build_model

        model = build_model(args.arch, args.size, seed=0)
    return model.to(device=device, dtype=dtype)


def run(name: str, args: argparse.Namespace, device: str) -> dict[str, Any]:
    pl.seed_everything(args.seed, workers=False)
    policy = build_policy(args, device)
    config = GRPOConfig(
        num_generations=args.generations, max_completion_length=args.max_new, temperature=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0,
    )  # fmt: skip
    speculative = None
    if name in ("cotrain", "frozen"):
        speculative = SpeculativeConfig(method="eagle", threshold=args.threshold, num_draft_tokens=args.k)
    data = RolloutDataModule(
        args.task, prompts_per_step=args.prompts, difficulty=args.difficulty,
        task_size=args.prompts * (args.steps + 2), speculative=speculative, seed=args.seed,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new),
        max_batch_size=args.prompts * args.generations,
    )  # fmt: skip
    recorder = Recorder()
    callbacks: list[Callback] = [recorder]
    if name in ("cotrain", "nospec_cotrain"):
        callbacks.append(
            DrafterCoTrainCallback(
                DrafterCoTrainConfig(
                    stall_threshold=args.stall_threshold, time_budget_s=args.budget_s,
                    max_steps_per_event=args.steps_per_event, learning_rate=args.drafter_lr,
                    batch_size=args.drafter_batch, max_len=args.drafter_max_len, seed=args.seed,
                )
            )
        )  # fmt: skip
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(GRPOModule(policy, config), datamodule=data)
    return {"name": name, "total_s": time.perf_counter() - start, "steps": recorder.steps}


def _mean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.fmean(finite) if finite else float("nan")


def summarize(runs: dict[str, dict[str, Any]], skip: int) -> dict[str, Any]:
    """Means over the steps after ``skip`` (graph capture and compilation happen in the first ones)."""
    out: dict[str, Any] = {}
    for name, r in runs.items():
        steps = r["steps"][skip:] or r["steps"]
        out[name] = {
            "rollout_s": _mean([s["rollout_s"] for s in steps]),
            "tokens_per_s": _mean([s["tokens_per_s"] for s in steps]),
            "accept_len": _mean([s["accept_len"] for s in steps]),
            "accept_len_by_step": [s["accept_len"] for s in r["steps"]],
            "drafter_steps": sum(s.get("steps_this_rl_step", 0.0) for s in r["steps"]),
        }
    if "nospec" in out and "nospec_cotrain" in out:
        # rollout time per token, so different completion lengths do not count as overhead
        per_token = {
            n: _mean(
                [
                    s["rollout_s"] / max(s["tokens"], 1.0)
                    for s in (runs[n]["steps"][skip:] or runs[n]["steps"])
                ]
            )
            for n in ("nospec", "nospec_cotrain")
        }
        out["cotrain_rollout_overhead"] = per_token["nospec_cotrain"] / per_token["nospec"] - 1.0
    return out


def print_table(runs: dict[str, dict[str, Any]], summary: dict[str, Any]) -> None:
    print(f"{'config':<16} {'rollout s':>10} {'tok/s':>10} {'accept len':>11} {'drafter steps':>14}")
    for name in runs:
        s = summary[name]
        print(f"{name:<16} {s['rollout_s']:>10.3f} {s['tokens_per_s']:>10.1f} {s['accept_len']:>11.2f} "
              f"{s['drafter_steps']:>14.0f}")  # fmt: skip
    for name in ("cotrain", "frozen"):
        if name in summary:
            by_step = ", ".join(f"{v:.2f}" for v in summary[name]["accept_len_by_step"])
            print(f"acceptance length by RL step, {name}: {by_step}")
    if "cotrain_rollout_overhead" in summary:
        print(f"rollout time per token, co-training on vs off (no speculation): "
              f"{100 * summary['cotrain_rollout_overhead']:+.1f} % (target <= +2 %)")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="countdown")
    p.add_argument("--difficulty", type=int, default=2)
    p.add_argument("--arch", default="qwen2")
    p.add_argument("--size", default="100m")
    p.add_argument(
        "--sft-steps", type=int, default=400, help="warm start (cached); 0 starts from the random init"
    )
    p.add_argument("--steps", type=int, default=12, help="RL steps per configuration")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the means")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--k", type=int, default=4, help="drafted tokens per speculative step")
    p.add_argument("--threshold", type=int, default=32, help="speculation gate threshold (active rows)")
    p.add_argument("--stall-threshold", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=0.005, help="drafter time budget per stall event")
    p.add_argument("--steps-per-event", type=int, default=2)
    p.add_argument("--drafter-lr", type=float, default=3e-4)
    p.add_argument("--drafter-batch", type=int, default=8)
    p.add_argument("--drafter-max-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "lightning_tlt"))
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="tiny sizes: a CPU check of the script")
    args = p.parse_args(argv)
    if args.smoke:
        args.task, args.difficulty, args.size, args.sft_steps = "arithmetic", 1, "tiny", 0
        args.steps, args.skip, args.prompts, args.generations, args.max_new = 3, 1, 2, 4, 16
        args.threshold, args.stall_threshold, args.budget_s, args.drafter_batch = 8, 8, 1.0, 4
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    names = [n for n in args.configs.split(",") if n]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise ValueError(f"unknown configs {bad}; allowed: {CONFIGS}")
    runs = {name: run(name, args, device) for name in names}
    summary = summarize(runs, args.skip)
    print_table(runs, summary)
    result = {
        "benchmark": "cotrain",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "python": platform.python_version(),
        },
        "args": vars(args),
        "summary": summary,
        "runs": runs,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / ("smoke" if args.smoke else "") / (
        f"cotrain_{'smoke' if args.smoke else device}_{dt.date.today():%Y%m%d}.json"
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
