"""Drafter co-training in the stalls, measured: five arms from the same start (issue 14).

TLT (arXiv 2511.16665) trains the drafter while the long tail keeps the GPU waiting. Every arm
starts from the same warm-started policy and the same warm-started drafter, with the same seed and
prompts, on a long-tail GRPO workload:

- ``cotrain``: EAGLE speculation, the drafter co-trained in the stalls by `DrafterCoTrainCallback`
  (a captured train step replayed on a side stream) and published every RL step;
- ``frozen``: the same drafter, never trained;
- ``shadow``: the frozen arm with co-training running beside decode, its updates discarded (never
  published): the same rollouts as ``frozen``, so its tail tokens/s over ``frozen``'s is what
  co-training costs decode;
- ``nospec``: speculation off;
- ``cold``: an untrained drafter, co-trained from the first RL step.

The warm start runs inside the time budget: the policy by SFT (`lightning_tlt.rl.warmstart`,
cached on disk), then the drafter offline on the policy's own rollouts
(`lightning_tlt.drafters.offline.train_drafter`), saved with ``save_pretrained`` (the directory vLLM
loads) and loaded by every arm. Arms share what is left of ``--time-budget-s`` (an arm that runs out
stops early; its JSON says how many RL steps it made).

JSON ``"summary"``: ``drafter_steps_per_rl_step`` (co-trained arm), ``decode_slowdown`` (tail
tokens/s of ``shadow`` over ``frozen``), ``accept_len_first`` and ``accept_len_last`` (co-trained),
``frozen_accept_len_last``, ``cold_accept_len_after_10``. Targets: >= 50, >= 0.95, last >= frozen
last and >= 3, >= 2.5. Plot of acceptance over RL steps: ``docs/img/cotrain_acceptance.png``.

GPU (one call of about 8 minutes on an H200)::

    python benchmarks/cotrain.py --task countdown --size 100m --time-budget-s 450

At 0.5 B on the long-tail workload, from the warm starts `benchmarks/e2e.py` cached on the machine
(each finished arm is kept, so a second call with the same settings runs the arms left; on the H200
cotrain and frozen took 286 s, shadow, cold and nospec 404 s)::

    python benchmarks/cotrain.py --task countdown_search --difficulty 3 --size 0.5b --max-new 4096 --k 0 \
        --policy-dir .cache/lightning_tlt/countdown_search-qwen2-0.5b-d3-... --drafter-dir .cache/e2e/drafter-.../drafter

With ``--k 0`` the tuner picks k from measured step times, so ``shadow`` and ``frozen`` part ways
from the first step and ``decode_slowdown`` compares different rollouts. A fixed k
(``--arms frozen,shadow --k 4``, 210 s on the H200) keeps them together for step 0 only: they part
after the first GRPO update (measured; the likely cause is the policy's GPU backward, which is not
bit-deterministic), so the arms' ratio stays noisy. The paired figure is the shadow arm's own
``decode_slowdown_measured``: loaded against unloaded decode steps of the same rollouts.

CPU smoke check (about a minute; writes under ``runs/benchmarks/``, git-ignored)::

    python benchmarks/cotrain.py --smoke
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import add_common_flags, warm_drafter
from e2e.options import sms_option
from lightning.pytorch.callbacks import Callback

from lightning_tlt.callbacks.drafter_cotrain import DrafterCoTrainCallback, DrafterCoTrainConfig
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig, StepEvent
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.data.drafter_data import task_prompts
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.trainer import DrafterTrainConfig
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("cotrain", "frozen", "shadow", "nospec", "cold")


class Recorder(Callback):
    """Per RL step: rollout figures from the batch, the tail's tokens/s from the engine's step
    events, the co-training callback's figures; prints a progress line; stops the arm at its deadline."""

    def __init__(self, arm: str, tail_rows: int, deadline: float) -> None:
        self.arm, self.tail_rows, self.deadline = arm, tail_rows, deadline
        self.steps: list[dict[str, Any]] = []
        self._tail_tokens = 0
        self._tail_s = 0.0
        self._start = time.perf_counter()

    def on_step_event(self, event: StepEvent) -> None:
        if event.phase in ("decode", "speculative") and 0 < event.active_rows <= self.tail_rows:
            self._tail_tokens += event.new_tokens
            self._tail_s += event.step_time_s

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        m = dict(batch.metrics)
        record: dict[str, Any] = {
            "step": len(self.steps),
            "wall_s": time.perf_counter() - self._start,
            "rollout_s": m.get("rollout/time_s", float("nan")),
            "tokens": float(batch.completion_mask.sum()),
            "tokens_per_s": m.get("rollout/tokens_per_s", float("nan")),
            "tail_tokens": self._tail_tokens,
            "tail_s": self._tail_s,
            "accept_len": m.get("spec/accept_len", float("nan")),
            "spec_fraction": m.get("spec/fraction", float("nan")),
            "reward": m.get("reward", float("nan")),
        }
        self._tail_tokens, self._tail_s = 0, 0.0
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, DrafterCoTrainCallback):
                record.update({k.removeprefix("drafter/"): v for k, v in cb.last_metrics.items()})
        self.steps.append(record)
        print(f"  [{self.arm}] step {record['step']:>3}  {record['wall_s']:7.1f} s  rollout {record['rollout_s']:.2f} s  "
              f"accept {record['accept_len']:.2f}  drafter steps {record.get('steps_this_rl_step', 0):.0f}", flush=True)  # fmt: skip
        if time.perf_counter() > self.deadline:
            print(f"  [{self.arm}] time share used up after {len(self.steps)} RL steps", flush=True)
            trainer.should_stop = True


def mixed(args: argparse.Namespace, device: str) -> bool:
    """Float32 master weights trained under ``bf16-mixed`` (rollouts from the engine's bf16 copy), as the e2e trains."""
    return device == "cuda" and args.master_weights == "float32"


def build_policy(args: argparse.Namespace, device: str) -> torch.nn.Module:
    dtype = torch.bfloat16 if device == "cuda" and not mixed(args, device) else torch.float32
    if args.policy_dir:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.policy_dir, dtype=dtype).to(device)
    if args.sft_steps > 0:
        from lightning_tlt.rl.warmstart import WarmStartConfig, warm_start

        model, _ = warm_start(WarmStartConfig(
            args.task, args.arch, args.size, difficulty=args.difficulty, steps=args.sft_steps, lr=args.sft_lr,
            cache_dir=args.cache_dir, device=device, progress=False,
        ))  # fmt: skip
    else:
        from lightning_tlt.models.zoo import build_model

        model = build_model(args.arch, args.size, seed=0)
    return model.to(device=device, dtype=dtype)


def arms_drafter(args: argparse.Namespace, device: str, out_dir: Path) -> dict[str, Any]:
    """Train the drafter offline on the policy's rollouts of other prompts; save it for every arm
    (``--drafter-dir``: one trained before, e.g. by ``benchmarks/e2e.py``'s warm start, instead)."""
    if args.drafter_dir:
        print(f"drafter warm start: reused from {args.drafter_dir}", flush=True)
        return {"dir": str(args.drafter_dir), "reused": True}
    start = time.perf_counter()
    policy = build_policy(args, device).eval()
    prompts = task_prompts(args.task, args.prompts * 2, difficulty=args.difficulty, seed=args.seed + 1)
    prepared_s = time.perf_counter() - start
    config = DrafterTrainConfig(batch_size=args.drafter_batch, max_len=args.drafter_max_len,
                                learning_rate=args.drafter_lr, warmup_steps=10)  # fmt: skip
    warm = warm_drafter(
        policy, prompts, out_dir, samples=args.generations // 2, max_new=args.max_new, steps=args.warm_steps,
        config=config, rollout_seed=args.seed + 1, seed=args.seed,
    )  # fmt: skip
    result = warm.result
    info = {
        "seconds": time.perf_counter() - start, "rollout_s": prepared_s + warm.rollout_s,
        "sequences": result.sequences, "steps": result.steps, "heldout_accept_rate_before": result.heldout_before,
        "heldout_accept_rate_after": result.heldout_after, "dir": str(out_dir),
    }  # fmt: skip
    print(f"drafter warm start: {info['steps']} steps on {info['sequences']} rollouts in {info['seconds']:.1f} s, "
          f"held-out acceptance rate {result.heldout_before:.3f} -> {result.heldout_after:.3f}", flush=True)  # fmt: skip
    return info


def cotrain_callback(args: argparse.Namespace, drafter: EagleDrafter | None, publish: bool) -> DrafterCoTrainCallback:
    config = DrafterCoTrainConfig(
        stall_threshold=args.stall_threshold, max_steps_per_event=args.steps_per_event,
        max_decode_slowdown=args.max_slowdown, learning_rate=args.drafter_lr, warmup_steps=0,
        batch_size=args.drafter_batch, max_len=args.drafter_max_len, buffer_tokens=args.buffer_tokens,
        publish_every_n_steps=1 if publish else 10**9, eval_every_n_steps=5, handoff_margin=None, seed=args.seed,
        side_stream_sms=args.side_stream_sms,
    )  # fmt: skip
    return DrafterCoTrainCallback(config, drafter=drafter)


def run_arm(arm: str, args: argparse.Namespace, device: str, drafter_dir: Path, deadline: float) -> dict[str, Any]:
    pl.seed_everything(args.seed, workers=False)
    policy = build_policy(args, device)
    config = GRPOConfig(
        num_generations=args.generations, max_completion_length=args.max_new, temperature=1.0,
        learning_rate=args.lr, lr_scheduler_type="constant", beta=0.0, micro_batch_tokens=args.micro_batch_tokens,
    )  # fmt: skip
    speculative = None
    if arm != "nospec":
        speculative = SpeculativeConfig(method="eagle", threshold=args.threshold, num_draft_tokens=args.k or None,
                                        drafter_path=None if arm == "cold" else str(drafter_dir))  # fmt: skip
    data = RolloutDataModule(
        args.task, prompts_per_step=args.prompts, difficulty=args.difficulty,
        task_size=args.prompts * (args.steps + 2), speculative=speculative, seed=args.seed,
        sampling=SamplingConfig(temperature=1.0, max_new_tokens=args.max_new),
        max_batch_size=args.prompts * args.generations,
    )  # fmt: skip
    recorder = Recorder(arm, args.stall_threshold, deadline)
    data.add_listener(recorder.on_step_event)
    callbacks: list[Callback] = []
    if arm in ("cotrain", "shadow", "cold"):
        drafter = None if arm == "cold" else EagleDrafter.from_pretrained(drafter_dir, policy)
        callbacks.append(cotrain_callback(args, drafter, publish=arm != "shadow"))
    callbacks.append(recorder)  # after the co-training callback: it reads that step's drafter metrics
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False,
        precision="bf16-mixed" if mixed(args, device) else None,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(GRPOModule(policy, config), datamodule=data)
    total = time.perf_counter() - start
    print(f"{arm}: {len(recorder.steps)} RL steps in {total:.1f} s", flush=True)
    return {"arm": arm, "total_s": total, "rl_steps": len(recorder.steps), "steps": recorder.steps}


def _mean(values: list[float]) -> float:
    finite = [float(v) for v in values if v == v]
    return statistics.fmean(finite) if finite else float("nan")


def _accept(run: dict[str, Any] | None, start: int, stop: int | None) -> float:
    return float("nan") if run is None else _mean([s["accept_len"] for s in run["steps"][start:stop]])


def _tail_tps(run: dict[str, Any] | None, skip: int, stop: int | None = None) -> float:
    if run is None:
        return float("nan")
    steps = run["steps"][skip:stop] or run["steps"][:stop]
    seconds = sum(s["tail_s"] for s in steps)
    return sum(s["tail_tokens"] for s in steps) / seconds if seconds > 0 else float("nan")


def summarize(runs: dict[str, dict[str, Any]], skip: int, window: int) -> dict[str, Any]:
    """The issue's summary keys, and per-arm means over the steps after ``skip`` (captures happen first)."""
    cotrain, frozen, cold, shadow = runs.get("cotrain"), runs.get("frozen"), runs.get("cold"), runs.get("shadow")
    common = min(len(shadow["steps"]), len(frozen["steps"])) if shadow and frozen else None
    drafter_steps = [s.get("steps_this_rl_step", 0.0) for s in (cotrain or {"steps": []})["steps"][1:]]
    summary: dict[str, Any] = {
        "drafter_steps_per_rl_step": _mean(drafter_steps),
        # over the RL steps both arms ran (an arm cut short by its time share ran fewer)
        "decode_slowdown": _tail_tps(shadow, skip, common) / _tail_tps(frozen, skip, common),
        "accept_len_first": _accept(cotrain, 0, 1),
        "accept_len_last": _accept(cotrain, -window, None),
        "frozen_accept_len_last": _accept(frozen, -window, None),
        "cold_accept_len_after_10": _accept(cold, 10, 10 + window),
    }
    summary["arms"] = {
        name: {
            "rl_steps": r["rl_steps"],
            "total_s": r["total_s"],
            "rollout_s": _mean([s["rollout_s"] for s in r["steps"][skip:]]),
            "tokens_per_s": _mean([s["tokens_per_s"] for s in r["steps"][skip:]]),
            "tail_tokens_per_s": _tail_tps(r, skip),
            "accept_len": _mean([s["accept_len"] for s in r["steps"][skip:]]),
            "decode_slowdown_measured": _mean([s.get("decode_slowdown", float("nan")) for s in r["steps"][skip:]]),
        }
        for name, r in runs.items()
    }
    return summary


def plot(runs: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    styles = {"cotrain": "-", "frozen": "--", "shadow": ":", "cold": "-."}
    for name, style in styles.items():
        if name in runs:
            ax.plot([s["accept_len"] for s in runs[name]["steps"]], style, label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("accepted tokens per verify step")
    ax.set_title("Drafter co-trained in the stalls vs frozen vs cold start")
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="countdown", help="zoo task (a long-tail one)")
    p.add_argument("--difficulty", type=int, default=2)
    p.add_argument("--arch", default="qwen2")
    p.add_argument("--size", default="100m", help="zoo size (100m, 400m, ...)")
    p.add_argument("--sft-steps", type=int, default=400, help="policy warm start (cached); 0: random init")
    p.add_argument("--sft-lr", type=float, default=5e-4,
                   help="policy warm-start peak lr (the tiny sizes' 3e-3 diverged to NaN at 100m on the H200)")
    p.add_argument("--policy-dir", default=None,
                   help="a saved warm-started policy (e.g. benchmarks/e2e.py's, under .cache/lightning_tlt/) instead of SFT")
    p.add_argument("--drafter-dir", default=None,
                   help="a saved warm-started EAGLE drafter for that policy (e.g. e2e's, under .cache/e2e/) instead of training one")
    p.add_argument("--master-weights", choices=("float32", "bfloat16"), default="float32",
                   help="on the GPU: float32 weights under bf16-mixed (as the e2e), or the weights in bf16")
    p.add_argument("--warm-steps", type=int, default=400, help="drafter warm-start steps")
    p.add_argument("--steps", type=int, default=30, help="RL steps per arm (at most)")
    p.add_argument("--time-budget-s", type=float, default=450.0, help="the whole run, warm start included")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the means (captures)")
    p.add_argument("--window", type=int, default=3, help="steps averaged for first/last/after-10 figures")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new", type=int, default=512)
    p.add_argument("--lr", type=float, default=1e-5, help="policy learning rate")
    p.add_argument("--micro-batch-tokens", type=int, default=16384,
                   help="most padded tokens per training forward (the update packed by tokens, as the e2e's)")
    p.add_argument("--k", type=int, default=4, help="drafted tokens per speculative step (0: the tuner picks)")
    p.add_argument("--threshold", type=int, default=32, help="speculation gate (active rows)")
    p.add_argument("--stall-threshold", type=int, default=32, help="active rows at or below which decode is a stall")
    p.add_argument("--steps-per-event", type=int, default=4, help="most drafter steps queued per stall event")
    p.add_argument("--max-slowdown", type=float, default=0.05, help="cap on the measured decode slowdown")
    p.add_argument("--side-stream-sms", default="auto", type=sms_option, metavar="{auto,all,N}",
                   help="SMs of the drafter's side stream: auto (the default since 2026-12-08, a quarter of the "
                        "device's), all (every SM: the runs before) or a count")
    p.add_argument("--drafter-lr", type=float, default=3e-4)
    p.add_argument("--drafter-batch", type=int, default=8)
    p.add_argument("--drafter-max-len", type=int, default=256)
    p.add_argument("--buffer-tokens", type=int, default=262144)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--plot", default=None, help="PNG path (default: docs/img/, or runs/ with --smoke)")
    add_common_flags(p, seed=0, cache_dir=True, out="JSON path (default: benchmarks/results/, or runs/ with --smoke)")
    args = p.parse_args(argv)
    for flag, path in (("--policy-dir", args.policy_dir), ("--drafter-dir", args.drafter_dir)):
        if path is not None and not (Path(path) / "config.json").is_file():
            p.error(f"{flag} {path!r} is not a saved model directory (no config.json in it)")
    if args.smoke:
        args.task, args.difficulty, args.size, args.sft_steps, args.warm_steps = "arithmetic", 1, "tiny", 0, 20
        args.steps, args.skip, args.window, args.prompts, args.generations, args.max_new = 12, 1, 2, 2, 4, 16
        args.threshold, args.stall_threshold, args.drafter_batch, args.drafter_max_len = 8, 8, 4, 32
        args.buffer_tokens, args.max_slowdown, args.time_budget_s = 4096, None, 240.0
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)  # tiny models on a small shared CPU: one thread is fastest
    names = [n for n in args.arms.split(",") if n]
    bad = [n for n in names if n not in ARMS]
    if bad:
        raise ValueError(f"unknown arms {bad}; allowed: {ARMS}")
    stamp = f"{dt.date.today():%Y%m%d}"
    scratch = ROOT / "runs" / "benchmarks" / f"cotrain_{'smoke' if args.smoke else device}"
    scratch.mkdir(parents=True, exist_ok=True)
    print(f"warm start ({args.size} {args.task}, device {device}) ...", flush=True)
    drafter_dir = Path(args.drafter_dir) if args.drafter_dir else scratch / "warm_drafter"
    drafter_info = arms_drafter(args, device, drafter_dir)
    # each arm is kept as it ends, keyed by the settings: a later call with the same settings runs the
    # arms not done yet (five arms of 30 long-tail steps at 0.5 B take more than one 10-minute call)
    settings = {k: v for k, v in vars(args).items() if k not in ("arms", "time_budget_s", "out", "plot")}
    key = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:10]
    runs: dict[str, dict[str, Any]] = {}
    todo = []
    for name in names:
        kept = scratch / f"arm_{name}_{key}.json"
        if kept.is_file() and not args.smoke:  # a smoke run checks the script: it runs every arm
            runs[name] = json.loads(kept.read_text())
            print(f"arm {name}: kept from an earlier call ({kept.name})", flush=True)
        else:
            todo.append(name)
    for i, name in enumerate(todo):
        left = args.time_budget_s - (time.perf_counter() - start)
        deadline = time.perf_counter() + left / (len(todo) - i)
        print(f"arm {name}: {left / (len(todo) - i):.0f} s of {left:.0f} s left", flush=True)
        runs[name] = run_arm(name, args, device, drafter_dir, deadline)
        if runs[name]["rl_steps"] >= args.steps and not args.smoke:  # one cut short by its deadline runs again
            (scratch / f"arm_{name}_{key}.json").write_text(json.dumps(runs[name], default=float))
    runs = {name: runs[name] for name in names if name in runs}
    summary = summarize(runs, args.skip, args.window)
    for key, value in summary.items():
        if key != "arms":
            print(f"{key:>28}: {value:.3f}")
    card = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"
    import transformers

    result = {
        "benchmark": "cotrain",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "card": card,
        "versions": {"torch": torch.__version__, "lightning": pl.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},  # fmt: skip
        "args": vars(args),
        "wall_s": time.perf_counter() - start,
        "drafter_warm_start": drafter_info,
        "summary": summary,
        "runs": runs,
    }
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / ("smoke" if args.smoke else "") / (
        f"cotrain_{'smoke' if args.smoke else device}_{stamp}.json"
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=float))
    png = Path(args.plot) if args.plot else (
        scratch / "cotrain_acceptance.png" if args.smoke else ROOT / "docs" / "img" / "cotrain_acceptance.png"
    )  # fmt: skip
    plot(runs, png)
    print(f"wrote {out} and {png} ({time.perf_counter() - start:.0f} s in all)")
    return result


if __name__ == "__main__":
    main()
