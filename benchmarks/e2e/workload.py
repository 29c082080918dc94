"""The workload and its warm starts: cache keys, the SFT policy, the offline drafter, and ``--carry``."""

from __future__ import annotations

import gc
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from lightning_tlt.models.tokenizer import encode_prompt
from lightning_tlt.rl.warmstart import WarmStartConfig, warm_start, warm_start_dir, warm_start_metadata
from lightning_tlt.tasks import get_task

from .options import E2EOptions

try:  # ``python -m benchmarks.e2e`` (package) or ``python benchmarks/e2e.py`` (``benchmarks/`` on the path)
    from .._common import warm_drafter
except ImportError:
    from _common import warm_drafter  # type: ignore[no-redef]

_T0 = time.perf_counter()

DRAFTER_KEYS = ("drafter_prompts", "drafter_samples", "drafter_steps", "drafter_lr", "max_new")
RUN_KEYS = ("steps", "prompts", "generations", "max_new", "lr", "micro_batch", "micro_batch_tokens", "threshold",
            "engine", "master_weights")
TLT_KEYS = ("cotrain_lr", "stall_steps", "side_stream_sms", "verification", "deterministic")
"""Settings only a (``tlt``) reads: they key a's file alone, so changing them reuses b's runs."""
TRL_KEYS = ("trl_steps", "prompts", "generations", "max_new", "lr", "micro_batch", "master_weights")
"""c's settings (its time budget is not one: a unit that ran fewer than ``--trl-steps`` steps is measured
again when a call's budget allows, and replaced only by one with more steps)."""
TRL_GENERATION = "bfloat16"
"""c's weights, and so its HF ``generate``, in bf16 like a and b's rollouts (runs of float32
generation, before the report's format 2, are keyed apart and never reused)."""
FORMAT = 4
"""The report's format: 2, units with provenance and the report recomputed from them (`report.recompute`);
3, each run traced afresh (``start``) and the summary's compile seconds (`report.FORMAT_3_KEYS`); 4, the
accuracy verdict allows for correlated steps (`report.no_accuracy_loss`)."""
UNIT_START = "as_new_process"
"""How a unit of `UNIT_FORMAT` starts (its ``start``): only such units are carried into this format's cache."""
PREDATED_DEFAULTS = {"side_stream_sms": None}
"""What a report that predates a setting's current default measured with (`carry`): every SM before the
default became ``"auto"`` (2026-12-08)."""
UNIT_FORMAT = 4
"""The run units' format, part of their cache key: 3 since each run is traced afresh (the report's format
4 changed only what is computed from the units, so their cache stands); 4 since each run also loads its
compiled versions from the store, as a new process would (``start``: ``as_new_process``)."""
WORKLOAD_KEYS = ("arch", "smoke", "sft_steps", "sft_batch", "sft_lr", "sft_max_length", "sft_batch_tokens",
                 "sft_max_time_s")


def log(message: str) -> None:
    """A progress line with the seconds since the script started."""
    print(f"[e2e {time.perf_counter() - _T0:7.1f} s] {message}", flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def percentiles(values: list[float]) -> dict[str, float]:
    """p50, p90, p99 and max of ``values`` (nearest-rank)."""
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0}
    s = sorted(values)

    def rank(q: float) -> float:
        return float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])

    return {"p50": rank(0.5), "p90": rank(0.9), "p99": rank(0.99), "max": float(s[-1])}


class Budget:
    """The wall time one call may use; a unit of work starts only when its estimate fits."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - _T0)

    def allows(self, estimate_s: float, what: str) -> bool:
        ok = estimate_s <= self.left()
        log(
            f"{what}: estimated {estimate_s:.0f} s, {self.left():.0f} s left of {self.seconds:.0f} s: "
            f"{'run' if ok else 'skipped (next call)'}"
        )
        return ok


# ---------------------------------------------------------------------------------------------- settings, keys


def grpo_settings(args: E2EOptions) -> dict[str, Any]:
    """The GRPO options every configuration shares, by TRL's names (one source for a, b and c)."""
    return {
        "num_generations": args.generations,
        "max_completion_length": args.max_new,
        "temperature": 1.0,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "loss_type": "dapo",
        "beta": 0.0,
        "num_iterations": 1,
    }


def warm_start_config(args: E2EOptions | Any, device: str = "cpu") -> WarmStartConfig:
    """The policy's warm start of the workload options (`E2EOptions`, or the flags of
    ``_common.add_workload_flags``, which have the same names); ``device`` does not change the cache key."""
    return WarmStartConfig(
        task=args.task,
        arch=args.arch,
        size=args.size,
        difficulty=args.difficulty,
        seed=0,
        steps=args.sft_steps,
        batch_size=args.sft_batch,
        lr=args.sft_lr,
        max_length=args.sft_max_length,
        batch_tokens=args.sft_batch_tokens,
        max_time_s=args.sft_max_time_s,
        cache_dir=args.cache_dir,
        device=device,
        progress=False,
    )


def _key(prefix: str, settings: dict[str, Any]) -> str:
    return f"{prefix}-{hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]}"


def _settings(args: E2EOptions | dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    get = args.get if isinstance(args, dict) else lambda k: getattr(args, k)
    return {k: get(k) for k in keys}


def workload_key(args: E2EOptions) -> str:
    """The workload's name (task, size, the warm start's settings); each stage caches below it."""
    return _key(f"{args.task}-d{args.difficulty}-{args.size}", _settings(args, WORKLOAD_KEYS))


def run_file(args: E2EOptions, name: str, seed: int) -> str:
    """A run's file name in the ``runs`` stage: b's by its seed, a's also by a's own settings."""
    return f"{_key('tlt', _settings(args, TLT_KEYS))}_seed{seed}.json" if name == "tlt" else f"{name}_seed{seed}.json"


def stage_dir(args: E2EOptions, policy_dir: Path, stage: str, drafter_args: E2EOptions | None = None) -> Path:
    """Where a stage's results are cached: keyed by the policy it starts from and by its own settings
    only (a changed TRL budget does not recompute the drafter or the a/b runs, a new policy does).
    ``drafter_args``: the options the drafter was warm-started with, where not ``args`` (the ``cap``
    section's a starts from the main section's drafter)."""
    drafter = _key(f"drafter-{policy_dir.name}", _settings(drafter_args or args, DRAFTER_KEYS))
    trl = {**_settings(args, TRL_KEYS), "generation": TRL_GENERATION}
    runs = {**_settings(args, RUN_KEYS), "format": UNIT_FORMAT}  # units of format 2 (with provenance) only
    key = {"drafter": drafter, "runs": _key(f"runs-{drafter}", runs),
           "trl": _key(f"trl-{policy_dir.name}", trl)}[stage]  # fmt: skip
    path = Path(args.cache_dir).parent / "e2e" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def load_policy(policy_dir: Path, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=dtype).to(device)


# ---------------------------------------------------------------------------------------------- warm starts


def warm_policy(args: E2EOptions, device: str) -> tuple[Path, dict[str, Any]]:
    """The SFT-warm-started policy (cached by `warm_start`); says whether it was recomputed."""
    config = warm_start_config(args, device)
    directory = warm_start_dir(config)
    cached = (directory / "warmstart.json").is_file()
    log(f"policy warm start: {'cached' if cached else 'training'} ({directory.name})")
    t0 = time.perf_counter()
    model, _ = warm_start(config)
    del model
    free()
    meta = warm_start_metadata(directory)
    info = {
        "recomputed": not cached,
        "seconds_this_call": time.perf_counter() - t0,
        "dir": directory.name,
        "train_seconds": meta["train_seconds"],
        "steps_done": meta.get("steps_done", meta["settings"]["steps"]),
        "first_loss": meta["first_loss"],
        "final_loss": meta["final_loss"],
        "parameters": meta["parameters"],
    }
    log(
        f"policy warm start: {info['parameters']:,} parameters, {info['steps_done']} steps in "
        f"{info['train_seconds']:.0f} s, loss {info['first_loss']:.2f} -> {info['final_loss']:.3f}"
    )
    return directory, info


def cached_drafter(args: E2EOptions, policy_dir: Path, device: str, dtype: torch.dtype) -> tuple[Path, dict[str, Any]]:
    """An EAGLE drafter trained offline on the warm policy's own rollouts (TLT's drafter warm-up, `warm_drafter`),
    cached."""
    from transformers import PreTrainedTokenizerFast

    from lightning_tlt.drafters.trainer import DrafterTrainConfig

    directory = stage_dir(args, policy_dir, "drafter") / "drafter"
    info_path = directory / "warmup.json"
    if info_path.is_file():
        log(f"drafter warm start: cached ({directory})")
        return directory, json.loads(info_path.read_text()) | {"recomputed": False}
    t0 = time.perf_counter()
    policy = load_policy(policy_dir, device, dtype).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(policy_dir)
    data = get_task(args.task).make_dataset(args.drafter_prompts, difficulty=args.difficulty, seed=99)
    prompts = [encode_prompt(tokenizer, p) for p in data["prompt"]]
    prepared_s = time.perf_counter() - t0
    rollouts: dict[str, Any] = {}

    def on_rollouts(out: Any, rollout_s: float) -> None:
        lengths = [len(c) for c in out.completion_ids]
        correct = warm_correctness(args, data, tokenizer, out.completion_ids, args.drafter_samples)
        rollouts.update(lengths=lengths, correct=correct, gen_s=prepared_s + rollout_s)
        log(
            f"drafter warm start: {len(lengths)} rollouts of the warm policy in {rollouts['gen_s']:.0f} s, "
            f"lengths {percentiles([float(n) for n in lengths])}, correctness {correct:.3f} (what GRPO starts from)"
        )

    warm = warm_drafter(
        policy, prompts, directory, samples=args.drafter_samples, max_new=args.max_new, steps=args.drafter_steps,
        config=DrafterTrainConfig(batch_size=16, max_len=512, learning_rate=args.drafter_lr, warmup_steps=20),
        rollout_seed=99, on_rollouts=on_rollouts,
    )  # fmt: skip
    result = warm.result
    info = {
        "recomputed": True,
        "rollouts": len(rollouts["lengths"]),
        "rollout_lengths": percentiles([float(n) for n in rollouts["lengths"]]),
        "rollout_correctness": rollouts["correct"],
        "generate_s": rollouts["gen_s"],
        "train_steps": result.steps,
        "train_s": warm.train_s,
        "heldout_accept_rate_before": result.heldout_before,
        "heldout_accept_rate_after": result.heldout_after,
        "seconds": time.perf_counter() - t0,
    }
    info_path.write_text(json.dumps(info, indent=1, default=float))
    log(f"drafter warm start: {result.steps} steps in {info['train_s']:.1f} s, saved to {directory}")
    del warm, result, policy
    free()
    return directory, info


def warm_correctness(
    args: E2EOptions, data: Any, tokenizer: Any, completion_ids: list[list[int]], samples: int
) -> float:
    """The task's correctness reward, averaged over completions of ``data``'s prompts (``samples`` each),
    scored as the datamodule scores a rollout (`compute_rewards`)."""
    from lightning_tlt.data.rewards import compute_rewards

    rows = [r for r in data.to_list() for _ in range(samples)]
    scores = compute_rewards(
        get_task(args.task).reward_funcs[:1], prompts=[r["prompt"] for r in rows],
        completions=tokenizer.batch_decode(completion_ids, skip_special_tokens=True), completion_ids=completion_ids,
        columns={k: [r[k] for r in rows] for k in rows[0] if k != "prompt"},
    ).rewards  # fmt: skip
    return float(scores.nanmean())


# ---------------------------------------------------------------------------------------------- --carry


def carry(args: E2EOptions, report: dict[str, Any], source: str, parts: Path, trl_dir: Path,
          capped: bool = False) -> list[str]:
    """Put the run units of an earlier report (``--carry``; its ``capped`` section if ``capped``) into
    this machine's cache where it has none.

    Only runs measured with this call's settings are taken: the section's settings
    (`RUN_KEYS`, `DRAFTER_KEYS`, `TLT_KEYS`; TRL's `TRL_KEYS`), must equal this call's, a setting the
    report predates counting as its default; TRL's unit only from a report of format 2 (bf16
    generation). A seed's a and b are carried together, and only where neither is cached here.
    Each carried unit keeps its provenance (commit, date, device), marked ``measured: false`` with
    ``carried_from: source`` (the first report it was carried from, if carried before). Returns what
    was carried.
    """
    defaults = {**E2EOptions().settings(), **PREDATED_DEFAULTS}
    old = (report.get("capped") or {}) if capped else report
    old_args = report["args"]
    if capped:  # the section's own settings, as `E2EOptions.capped` derives them
        old_args = {**old_args, "max_new": old_args.get("cap"), "steps": old_args.get("cap_steps") or old_args["steps"]}

    def same(keys: tuple[str, ...]) -> bool:
        return all(old_args.get(k, defaults[k]) == getattr(args, k) for k in keys)

    def carried(unit: dict[str, Any]) -> dict[str, Any]:
        first = unit.get("provenance") or {"commit": "unknown", "date": report.get("date"),
                                           "device": report.get("card")}
        return {**unit, "provenance": {**first, "measured": False, "carried_from": first.get("carried_from", source)}}

    taken = []
    runs_match = same(RUN_KEYS + DRAFTER_KEYS + TLT_KEYS)  # the report's settings, one for all its runs
    for seed in sorted({run["seed"] for run in old.get("runs", [])} if runs_match else ()):
        # a seed's a and b together or not at all: each is paired with the other, and a carried one beside
        # one measured here would compare runs from two warm starts
        pair = {run["name"]: run for run in old["runs"] if run["seed"] == seed}
        paths = {name: parts / run_file(args, name, seed) for name in ("nospec", "tlt")}
        if set(pair) != set(paths) or any(path.is_file() for path in paths.values()):
            continue
        if any(run.get("start") != UNIT_START for run in pair.values()):
            continue  # measured otherwise than this format's units (`UNIT_FORMAT`): a cache of them would mix the two
        for name, path in paths.items():
            path.write_text(json.dumps(carried(pair[name]), default=float))
            taken.append(f"{name}/seed{seed}")
    trl_path = trl_dir / "trl.json"
    if old.get("trl_runs") and report.get("format", 1) >= 2 and same(TRL_KEYS) and not trl_path.is_file():
        trl_path.write_text(json.dumps(carried(old["trl_runs"][0]), default=float))
        taken.append("trl")
    return taken

