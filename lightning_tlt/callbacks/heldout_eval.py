"""`EvalCallback`: the policy on a fixed held-out set at step 0 (the control) and every N steps, with 95 % intervals.

Whether RL learned is read on prompts it never trained on, against the policy it started from: at
step 0 (the warm-start policy, before any update: the control) and every ``every_n_steps`` optimizer
steps (and at the last), the callback generates completions of ``num_prompts`` held-out prompts with
the training engine, greedily (one a prompt) and at ``temperature`` (``num_samples`` a prompt),
scores them with the task's correctness reward and logs, through the Trainer's loggers at that
step: ``eval/correctness_greedy`` and ``eval/correctness_t1`` (the temperature in the name) with
their 95 % interval bounds (``..._low``, ``..._high``: Wilson's for greedy; for the ``k`` correlated
samples of a prompt, a cluster-robust standard error with the prompts as clusters; see
`lightning_tlt.data.heldout`), ``eval/len_mean``, ``eval/len_p50``, ``eval/len_p90``,
``eval/len_p99`` and ``eval/clipped_ratio`` of the sampled completions, and ``eval/seconds``. It
prints a line per evaluation, and keeps the ``history`` in its `state_dict`, with the next step due
and the held-out set's digest, so a resumed run continues both (and refuses another held-out set).

Why a callback and not Lightning's validation loop (``validation_step``, which the RL modules also
have: a pass over ``eval_dataset`` at the training temperature): the validation loop cannot run
before the first training step and log it (its sanity check logs nothing), which is the control
this evaluation exists for; it samples one way, with the training's ``num_generations``, where this
needs greedy and ``k`` samples; and its place and count are the epoch's, where this runs every N
optimizer steps and at the last, wherever the epochs fall. Held-out prompts (`HeldOutSet`) are a zoo
task's test split, disjoint from its train split by construction (a statement's CRC32 picks its
split), and checked against the training prompts.

Training is not disturbed: generation goes through `RolloutDataModule.generate_aside` (no step
listener hears it, so no drafter trains on it and no rollout metric counts it; the engine's gate,
tuner and draft vocabulary are put back), with its own generator (seeded by ``seed`` alone: every
evaluation draws the same noise, so two evaluations differ by the policy only); training's sampling
generator and data position are the datamodule's and untouched. A run with this callback ends with
the same policy weights as one without (``tests/callbacks/test_heldout_eval.py``). Its time is left
out of the next step's ``step_time`` (`RolloutMetricsCallback.pause`).

Under DDP each rank evaluates every ``world_size``-th prompt and the results are gathered, so every
rank holds the same figures (``eval/seconds`` is each rank's own); rank zero logs and prints.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from lightning_tlt.callbacks.rollout_metrics import RolloutMetricsCallback
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.data.heldout import (
    HeldOutScores,
    HeldOutSet,
    evaluate_prompts,
    heldout_metrics,
    reward_index,
)
from lightning_tlt.rl.progress_bar import print_line

STATE_FORMAT = 1
"""The checkpointed state's format (`EvalCallback.state_dict`)."""


@dataclass
class EvalConfig:
    """Settings of `EvalCallback`."""

    num_prompts: int = 256
    """Held-out prompts (distinct, never trained on) evaluated each time."""
    every_n_steps: int = 25
    """Evaluate after the optimizer step (``trainer.global_step``, as ``max_steps`` counts) that reaches a
    multiple of this, besides step 0 and the last step."""
    num_samples: int = 4
    """Completions per prompt at ``temperature`` (k)."""
    temperature: float = 1.0
    """The sampled evaluation's temperature (top-p, top-k and the length cap are training's)."""
    greedy: bool = True
    """Also one greedy completion per prompt."""
    reward: str | None = None
    """The reward function whose score is correctness: its name, or the part after the task's prefix
    ("correctness"); ``None``: the first (a zoo task's correctness)."""
    threshold: float = 1.0
    """A completion is correct when that reward is at least this (1.0: a zoo task's right answer)."""
    max_new_tokens: int | None = None
    """Length cap of the evaluation's completions; ``None``: training's ``max_completion_length``."""
    seed: int = 0
    """Seeds the sampled evaluation's noise (the same at every evaluation)."""
    at_start: bool = True
    """Evaluate at step 0, before any update (the warm-start policy: the control)."""

    def __post_init__(self) -> None:
        for name in ("num_prompts", "every_n_steps", "num_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not 0.0 < self.temperature < math.inf:
            raise ValueError(f"temperature must be > 0 and finite (greedy is the greedy option), got {self.temperature!r}")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1 or None, got {self.max_new_tokens!r}")


class EvalCallback(Callback):
    """Held-out correctness and lengths at step 0 and every N steps (see the module docstring).

    Args:
        config: the settings (`EvalConfig`); ``None`` takes the defaults.
        **overrides: `EvalConfig` fields replacing those of ``config`` (``EvalCallback(num_prompts=64)``).

    Example::

        Trainer(max_steps=200, callbacks=[EvalCallback(num_prompts=256, every_n_steps=25)]).fit(
            GRPOModule(policy), datamodule=RolloutDataModule("countdown_search", difficulty=3))
    """

    def __init__(self, config: EvalConfig | None = None, **overrides: Any) -> None:
        super().__init__()
        config = config or EvalConfig()
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(EvalConfig)})
        if unknown:
            raise ValueError(f"unknown EvalConfig fields {unknown}; allowed: {[f.name for f in dataclasses.fields(EvalConfig)]}")
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self.history: list[dict[str, float]] = []
        """One entry per evaluation: ``step``, the logged ``eval/*`` figures and ``seconds``."""
        self._next_step = 0
        """The optimizer step at or after which the next scheduled evaluation runs."""
        self._held: HeldOutSet | None = None
        self._digest: str | None = None  # the held-out set's, from a checkpoint until the set is built
        self._reward = 0

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self._held is not None:
            return
        dm = self._datamodule(trainer)
        self._held = HeldOutSet.from_datamodule(dm, self.config.num_prompts)  # before the engine: its context fits
        self._reward = reward_index(dm, self.config.reward)
        self._check_digest()

    def _check_digest(self) -> None:
        if self._held is None or self._digest is None:
            return
        if self._digest != self._held.digest:
            raise ValueError(
                f"EvalCallback: the checkpoint's history was measured on another held-out set (digest {self._digest}, "
                f"this run's {self._held.digest}): resume with the same dataset, difficulty, data seed and num_prompts"
            )

    @staticmethod
    def _datamodule(trainer: pl.Trainer) -> RolloutDataModule:
        dm = getattr(trainer, "datamodule", None)
        if not isinstance(dm, RolloutDataModule):
            raise ValueError(f"EvalCallback needs a RolloutDataModule (its engine and held-out prompts), "
                             f"got {type(dm).__name__}")  # fmt: skip
        return dm

    # ------------------------------------------------------------------ when
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step = trainer.global_step
        done = bool(self.history) and int(self.history[-1]["step"]) == step
        if done:
            return
        if step == 0 and not self.config.at_start:
            self._next_step = max(self._next_step, self.config.every_n_steps)
        elif step >= self._next_step:
            # step 0: the control; later: resumed from a checkpoint written before this step's evaluation
            self.evaluate(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        last = trainer.max_steps is not None and 0 < trainer.max_steps <= step
        if step >= self._next_step or last:
            self.evaluate(trainer)

    # ------------------------------------------------------------------ what
    def evaluate(self, trainer: pl.Trainer) -> dict[str, float]:
        """Evaluate the policy now (every rank together); log, print and record the figures, and return them."""
        cfg = self.config
        dm = self._datamodule(trainer)
        if self._held is None:
            self.setup(trainer, trainer.lightning_module, "fit")
        held = cast(HeldOutSet, self._held)
        assert dm.sampling is not None
        sampling = dataclasses.replace(dm.sampling, temperature=cfg.temperature,
                                       max_new_tokens=cfg.max_new_tokens or dm.sampling.max_new_tokens)  # fmt: skip
        start = time.perf_counter()
        rank, world = trainer.global_rank, trainer.world_size
        scores = evaluate_prompts(
            dm, held, list(range(rank, len(held), world)), sampling=sampling, num_samples=cfg.num_samples,
            greedy=cfg.greedy, reward=self._reward, threshold=cfg.threshold, seed=cfg.seed,
        )  # fmt: skip
        scores = self._gather(trainer, scores, len(held))
        step = trainer.global_step
        metrics = heldout_metrics(scores, cfg.temperature)
        metrics["eval/seconds"] = time.perf_counter() - start
        self.history.append({"step": float(step), **metrics})
        self._next_step = (step // cfg.every_n_steps + 1) * cfg.every_n_steps
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        print_line(trainer, eval_line(step, metrics, cfg.temperature))
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, RolloutMetricsCallback):
                callback.pause(metrics["eval/seconds"])
        return metrics

    def _gather(self, trainer: pl.Trainer, scores: HeldOutScores, size: int) -> HeldOutScores:
        """Every rank's shard (rank r holds prompts r, r + world, ...) put back in the held-out set's order."""
        world = trainer.world_size
        if world == 1:
            return scores
        k, per = self.config.num_samples, -(-size // world)
        greedy = scores.greedy.unsqueeze(1) if scores.greedy.numel() else torch.zeros(len(scores.sampled), 0)
        local = torch.cat([greedy, scores.sampled, scores.lengths, scores.clipped], dim=1)  # (rows, g + 3k)
        padded = torch.full((per, local.shape[1]), math.nan, device=trainer.strategy.root_device)
        padded[: len(local)] = local.to(padded.device)
        gathered = cast(torch.Tensor, trainer.strategy.all_gather(padded)).cpu()  # (world, per, g + 3k)
        rows = gathered.transpose(0, 1).reshape(per * world, -1)[:size]  # prompt i = rank i % world, row i // world
        g = greedy.shape[1]
        return HeldOutScores(rows[:, 0] if g else torch.zeros(0), rows[:, g : g + k], rows[:, g + k : g + 2 * k],
                             rows[:, g + 2 * k :])  # fmt: skip

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        digest = self._held.digest if self._held is not None else self._digest
        return {"format": STATE_FORMAT, "history": [dict(h) for h in self.history], "next_step": self._next_step,
                "digest": digest}  # fmt: skip

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(f"EvalCallback: the checkpoint's state is of format {state_dict.get('format')!r}, "
                             f"this version reads format {STATE_FORMAT}")  # fmt: skip
        self.history = [dict(h) for h in state_dict["history"]]
        self._next_step = int(state_dict["next_step"])
        self._digest = state_dict.get("digest")
        self._check_digest()


def eval_line(step: int, m: dict[str, float], temperature: float) -> str:
    """``held-out at step 25 | greedy 0.412 [0.353, 0.474] | t1 x4 0.389 [0.351, 0.428] | len 312 ...``."""
    tag = f"t{temperature:g}"
    parts = [f"held-out at step {step} ({int(m['eval/num_prompts'])} prompts)"]
    if "eval/correctness_greedy" in m:
        parts.append(f"greedy {m['eval/correctness_greedy']:.3f} [{m['eval/correctness_greedy_low']:.3f}, "
                     f"{m['eval/correctness_greedy_high']:.3f}]")  # fmt: skip
    parts.append(f"T={temperature:g} x{int(m['eval/num_samples'])} {m[f'eval/correctness_{tag}']:.3f} "
                 f"[{m[f'eval/correctness_{tag}_low']:.3f}, {m[f'eval/correctness_{tag}_high']:.3f}]")
    parts.append(f"len {m['eval/len_mean']:.1f} (p50 {m['eval/len_p50']:.0f}, p90 {m['eval/len_p90']:.0f}, "
                 f"p99 {m['eval/len_p99']:.0f}, clipped {100 * m['eval/clipped_ratio']:.0f}%)")
    parts.append(f"{m['eval/seconds']:.2f} s")
    return " | ".join(parts)
