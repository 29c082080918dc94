"""`RolloutMetricsCallback`: rollout timing, the long tail, a one-line summary per step and one per run.

The RL modules already log TRL's metrics of each batch (``reward``, ``completions/*``, ``kl``,
...); this callback adds what only the engine's step events show: how the rollout's time splits
between the full batch and its long tail, and TRL's ``step_time``. It also prints a readable line
every ``print_every_n_steps`` (reward and each reward function's mean beside it, so correctness is
never hidden inside a total that format alone can raise; lengths, throughput, speculation), after
a one-time legend (`SUMMARY_LEGEND`); a line for each validation, timed apart from the steps; and at
the end of ``fit`` a summary of the run (`run_summary`): steps and time, each reward function's mean
over the first and the last pass over the prompts, the held-out result, speculation, and where the
metrics, the checkpoint and the drafter went. Lines go through the progress bar's own console
(`lightning_tlt.rl.progress_bar.print_line`), so that in a terminal neither erases the other.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_tlt.core.types import StepEvent
from lightning_tlt.rl.progress_bar import print_line


class RolloutMetricsCallback(Callback):
    """Log engine-level rollout metrics and print a summary line.

    Args:
        tail_fraction: a decode step is in the "tail" when at most this fraction of the rollout's
            peak rows are still active (the stall TLT trains its drafter in).
        print_every_n_steps: print a summary line after each rollout batch that reaches a multiple of this many
            optimizer steps (``trainer.global_step``, as ``max_steps`` counts: 1 prints after every batch);
            0 never prints.

    Logged (per RL step): ``step_time`` (TRL's name), ``rollout/tail_time_fraction``,
    ``rollout/tail_step_fraction``, ``rollout/peak_rows``.
    """

    def __init__(self, tail_fraction: float = 0.25, print_every_n_steps: int = 1) -> None:
        if not 0.0 < tail_fraction < 1.0:
            raise ValueError(f"tail_fraction must be in (0, 1), got {tail_fraction!r}")
        if print_every_n_steps < 0:
            raise ValueError(f"print_every_n_steps must be >= 0, got {print_every_n_steps!r}")
        self.tail_fraction = tail_fraction
        self.print_every_n_steps = print_every_n_steps
        self._events: list[StepEvent] = []
        self._last_end: float | None = None
        self._state: dict[str, Any] = {"printed": 0, "history": [], "validations": [], "fit_s": 0.0}
        self._batch_start_step = 0
        self._legend_shown = False
        self._datamodule: Any = None
        self._fit_start: float | None = None
        self._val_start: float | None = None
        self._paused_s = 0.0  # time outside the RL steps since the last step's end (`pause`)

    def _on_event(self, event: StepEvent) -> None:
        if event.phase != "done":
            self._events.append(event)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "add_listener"):
            dm.add_listener(self._on_event)
            self._datamodule = dm
        self._last_end = self._fit_start = time.perf_counter()

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._datamodule is not None:
            self._datamodule.remove_listener(self._on_event)
            self._datamodule = None
        if self._fit_start is not None:
            self._state["fit_s"] += time.perf_counter() - self._fit_start
            self._fit_start = None
        if self.print_every_n_steps and self._state["history"]:
            print_line(trainer, run_summary(self._state, _paths(trainer), trainer.num_training_batches))

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._val_start = time.perf_counter()
        if self.print_every_n_steps and trainer.state.fn == "fit":
            print_line(trainer, f"validation at step {trainer.global_step} ...")

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        now = time.perf_counter()
        seconds = now - (self._val_start or now)
        if self._last_end is not None:
            self._last_end += seconds  # the next step's time is its own, without the validation's
        metrics = {k[len("eval_"):]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("eval_")}
        if not metrics:
            return
        self._state["validations"].append({"step": trainer.global_step, "seconds": seconds, **_kept(metrics)})
        if self.print_every_n_steps:
            shown = " | ".join(summary_line(0, metrics, {}).split(" | ")[1:])  # less the "step" column
            print_line(trainer, f"validation at step {trainer.global_step} | {shown} | {seconds:.2f} s")

    def pause(self, seconds: float) -> None:
        """Leave ``seconds`` spent outside the RL steps (a held-out evaluation, `EvalCallback`) out of the next
        step's ``step_time``, whether they were spent before or after this callback's end of the current step."""
        self._paused_s += float(seconds)

    def tail_metrics(self) -> dict[str, float]:
        """Share of decode steps and of decode time spent with few rows active, since the last call."""
        decode = [e for e in self._events if e.phase in ("decode", "speculative")]
        self._events = []
        if not decode:
            return {}
        peak = max(e.active_rows for e in decode) or 1
        tail = [e for e in decode if e.active_rows <= self.tail_fraction * peak]
        total_time = sum(e.step_time_s for e in decode) or 1e-12
        return {
            "rollout/peak_rows": float(peak),
            "rollout/tail_step_fraction": len(tail) / len(decode),
            "rollout/tail_time_fraction": sum(e.step_time_s for e in tail) / total_time,
        }

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        metrics = self.tail_metrics()
        if self._last_end is not None:
            metrics["step_time"] = now - self._last_end - self._paused_s
        self._last_end, self._paused_s = now, 0.0
        size = len(batch) if hasattr(batch, "__len__") else 1
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=size)
        n, step = self.print_every_n_steps, trainer.global_step
        if n and step // n != self._batch_start_step // n:  # this batch reached (or passed) a multiple of n
            if not self._legend_shown:
                print_line(trainer, SUMMARY_LEGEND)
                self._legend_shown = True
            max_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None
            print_line(trainer, summary_line(step, getattr(batch, "metrics", {}), metrics, max_steps=max_steps))
            self._state["printed"] += 1
        self._state["history"].append({"step": step, **_kept(getattr(batch, "metrics", {}))})

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_start_step = trainer.global_step

    @override
    def state_dict(self) -> dict[str, Any]:
        return dict(self._state)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state.update(state_dict)


def _kept(metrics: dict[str, float]) -> dict[str, float]:
    """The figures of a step that the run's summary uses: the reward, each function's mean, speculation."""
    return {k: float(v) for k, v in metrics.items()
            if k in ("reward", "spec/fraction", "spec/accept_len") or (k.startswith("rewards/") and k.endswith("/mean"))}


def _paths(trainer: pl.Trainer) -> dict[str, str]:
    """Where the run's metrics, checkpoint and drafter are (those it has)."""
    import os

    paths: dict[str, str] = {}
    log_dir = trainer.logger.log_dir if trainer.logger is not None else None
    if log_dir and os.path.isfile(os.path.join(log_dir, "metrics.csv")):
        paths["metrics"] = os.path.join(log_dir, "metrics.csv")
    ckpt = trainer.checkpoint_callback
    path = getattr(ckpt, "last_model_path", "") or getattr(ckpt, "best_model_path", "") if ckpt is not None else ""
    if path:
        paths["checkpoint"] = path
        if any(type(c).__name__ == "DrafterCoTrainCallback" for c in trainer.callbacks):  # type: ignore[attr-defined]
            paths["drafter"] = (f"co-trained, in the checkpoint; for vLLM: lightning-tlt export-drafter "
                                f"--checkpoint_path {path} --out_dir DRAFTER/")
    return paths


def _duration(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{seconds:.1f} s"


def run_summary(state: dict[str, Any], paths: dict[str, str], steps_per_pass: int | float = 0) -> str:
    """The end-of-run summary: steps and time, each reward function's mean over the first and the last pass
    over the prompts (``steps_per_pass`` RL steps; half the run when it made fewer than two passes), the held-out
    result (first and last validation), speculation, and ``paths`` (metrics, checkpoint, drafter)."""
    history: list[dict[str, float]] = state["history"]
    n = len(history)
    per = int(steps_per_pass) if isinstance(steps_per_pass, int) or float(steps_per_pass).is_integer() else 0
    window = per if 0 < per <= n // 2 else max(1, n // 2)
    first, last = history[:window], history[-window:]
    validation_s = sum(v["seconds"] for v in state["validations"])
    lines = [f"done: {n} RL steps, optimizer step {int(history[-1]['step'])}, in {_duration(state['fit_s'])}"
             + (f" ({_duration(validation_s)} of it validating)" if validation_s else "")]
    names = [k for k in history[-1] if k.startswith("rewards/")] or ["reward"]
    span = (f"steps {int(first[0]['step'])}-{int(first[-1]['step'])} -> "
            f"{int(last[0]['step'])}-{int(last[-1]['step'])}")
    pass_word = "pass over the prompts" if window == per else "half of the run"
    trend = ", ".join(f"{_name(k)} {_mean(first, k):.3f} -> {_mean(last, k):.3f}" for k in names)
    lines.append(f"  train:     {trend} (first vs last {pass_word}: {span})")
    if state["validations"]:
        v0, v1 = state["validations"][0], state["validations"][-1]
        keys = [k for k in v1 if k.startswith("rewards/")] or ["reward"]
        held = ", ".join(f"{_name(k)} {v1.get(k, float('nan')):.3f}" for k in keys)
        before = f" (first, at step {v0['step']}: " + ", ".join(
            f"{_name(k)} {v0.get(k, float('nan')):.3f}" for k in keys) + ")" if len(state["validations"]) > 1 else ""
        lines.append(f"  held-out:  {held} at step {v1['step']}{before}")
    spec = [h for h in history if h.get("spec/fraction", 0.0) > 0 and "spec/accept_len" in h]
    half = max(1, len(spec) // 2)
    if spec:
        lines.append(f"  speculation: {100 * _mean(history, 'spec/fraction'):.0f}% of decode steps, accept "
                     f"{_mean(spec[:half], 'spec/accept_len'):.2f} -> {_mean(spec[-half:], 'spec/accept_len'):.2f} "
                     "tokens per speculative step (first vs last half of the speculating steps)")
    lines += [f"  {name + ':':<10} {path}" for name, path in paths.items()]
    return "\n".join(lines)


def _name(key: str) -> str:
    return short_reward_name(key[len("rewards/"):-len("/mean")]) if key.startswith("rewards/") else key


def _mean(rows: list[dict[str, float]], key: str) -> float:
    values = [r[key] for r in rows if key in r and r[key] == r[key]]  # NaN: no completion scored
    return sum(values) / len(values) if values else float("nan")


SUMMARY_LEGEND = """columns of the per-step lines below:
  step         optimizer step reached / max_steps (num_iterations of them per RL step; the CSV's step)
  reward       mean total reward ± std over the step's completions (the sum of the reward functions),
               then each function's mean: correctness = right final answer, format = well-formed answer
               line (logged as rewards/<func>/mean)
  len          mean completion length in tokens (clipped: share cut at max_completion_length)
  tok/s        rollout throughput
  spec/accept  share of decode steps that speculated / tokens per row per speculative step (1 = none accepted)
  s            wall time of the RL step"""
"""Printed once before the first summary line: what each column of `summary_line` means."""


def short_reward_name(name: str) -> str:
    """``countdown_search_correctness`` -> ``correctness`` (a task's prefix dropped); other names unchanged."""
    for kind in ("correctness", "format"):
        if name == kind or name.endswith("_" + kind):
            return kind
    return name


def summary_line(step: int, m: dict[str, float], extra: dict[str, float], max_steps: int | None = None) -> str:
    """``step 12/32 | reward 1.41 ± 0.30 (correctness 0.42, format 0.99) | len 37.5 (clipped 3%) | ...``.

    ``step`` is the optimizer step reached (``trainer.global_step``: the CSV's ``step``, what ``max_steps``
    counts and checkpoint names show). Each reward function's mean (``rewards/<func>/mean``) follows the
    total, so a total that rises through the format reward alone cannot pass for learning. ``spec 40%
    accept 2.30``: 40 % of the rollout's decode steps speculated, and each speculative step gave 2.30
    tokens per row on average (1 = no draft accepted).
    """
    parts = [f"step {step}/{max_steps}" if max_steps else f"step {step}"]
    if "reward" in m:
        reward = f"reward {m['reward']:.3f} ± {m.get('reward_std', 0.0):.3f}"
        funcs = [
            f"{short_reward_name(key[len('rewards/') : -len('/mean')])} {value:.3f}"
            for key, value in m.items()
            if key.startswith("rewards/") and key.endswith("/mean")
        ]
        parts.append(reward + (f" ({', '.join(funcs)})" if funcs else ""))
    if "completions/mean_length" in m:
        parts.append(
            f"len {m['completions/mean_length']:.1f} (clipped {100 * m.get('completions/clipped_ratio', 0.0):.0f}%)"
        )
    if "rollout/tokens_per_s" in m:
        parts.append(f"{m['rollout/tokens_per_s']:,.0f} tok/s")
    if "spec/fraction" in m:
        spec = f"spec {100 * m['spec/fraction']:.0f}%"
        if "spec/accept_len" in m:
            spec += f" accept {m['spec/accept_len']:.2f}"
        parts.append(spec)
    if "step_time" in extra:
        parts.append(f"{extra['step_time']:.2f} s")
    return " | ".join(parts)
