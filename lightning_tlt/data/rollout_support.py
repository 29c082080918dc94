"""What `RolloutDataModule` (`lightning_tlt.data.datamodule`) does around one rollout, as functions.

Input checks (finite sampling logits, task names, the dataset's size against the step's prompts),
the tokenizer, the `RolloutBatch` built from a `RolloutOutput` and its rewards, and the batch's
metrics (TRL's names, and the engine's under ``rollout/``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_tlt.core.types import RolloutOutput
from lightning_tlt.data.rewards import OnRewardError, RewardFunc, RewardScores, compute_rewards
from lightning_tlt.data.sources import describe_source
from lightning_tlt.rl.advantages import nanstd
from lightning_tlt.rl.batch import RolloutBatch, RolloutSettings, RolloutSettingsSource, pad_left, pad_right


def check_sampled_from_finite_logits(out: RolloutOutput, step: int) -> None:
    """Refuse completions sampled from logits that are not finite (a policy whose weights diverged):
    their tokens are garbage, every row runs to the length cap, and training on them spreads the NaN.

    A token's sampling log-probability is NaN (or ``+inf``) exactly when the logits it was drawn from
    were not finite; the sum of a row's log-probabilities shows it (cheap: one pass on the host).

    Raises:
        FloatingPointError: naming the step and how many completions are affected.
    """
    bad = [i for i, lp in enumerate(out.logprobs) if lp and not sum(lp) < math.inf]
    if bad:
        raise FloatingPointError(
            f"RL step {step}: {len(bad)} of {len(out.logprobs)} completions (first: #{bad[0]}) were sampled from "
            f"logits that are not finite: the policy's weights are not finite (diverged, or overwritten); "
            f"stopping before training on them"
        )


def check_task_names(dataset: Any, eval_dataset: Any = None, difficulty: int = 1) -> None:
    """Refuse an unknown zoo task name, a difficulty it does not have, or a file or directory that is not
    there (cheap: run before any other work; files are read later, in `RolloutDataModule.prepare`).

    Raises:
        ValueError: naming the task and the registered ones, the allowed difficulties, or the missing path
            (`DataSourceError`).
    """
    for arg in (dataset, eval_dataset):
        if isinstance(arg, str) and describe_source(arg) == "task":
            from lightning_tlt.tasks import get_task

            get_task(arg).check_difficulty(difficulty)


def check_dataset_size(num_prompts: int, prompts_per_step: int, world_size: int = 1) -> None:
    """Refuse a dataset too small for one RL step: each of ``world_size`` ranks takes ``prompts_per_step`` prompts.

    Raises:
        ValueError: naming the dataset size, ``prompts_per_step`` and the world size.
    """
    needed = prompts_per_step * world_size
    if num_prompts < needed:
        ranks = f" x world size {world_size} = {needed}" if world_size > 1 else ""
        raise ValueError(
            f"the dataset has {num_prompts} prompts, fewer than prompts_per_step={prompts_per_step}{ranks} "
            "that one RL step takes (every rank takes its own prompts); give more prompts (task_size for a "
            "zoo task) or lower prompts_per_step"
        )


def module_settings(module: Any) -> RolloutSettings | None:
    """The module's rollout options, through the declared `RolloutSettingsSource` interface."""
    return module.rollout_settings() if isinstance(module, RolloutSettingsSource) else None


def load_tokenizer(arg: Any, policy: torch.nn.Module | None = None) -> Any:
    """``arg`` (a tokenizer, or a directory to load one from); ``None``: the tokenizer saved beside a policy loaded
    from an HF directory (``policy.path``), else the kit's own."""
    if arg is None:
        from lightning_tlt.models.tokenizer import build_tokenizer

        source = str(getattr(getattr(policy, "config", None), "_name_or_path", "") or "")
        if source and (Path(source) / "tokenizer_config.json").is_file():
            arg = source
    if arg is None:

        return build_tokenizer()
    if isinstance(arg, str):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(arg)
    return arg


def to_batch(
    out: RolloutOutput, pad_id: int, rewards: torch.Tensor, per_func: torch.Tensor, advantages: torch.Tensor,
    g: int, step: int,
) -> RolloutBatch:
    prompt_ids, prompt_mask = pad_left(out.prompt_ids, pad_id)
    completion_ids, completion_mask = pad_right(out.completion_ids, pad_id, torch.long)
    logprobs, _ = pad_right(out.logprobs, 0.0, torch.float32)
    return RolloutBatch(
        prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
        completion_mask=completion_mask, sampling_logprobs=logprobs, rewards=rewards, rewards_per_func=per_func,
        advantages=advantages, is_truncated=torch.tensor([r == "length" for r in out.finish_reasons]),
        num_generations=g, step=step,
    )


def batch_metrics(
    batch: RolloutBatch, out: RolloutOutput, adv_stats: dict[str, torch.Tensor], errors: dict[str, int],
    nonfinite: dict[str, int], reward_time: float, num_tokens: int,
) -> dict[str, float]:
    """TRL's rollout metrics (names of ``GRPOTrainer``) plus the kit's engine and speculation figures."""
    lengths = batch.completion_mask.sum(1).float()  # (B,)
    truncated = batch.is_truncated
    terminated = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
    m: dict[str, float] = {
        "num_tokens": float(num_tokens),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": truncated.float().mean().item(),
        "completions/mean_terminated_length": terminated.mean().item(),
        "reward": torch.nanmean(batch.rewards).item(),
        "reward_std": nanstd(batch.rewards).item(),
        "frac_reward_zero_std": adv_stats["frac_reward_zero_std"].item(),
        "rollout/reward_time_s": reward_time,
    }
    for j, name in enumerate(batch.reward_func_names):
        col = batch.rewards_per_func[:, j]
        m[f"rewards/{name}/mean"] = torch.nanmean(col).item()
        m[f"rewards/{name}/std"] = nanstd(col).item()
        if name in errors:
            m[f"rewards/{name}/errors"] = float(errors[name])
        if name in nonfinite:
            m[f"rewards/{name}/nonfinite"] = float(nonfinite[name])
    m.update(engine_metrics(out.stats))
    return m


def engine_metrics(stats: dict[str, float]) -> dict[str, float]:
    """The kit's rollout metrics from `RolloutOutput.stats`: ``rollout/*`` and ``spec/*``.

    ``spec/fraction`` is the share of decode steps that speculated and ``spec/accept_len`` the
    mean tokens accepted per speculative row-step (the engine's ``spec/acceptance_length``); the
    engine's other ``spec/*`` figures pass through (per-position acceptance rates excepted).
    ``rollout/zero_prob_tokens``: sampled tokens of probability 0 (always 0 unless the sampler is broken; the
    native engine's). ``rollout/compile_s``, ``rollout/capture_s`` and ``rollout/graph_captures``: only in a call that
    compiled a step function or captured a CUDA graph (each is done once, on first use).
    ``rollout/gather_time_s``, ``rollout/gather_mib``, ``rollout/gather_buffer_mib`` and (CUDA)
    ``rollout/gather_peak_mib``: only when a sharded policy was gathered into the engine's copy.
    """
    m: dict[str, float] = {}
    for key, name in (("tokens_per_s", "rollout/tokens_per_s"), ("wall_time_s", "rollout/time_s"),
                      ("steps", "rollout/steps"), ("tokens_per_s/decode", "rollout/tokens_per_s_decode"),
                      ("tokens_per_s/speculative", "rollout/tokens_per_s_speculative"),
                      ("zero_prob_tokens", "rollout/zero_prob_tokens")):
        if key in stats:
            m[name] = float(stats[key])
    if stats.get("compile/captures", 0.0) > 0 or stats.get("compile/compile_s", 0.0) > 0:
        for key, name in (("compile/compile_s", "rollout/compile_s"), ("compile/capture_s", "rollout/capture_s"),
                          ("compile/captures", "rollout/graph_captures")):
            m[name] = float(stats.get(key, 0.0))
    if "gather/time_s" in stats:  # a sharded policy gathered into the engine's copy (rollout/inference_copy.py)
        m["rollout/gather_time_s"] = float(stats["gather/time_s"])
        m["rollout/gather_mib"] = float(stats["gather/bytes"]) / 2**20
        m["rollout/gather_buffer_mib"] = float(stats["gather/buffer_bytes"]) / 2**20
        if "gather/peak_bytes" in stats:
            m["rollout/gather_peak_mib"] = float(stats["gather/peak_bytes"]) / 2**20
    decode, spec = stats.get("steps_decode", 0.0), stats.get("steps_speculative", 0.0)
    share = stats.get("spec/speculative_step_share", spec / (decode + spec) if decode + spec > 0 else 0.0)
    m["spec/fraction"] = float(share)
    if "spec/acceptance_length" in stats:
        m["spec/accept_len"] = float(stats["spec/acceptance_length"])
    for key, value in stats.items():
        if key.startswith("spec/") and "_pos" not in key and key not in ("spec/acceptance_length",
                                                                          "spec/speculative_step_share"):
            m[key] = float(value)
    return m


def prompt_key(prompt: Any) -> str:
    """A prompt (a string, or a list of messages) as a string that is equal exactly when the prompts are."""
    import json

    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def pick_heldout(draw: Callable[[int], list[dict[str, Any]]], size: int, train_prompts: list[Any]) -> list[dict[str, Any]]:
    """The first ``size`` rows of ``draw(n)`` with distinct prompts, none of them a training prompt.

    ``draw(n)`` returns ``n`` rows or more (a source that ignores ``n``: all it has); a source with repeats
    (a small task split) is drawn again at twice the size until ``size`` distinct prompts come, at most 64x.

    Raises:
        ValueError: ``size`` < 1, fewer than ``size`` distinct prompts, or a held-out prompt that is a
            training prompt too (naming how many and the first).
    """
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size!r}")
    rows: list[dict[str, Any]] = []
    n = size
    while len(rows) < size and n <= 64 * size:
        seen: dict[str, dict[str, Any]] = {}
        for row in draw(n):
            seen.setdefault(prompt_key(row["prompt"]), row)
        grew, rows = len(seen) > len(rows), list(seen.values())[:size]
        if not grew:
            break
        n *= 2
    if len(rows) < size:
        raise ValueError(f"asked for {size} held-out prompts, the held-out source has {len(rows)} distinct ones")
    train = {prompt_key(p) for p in train_prompts}
    shared = [row["prompt"] for row in rows if prompt_key(row["prompt"]) in train]
    if shared:
        raise ValueError(f"{len(shared)} of the {size} held-out prompts are training prompts too "
                         f"(first: {shared[0]!r}); held-out prompts must never be trained on")
    return rows


def score_completions(
    reward_funcs: list[RewardFunc],
    tokenizer: Any,
    records: list[dict[str, Any]],
    out: RolloutOutput,
    num_samples: int,
    on_error: OnRewardError,
    extra_kwargs: dict[str, Any],
) -> tuple[list[Any], list[Any], RewardScores, float]:
    """Decode and score ``out``, ``num_samples`` completions of each of ``records`` in order, TRL's way.

    Each record's prompt and other columns are repeated per completion and reach the reward functions as
    keyword arguments (with ``extra_kwargs``; TRL's ``log_metric`` and ``log_extra`` hooks default to no-ops);
    a conversational prompt's completion is an assistant message. Returns the prompts, the completions, the
    `RewardScores` and the seconds the reward functions took.
    """
    prompts = [rec["prompt"] for rec in records for _ in range(num_samples)]
    texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
    conversational = not isinstance(prompts[0], str)
    completions: list[Any] = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
    columns = {k: [rec[k] for rec in records for _ in range(num_samples)] for k in records[0] if k != "prompt"}
    hooks = {"log_metric": lambda name, value: None, "log_extra": lambda column, values: None}
    t0 = time.perf_counter()
    scores = compute_rewards(reward_funcs, prompts=prompts, completions=completions, completion_ids=out.completion_ids,
                             columns=columns, on_error=on_error, extra_kwargs={**hooks, **extra_kwargs})
    return prompts, completions, scores, time.perf_counter() - t0
