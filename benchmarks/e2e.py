"""End to end, side by side: TLT vs speculation off vs TRL ``GRPOTrainer`` on a long-tail reasoning workload.

The paper's table in miniature (issue 15), measured in one process on one GPU, on the workload that
looks like the paper's: ``countdown_search`` (Countdown with the depth-first search written out, a
heavy tail of response lengths; difficulty 3: p50 about 270 tokens, p99 about 6,700 in the worked
solutions, cut at 4,096; difficulty 4, p50 475, left the 0.5 B policy of a 180 s warm start at
correctness 0 on the H200, with nothing for GRPO to learn)
and the Qwen2.5-0.5B-shaped zoo policy (``0.5b``: 494 M parameters, a 151,936-row tied head):

a. ``tlt``: the kit with speculation: the suffix drafter speculates first, the EAGLE drafter
   (warm-started offline on the policy's own rollouts, then co-trained in the stalls by
   `DrafterCoTrainCallback`) takes over once its held-out acceptance beats the suffix drafter's;
b. ``nospec``: the same engine, settings and seed with speculation off;
c. ``trl``: TRL's ``GRPOTrainer`` with its default HF ``generate``, same policy, task and settings
   (`grpo_settings`), as many steps as its own time budget allows (measured, not extrapolated).

On the GPU all three train float32 master weights under bf16 autocast (``--master-weights``); a and
b roll out from the engine's bf16 copy of them (`lightning_tlt.rollout.inference_copy`), and cut
the update into micro-batches by tokens (``--micro-batch-tokens``). The first H200 measurement
(``e2e_h200_20261203_d3.json``) trained bf16 weights, which AdamW steps of 1e-5 mostly leave as they are.

Stages (``--stage``, comma-separated, default ``all``): ``warmstart`` (SFT of the policy, bounded in
time, then the drafter's warm start), ``ab`` (b, then a over b's number of steps, seed by seed),
``trl``, and the report, which every call writes from all that is cached. Every unit is cached under
``.cache/`` (git-ignored) as soon as it ends, keyed by the policy it starts from and its own
settings, so a call that is stopped loses only the unit it was in; with ``--out``, each finished run
is also copied to ``e2e_runs/`` beside it, so a remote call the watchdog ends still brings its
finished runs back. ``--budget-s`` bounds one call:
a unit starts only when its estimated time (b's measured time, once there is one) fits in what is
left, and a run ends by the deadline it was given, loading, compiling and capturing included.

Reported per configuration: step time split into rollout (of it: the tail, at most ``--threshold``
rows active), reward, train and drafter; response lengths (p50, p90, p99, max); acceptance over
steps; correctness per step; the ratios ``a_over_b_step``, ``a_over_b_rollout``, ``a_over_b_tail``,
``tlt_over_trl_step``; and the "no accuracy loss" judgement: the mean difference of the
correctness curves of a and b over steps and seeds, with its standard error.

GPU: the same command, repeated on the still-warm machine until the report is whole (about three
calls of under 10 minutes on an H200: warm starts; b and a of seed 0; TRL, then seed 1 if time is
left)::

    python benchmarks/e2e.py

CPU smoke check of the whole pipeline (tiny model, about two minutes; caches under .cache/e2e_smoke/, writes
under benchmarks/results/smoke/):
``python benchmarks/e2e.py --smoke``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import faulthandler
import gc
import hashlib
import json
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from _common import write_results
from lightning.pytorch.callbacks import Callback

from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig, StepEvent
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.tokenizer import encode_prompt
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.rl.warmstart import warm_start, warm_start_dir, warm_start_metadata
from lightning_tlt.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent
STAGES = ("warmstart", "ab", "trl")
_T0 = time.perf_counter()


def log(message: str) -> None:
    """A progress line with the seconds since the script started."""
    print(f"[e2e {time.perf_counter() - _T0:7.1f} s] {message}", flush=True)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free() -> None:
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


# ---------------------------------------------------------------------------------------------- settings


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
        "num_iterations": 1,
    }


def warm_start_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(
        difficulty=args.difficulty,
        seed=0,
        steps=args.sft_steps,
        batch_size=args.sft_batch,
        lr=args.sft_lr,
        max_length=args.sft_max_length,
        batch_tokens=args.sft_batch_tokens,
        max_time_s=args.sft_max_time_s,
        cache_dir=args.cache_dir,
    )


DRAFTER_KEYS = ("drafter_prompts", "drafter_samples", "drafter_steps", "drafter_lr", "max_new")
RUN_KEYS = ("steps", "prompts", "generations", "max_new", "lr", "micro_batch", "micro_batch_tokens", "threshold",
            "engine", "master_weights")
TLT_KEYS = ("cotrain_lr", "stall_steps", "side_stream_sms")
"""Settings only a (``tlt``) reads: they key a's file alone, so changing them reuses b's runs."""
TRL_KEYS = ("trl_steps", "trl_budget_s", "prompts", "generations", "max_new", "lr", "micro_batch", "master_weights")


def _key(prefix: str, args: argparse.Namespace, keys: tuple[str, ...]) -> str:
    settings = {k: getattr(args, k) for k in keys}
    return f"{prefix}-{hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]}"


def workload_key(args: argparse.Namespace) -> str:
    """The workload's name (task, size, the warm start's settings); each stage caches below it."""
    keys = ("arch", "smoke", "sft_steps", "sft_batch", "sft_lr", "sft_max_length", "sft_batch_tokens", "sft_max_time_s")
    return _key(f"{args.task}-d{args.difficulty}-{args.size}", args, keys)


def run_file(args: argparse.Namespace, name: str, seed: int) -> str:
    """A run's file name in the ``runs`` stage: b's by its seed, a's also by a's own settings."""
    return f"{_key('tlt', args, TLT_KEYS)}_seed{seed}.json" if name == "tlt" else f"{name}_seed{seed}.json"


def stage_dir(args: argparse.Namespace, policy_dir: Path, stage: str) -> Path:
    """Where a stage's results are cached: keyed by the policy it starts from and by its own settings
    only (a changed TRL budget does not recompute the drafter or the a/b runs, a new policy does)."""
    drafter = _key(f"drafter-{policy_dir.name}", args, DRAFTER_KEYS)
    key = {"drafter": drafter, "runs": _key(f"runs-{drafter}", args, RUN_KEYS),
           "trl": _key(f"trl-{policy_dir.name}", args, TRL_KEYS)}[stage]  # fmt: skip
    path = Path(args.cache_dir).parent / "e2e" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_policy(policy_dir: Path, device: str, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=dtype).to(device)


# ---------------------------------------------------------------------------------------------- warm starts


def warm_policy(args: argparse.Namespace, device: str) -> tuple[Path, dict[str, Any]]:
    """The SFT-warm-started policy (cached by `warm_start`); says whether it was recomputed."""
    kwargs = warm_start_kwargs(args)
    directory = warm_start_dir(args.task, args.arch, args.size, **kwargs)
    cached = (directory / "warmstart.json").is_file()
    log(f"policy warm start: {'cached' if cached else 'training'} ({directory.name})")
    t0 = time.perf_counter()
    model, _ = warm_start(args.task, args.arch, args.size, device=device, progress=False, **kwargs)
    del model
    _free()
    meta = warm_start_metadata(directory)
    info = {
        "recomputed": not cached,
        "seconds_this_call": time.perf_counter() - t0,
        "dir": str(directory),
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


def warm_drafter(
    args: argparse.Namespace, policy_dir: Path, device: str, dtype: torch.dtype
) -> tuple[Path, dict[str, Any]]:
    """An EAGLE drafter trained offline on the warm policy's own rollouts (TLT's drafter warm-up), cached."""
    from lightning_tlt.drafters.offline import train_drafter
    from lightning_tlt.drafters.trainer import DrafterTrainConfig
    from lightning_tlt.rollout.engine import RolloutEngine

    directory = stage_dir(args, policy_dir, "drafter") / "drafter"
    info_path = directory / "warmup.json"
    if info_path.is_file():
        log(f"drafter warm start: cached ({directory})")
        return directory, json.loads(info_path.read_text()) | {"recomputed": False}
    t0 = time.perf_counter()
    policy = load_policy(policy_dir, device, dtype).eval()
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(policy_dir)
    data = get_task(args.task).make_dataset(args.drafter_prompts, difficulty=args.difficulty, seed=99)
    prompts = [encode_prompt(tokenizer, p) for p in data["prompt"]]
    engine = RolloutEngine(
        policy,
        max_batch_size=len(prompts) * args.drafter_samples,
        max_seq_len=max(map(len, prompts)) + args.max_new,
    )
    out = engine.generate(
        prompts,
        SamplingConfig(temperature=1.0, max_new_tokens=args.max_new),
        num_samples=args.drafter_samples,
        generator=torch.Generator(device=device).manual_seed(99),
    )
    gen_s = time.perf_counter() - t0
    lengths = [len(c) for c in out.completion_ids]
    correct = warm_correctness(args, data, tokenizer, out.completion_ids, args.drafter_samples)
    log(
        f"drafter warm start: {len(lengths)} rollouts of the warm policy in {gen_s:.0f} s, "
        f"lengths {percentiles([float(n) for n in lengths])}, correctness {correct:.3f} (what GRPO starts from)"
    )
    del engine
    t1 = time.perf_counter()
    result = train_drafter(  # the same captured step the co-training callback replays in the stalls
        policy,
        [list(p) + list(c) for p, c in zip(out.prompt_ids, out.completion_ids)],
        [len(p) for p in out.prompt_ids],
        steps=args.drafter_steps,
        config=DrafterTrainConfig(batch_size=16, max_len=512, learning_rate=args.drafter_lr, warmup_steps=20),
    )
    _sync()
    steps = result.steps
    result.drafter.inference_copy().save_pretrained(directory)  # in the policy's dtype, as the engine drafts
    info = {
        "recomputed": True,
        "rollouts": len(lengths),
        "rollout_lengths": percentiles([float(n) for n in lengths]),
        "rollout_correctness": correct,
        "generate_s": gen_s,
        "train_steps": steps,
        "train_s": time.perf_counter() - t1,
        "heldout_accept_rate_before": result.heldout_before,
        "heldout_accept_rate_after": result.heldout_after,
        "seconds": time.perf_counter() - t0,
    }
    info_path.write_text(json.dumps(info, indent=1, default=float))
    log(f"drafter warm start: {steps} steps in {info['train_s']:.1f} s, saved to {directory}")
    del result, policy
    _free()
    return directory, info


def warm_correctness(
    args: argparse.Namespace, data: Any, tokenizer: Any, completion_ids: list[list[int]], samples: int
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


# ---------------------------------------------------------------------------------------------- a and b


class StepRecorder(Callback):
    """Per RL step: wall time, its split, lengths, correctness and speculation figures; prints a line.

    The rollout happens while the Trainer fetches the batch (before ``on_train_batch_start``), so a
    step's wall time runs from one ``on_train_batch_end`` to the next; the engine reports its own
    generation time, the reward time comes from the batch's metrics, the train time is timed here
    with device syncs, and step events split rollout time into the tail (active rows at or below
    ``tail_rows``) and the rest.
    """

    def __init__(
        self, name: str, tail_rows: int, correctness_key: str, deadline: float, watchdog_s: float = 0.0,
        step_timeout_s: float = 0.0,
    ) -> None:
        self.name, self.tail_rows, self.correctness_key = name, tail_rows, correctness_key
        self.deadline = deadline
        """``time.perf_counter()`` by which the run must end: no step starts that would not finish by then."""
        self.watchdog_s, self.step_timeout_s = watchdog_s, step_timeout_s
        """The watchdog (`arm_watchdog`): ``watchdog_s`` past the deadline, or, after the first step,
        ``step_timeout_s`` past the last step's end if that comes first; 0 leaves that bound out."""
        self.marker = _TrainEndMarker(self)
        """Put first in the Trainer's callbacks (this recorder last): it stamps the end of the
        training step, so the RL-step boundary work of other callbacks (drafter publishing) is timed apart."""
        self.steps: list[dict[str, Any]] = []
        self._train_end = 0.0
        self._last_end: float | None = None
        self._start = 0.0
        self._train_start = 0.0
        self._tail_s = self._bulk_s = 0.0
        self._engine_hooked = False
        self._nonfinite_before_update: list[str] = []
        self._nonfinite_after_update: list[str] = []
        self._graphs_seen = (0.0, 0.0)  # the engine's (captures, capture seconds) at the last step's end

    def _on_event(self, event: StepEvent) -> None:
        if event.phase == "done":
            return
        if event.active_rows <= self.tail_rows:
            self._tail_s += event.step_time_s
        else:
            self._bulk_s += event.step_time_s

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _sync()
        self._start = self._last_end = time.perf_counter()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._engine_hooked:  # the engine exists once the first batch was generated
            trainer.datamodule.add_listener(self._on_event)  # type: ignore[attr-defined]
            self._engine_hooked = True
        _sync()
        self._nonfinite_before_update = nonfinite_parameters(pl_module)  # after the rollout, before the update
        self._train_start = time.perf_counter()  # (the check's read-back waited for the device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _sync()
        now = time.perf_counter()
        train_end = self._train_end or now
        m = dict(batch.metrics)
        lengths = batch.completion_mask.sum(1).tolist()
        cotrain = [c for c in trainer.callbacks if type(c).__name__ == "DrafterCoTrainCallback"]  # type: ignore[attr-defined]
        r: dict[str, Any] = {
            "step": len(self.steps),
            "wall_s": now - (self._last_end or now),
            "train_s": train_end - self._train_start,
            "boundary_s": now - train_end,
            "rollout_s": m.get("rollout/time_s", float("nan")),
            "reward_s": m.get("rollout/reward_time_s", float("nan")),
            "tail_s": self._tail_s,
            "bulk_s": self._bulk_s,
            "tokens": float(sum(lengths)),
            "reward": m.get("reward", float("nan")),
            "correctness": m.get(self.correctness_key, float("nan")),
            "lengths": lengths,
            "accept_len": m.get("spec/accept_len", float("nan")),
            "spec_fraction": m.get("spec/fraction", float("nan")),
            "metrics": {k: v for k, v in m.items() if isinstance(v, (int, float))},
        }
        # drafter time: its training in the stalls (inside the rollout) plus its work at the boundary
        # (GPU time of the steps on the side stream, overlapping decode: CUDA events)
        r["drafter_stall_s"] = (
            float(cotrain[0].last_metrics.get("drafter/train_time_s", 0.0)) if cotrain else 0.0
        )
        r["drafter_s"] = r["drafter_stall_s"] + (r["boundary_s"] if cotrain else 0.0)
        # issue 14's figures on this workload: drafter steps in this RL step's stalls, the pacer's
        # measured decode slowdown, the stall time there was
        last = cotrain[0].last_metrics if cotrain else {}
        r["drafter_steps"] = float(last.get("drafter/steps_this_rl_step", float("nan")))
        r["decode_slowdown"] = float(last.get("drafter/decode_slowdown", float("nan")))  # mean over stall steps
        r["loaded_stall_share"] = float(last.get("drafter/loaded_stall_share", float("nan")))
        r["loaded_step_slowdown"] = float(last.get("drafter/loaded_step_slowdown", float("nan")))
        r["stall_time_available_s"] = float(last.get("drafter/stall_time_available_s", float("nan")))
        r["eagle_drafting"] = float(trainer.callback_metrics.get("drafter/eagle_drafting", float("nan")))
        # where a policy that stops being finite went wrong: in the RL update, or at the boundary after it
        r["grad_norm"] = float(trainer.callback_metrics.get("grad_norm", float("nan")))
        r["nonfinite_grad_steps"] = float(trainer.callback_metrics.get("train/nonfinite_grad_steps", float("nan")))
        r["nonfinite_before_update"] = self._nonfinite_before_update  # names of weights, first 5
        r["nonfinite_after_update"] = self._nonfinite_after_update
        r["nonfinite_after_boundary"] = nonfinite_parameters(pl_module)
        r["drafter_metrics"] = {k: float(v) for k, v in last.items() if isinstance(v, (int, float))}
        # graphs captured in this step (a one-time cost: the first time a batch bucket or k is met)
        graphs = getattr(trainer.datamodule.engine, "graph_stats", None) or {}  # type: ignore[attr-defined]
        seen = (float(graphs.get("captures", 0.0)), float(graphs.get("capture_time_s", 0.0)))
        r["graph_captures"], r["capture_s"] = seen[0] - self._graphs_seen[0], seen[1] - self._graphs_seen[1]
        self._graphs_seen = seen
        self.steps.append(r)
        acc = f" accept {r['accept_len']:.2f}" if r["accept_len"] == r["accept_len"] else ""
        lp = percentiles([float(n) for n in lengths])
        log(
            f"{self.name} step {r['step']}: {r['wall_s']:.2f} s (rollout {r['rollout_s']:.2f}, tail {r['tail_s']:.2f}, "
            f"reward {r['reward_s']:.3f}, train {r['train_s']:.2f}, drafter {r['drafter_s']:.2f}) | len p50 "
            f"{lp['p50']:.0f} max {lp['max']:.0f} | correct {r['correctness']:.3f} | spec "
            f"{100 * r['spec_fraction']:.0f}%{acc}" + (" eagle" if r["eagle_drafting"] == 1.0 else "")
            + f" | grad norm {r['grad_norm']:.3g}"
            + (f" | {r['graph_captures']:.0f} graphs captured ({r['capture_s']:.1f} s)" if r["graph_captures"] else "")
            + "".join(f" | NOT FINITE {when}: {', '.join(names)}" for when, names in (
                ("after the rollout", r["nonfinite_before_update"]), ("after the update", r["nonfinite_after_update"]),
                ("after the boundary", r["nonfinite_after_boundary"])) if names)
        )
        self._tail_s = self._bulk_s = 0.0
        self._last_end = now
        self.arm_watchdog(after_first_step=True)
        if now + r["wall_s"] > self.deadline:  # the next step would not finish in time: stop here
            log(f"{self.name}: deadline reached after {len(self.steps)} steps")
            trainer.should_stop = True

    def arm_watchdog(self, after_first_step: bool = False) -> None:
        """(Re-)arm the process watchdog: a step still running at its bound prints every thread's stack
        and ends the process (the runs cached before it survive; the log says where it hung)."""
        left = self.deadline - time.perf_counter()
        bounds = [max(left, 0.0) + self.watchdog_s] if self.watchdog_s > 0 else []
        if after_first_step and self.step_timeout_s > 0:  # step 0 compiles and captures: only the deadline
            bounds.append(self.step_timeout_s)
        if bounds:
            faulthandler.dump_traceback_later(min(bounds), exit=True)


class _TrainEndMarker(Callback):
    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _sync()
        self.recorder._train_end = time.perf_counter()
        # after the RL update, before any other callback's boundary work (the drafter's)
        self.recorder._nonfinite_after_update = nonfinite_parameters(pl_module)


def nonfinite_parameters(pl_module: pl.LightningModule, most: int = 5) -> list[str]:
    """The names of (at most ``most``) policy weights that are not finite: one reduction per tensor, one sync."""
    named = list(pl_module.policy.named_parameters())  # type: ignore[union-attr]
    flags = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
    return [name for (name, _), ok in zip(named, flags) if not ok][:most]


def run_lightning(
    name: str,
    args: argparse.Namespace,
    seed: int,
    policy_dir: Path,
    drafter_dir: Path | None,
    steps: int,
    time_limit_s: float,
) -> dict[str, Any]:
    """One GRPO run with the kit: configuration a (``tlt``) or b (``nospec``), ended within
    ``time_limit_s`` of this call (loading, compiling and capturing included)."""
    deadline = time.perf_counter() + time_limit_s
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # float32 master weights trained under bf16 autocast, rollouts from the engine's bf16 copy of them
    # (the datamodule's default under bf16-mixed); "bfloat16": the weights themselves in bf16, where
    # AdamW steps of 1e-5 leave most of them unchanged (this run's first H200 measurement trained so)
    mixed = device == "cuda" and args.master_weights == "float32"
    dtype = torch.bfloat16 if device == "cuda" and not mixed else torch.float32
    pl.seed_everything(seed, workers=False, verbose=False)
    policy = load_policy(policy_dir, device, dtype)
    split = {"micro_batch_tokens": args.micro_batch_tokens} if args.micro_batch_tokens else {
        "micro_batch_size": args.micro_batch}  # how the update is cut into forwards (the same gradient)
    module = GRPOModule(policy, GRPOConfig(**grpo_settings(args), **split))
    # TLT's cold start: the suffix drafter speculates until the EAGLE drafter beats it
    speculative = SpeculativeConfig(method="suffix", threshold=args.threshold) if name == "tlt" else None
    data = RolloutDataModule(
        args.task,
        prompts_per_step=args.prompts,
        difficulty=args.difficulty,
        task_size=args.prompts * (args.steps + 2),  # the same prompt order for a and b, whatever `steps`
        speculative=speculative,
        seed=seed,
        max_batch_size=args.prompts * args.generations,
        engine_kwargs=args.engine,
    )
    task = get_task(args.task)
    correctness_key = f"rewards/{task.reward_funcs[0].__name__}/mean"
    recorder = StepRecorder(name, args.threshold, correctness_key, deadline, args.watchdog_s, args.step_timeout_s)
    callbacks: list[Callback] = [recorder.marker]
    if name == "tlt":
        from lightning_tlt.callbacks.drafter_cotrain import DrafterCoTrainCallback
        from lightning_tlt.drafters.eagle import EagleDrafter

        drafter = None
        if drafter_dir is not None:
            drafter = EagleDrafter.from_pretrained(drafter_dir, policy).to(device=device, dtype=torch.float32)
        # stall steps paced by the measured decode slowdown (default cap 5 %), on a side stream on CUDA
        callbacks.append(
            DrafterCoTrainCallback(
                drafter=drafter,
                stall_threshold=args.threshold,
                learning_rate=args.cotrain_lr,
                max_steps_per_event=args.stall_steps,
                side_stream_sms=args.side_stream_sms,
                publish_every_n_steps=1,
            )
        )
    callbacks.append(recorder)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="gpu" if device == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if mixed else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,  # no evaluation rollouts: each is a full batch of long completions
        limit_val_batches=0,
        callbacks=callbacks,
    )
    log(f"{name} seed {seed}: up to {steps} steps, ends within {time_limit_s:.0f} s")
    t0 = time.perf_counter()
    error = None
    # the recorder ends a run at a step boundary; a step still running --watchdog-s after the deadline, or
    # --step-timeout-s after the step before it (seed 1's fifth TLT step on the H200 never ended), prints
    # every thread's stack, then ends the process: the runs cached before it survive, the log says where
    recorder.arm_watchdog()
    try:
        trainer.fit(module, datamodule=data)
    except FloatingPointError as err:  # a policy that is no longer finite: keep the steps before it, and why
        error = f"{type(err).__name__}: {err}"
        log(f"{name} seed {seed} stopped: {error}")
    finally:
        faulthandler.cancel_dump_traceback_later()
    total = time.perf_counter() - t0
    graphs = getattr(data.engine, "graph_stats", None)
    run = {
        "name": name,
        "seed": seed,
        "total_s": total,
        "steps": recorder.steps,
        "graph_stats": dict(graphs) if isinstance(graphs, dict) else None,
        "error": error,
    }
    del trainer, module, data, policy, callbacks, recorder
    _free()
    return run


# ---------------------------------------------------------------------------------------------- TRL


def run_trl(args: argparse.Namespace, seed: int, policy_dir: Path, budget_s: float) -> dict[str, Any]:
    """Configuration c: TRL's GRPOTrainer with its default HF generation, steps while its budget lasts."""
    import functools

    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig as TRLGRPOConfig
    from trl import GRPOTrainer

    task = get_task(args.task)
    cuda = torch.cuda.is_available()
    rows = args.prompts * args.generations
    micro = min(args.micro_batch or rows, rows)
    dataset = task.make_dataset(args.prompts * (args.trl_steps + 2), difficulty=args.difficulty, seed=seed)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(policy_dir)
    times: list[float] = []
    lengths: list[list[int]] = []
    correctness, fmt = task.reward_funcs

    @functools.wraps(correctness)
    def recorded(
        *a: Any, **k: Any
    ) -> list[float]:  # the task's correctness, recording the lengths TRL sampled
        lengths.append([len(c) for c in k.get("completion_ids") or []])
        return correctness(*a, **k)

    class Timer(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            _sync()
            self.t = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, control: Any, **k: Any) -> None:
            _sync()
            times.append(time.perf_counter() - self.t)
            log(f"trl step {len(times) - 1}: {times[-1]:.2f} s")
            if time.perf_counter() - start + times[-1] > budget_s:  # the next step would not fit
                control.should_training_stop = True

    cfg = TRLGRPOConfig(
        output_dir=str(stage_dir(args, policy_dir, "trl") / "trl_out"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,  # one optimizer step per generation batch, as a and b
        **grpo_settings(args),
        max_steps=args.trl_steps,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=seed,
        bf16=cuda,
        use_cpu=not cuda,
        dataloader_num_workers=0,
        disable_tqdm=True,
        gradient_checkpointing=False,  # TRL turns it on by default; a and b do not checkpoint
        # the weights in the same dtype as a and b's (float32 under bf16 autocast, or bf16 themselves)
        model_init_kwargs={"dtype": args.master_weights} if cuda else None,
    )
    trainer = GRPOTrainer(
        model=str(policy_dir),
        reward_funcs=[recorded, fmt],
        args=cfg,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timer()],
    )
    log(
        f"trl seed {seed}: up to {args.trl_steps} steps, {rows} completions each ({micro} per micro-batch), "
        f"stops by {budget_s:.0f} s"
    )
    start = time.perf_counter()
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    key = f"rewards/{correctness.__name__}/mean"
    run = {
        "name": "trl",
        "seed": seed,
        "step_s": times,
        "total_s": time.perf_counter() - start,
        "reward": [h.get("reward") for h in logged],
        "correctness": [h.get(key) for h in logged],
        "mean_length": [h.get("completions/mean_length") for h in logged],
        "lengths": lengths,
    }
    del trainer
    _free()
    return run


# ---------------------------------------------------------------------------------------------- report


def summarize(runs: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Means over the steps after the first ``skip`` (compile, graph capture) of one configuration's runs."""
    steps = [s for r in runs for s in (r["steps"][skip:] or r["steps"])]
    mean = lambda key: statistics.fmean(s[key] for s in steps)  # noqa: E731
    rollout = mean("rollout_s")
    return {
        "seeds": [r["seed"] for r in runs],
        "steps": [len(r["steps"]) for r in runs],
        "step_s": mean("wall_s"),
        "rollout_s": rollout,
        "tail_s": mean("tail_s"),
        "reward_s": mean("reward_s"),
        "train_s": mean("train_s"),
        "boundary_s": mean("boundary_s"),
        "drafter_s": mean("drafter_s"),
        "tokens_per_s": statistics.fmean(s["tokens"] for s in steps) / rollout
        if rollout > 0
        else float("nan"),
        "tail_share": mean("tail_s") / max(1e-9, mean("tail_s") + mean("bulk_s")),
        "lengths": percentiles([float(n) for r in runs for s in r["steps"] for n in s["lengths"]]),
        "correctness_curve": [[s["correctness"] for s in r["steps"]] for r in runs],
        "reward_curve": [[s["reward"] for s in r["steps"]] for r in runs],
        "accept_len_curve": [[s["accept_len"] for s in r["steps"]] for r in runs],
        "spec_fraction_curve": [[s["spec_fraction"] for s in r["steps"]] for r in runs],
        "eagle_drafting_curve": [[s["eagle_drafting"] for s in r["steps"]] for r in runs],
        "grad_norm_curve": [[s.get("grad_norm", math.nan) for s in r["steps"]] for r in runs],
        "errors": [r["error"] for r in runs if r.get("error")],
        # co-training in the stalls (configuration a; NaN for b), as issue 14 reports it
        # (runs cached before these were recorded have none: NaN)
        **{name: statistics.fmean(s.get(key, math.nan) for s in steps) for name, key in (
            ("drafter_steps_per_rl_step", "drafter_steps"), ("decode_slowdown_measured", "decode_slowdown"),
            ("stall_time_available_s", "stall_time_available_s"))},
        # the pacer's reading is a moving average that one step of captures can throw (H200, 0.5 B: a
        # mean of 17.5 % from two steps, a median of 0.01 %): both are reported
        "decode_slowdown_median": statistics.median(s.get("decode_slowdown", math.nan) for s in steps),
        # the one-time cost inside the steps: CUDA graphs captured (and the compiling inside them)
        "graph_captures": sum(s.get("graph_captures", math.nan) for s in steps),
        "capture_s": sum(s.get("capture_s", math.nan) for s in steps),
        "capture_s_per_step": statistics.fmean(s.get("capture_s", 0.0) for s in steps),
    }


def summarize_trl(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """TRL's step time: the mean after its first step (warm-up), or the first alone when it is all there is."""
    times = [t for r in runs for t in r["step_s"][1:]]
    return {
        "seeds": [r["seed"] for r in runs],
        "steps": [len(r["step_s"]) for r in runs],
        "step_s": statistics.fmean(times or [runs[0]["step_s"][0]]),
        "first_step_s": runs[0]["step_s"][0],
        "steps_timed": len(times),
        "first_step_only": not times,
        "lengths": percentiles([float(n) for r in runs for b in r["lengths"] for n in b]),
        "correctness_curve": [r["correctness"] for r in runs],
    }


def no_accuracy_loss(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Correctness of a minus b, step by step on the same seed: mean and standard error over steps and seeds.

    Speculation is lossless, so a and b sample from the same distributions; their curves differ by
    sampling noise only (different random draws), and the judgement asks whether the mean difference
    is within two standard errors of zero, or above it.
    """
    diffs: list[float] = []
    per_seed = {}
    for a in a_runs:
        b = next((r for r in b_runs if r["seed"] == a["seed"]), None)
        if b is None:
            continue
        d = [x["correctness"] - y["correctness"] for x, y in zip(a["steps"], b["steps"])]
        per_seed[a["seed"]] = statistics.fmean(d) if d else float("nan")
        diffs += d
    if len(diffs) < 2:
        return {"n": len(diffs), "judgement": "not enough paired steps"}
    failed = [f"{r['name']} seed {r['seed']}" for r in (*a_runs, *b_runs) if r.get("error")]
    if failed:
        return {"n": len(diffs), "judgement": f"cannot be judged: {', '.join(failed)} stopped early (see its error)"}
    solved = [x["correctness"] for r in (*a_runs, *b_runs) for x in r["steps"]]
    if not any(solved):  # equal curves of zeros say nothing about accuracy
        return {"n": len(diffs), "judgement": "cannot be judged: correctness is 0 at every step of a and b"}
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    verdict = (
        "no accuracy loss: within two standard errors of zero"
        if abs(mean) <= 2 * se
        else "no accuracy loss: TLT higher"
        if mean > 0
        else "accuracy LOSS: TLT lower by more than 2 SE"
    )
    return {
        "n": len(diffs),
        "mean_diff": mean,
        "stderr": se,
        "per_seed_mean_diff": per_seed,
        "judgement": f"{verdict} (a - b = {mean:+.3f} ± {se:.3f} over {len(diffs)} steps x seeds)",
    }


def ratios(summary: dict[str, Any]) -> dict[str, float | None]:
    """The issue's four ratios (``None`` where not measured or undefined)."""
    a, b, c = summary.get("tlt"), summary.get("nospec"), summary.get("trl")

    def over(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y is not None and y > 0 else None

    return {
        "a_over_b_step": over(b and b["step_s"], a and a["step_s"]),
        "a_over_b_rollout": over(b and b["rollout_s"], a and a["rollout_s"]),
        "a_over_b_tail": over(b and b["tail_s"], a and a["tail_s"]),
        "tlt_over_trl_step": over(c and c["step_s"], a and a["step_s"]),
    }


def paired(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """a and b of each seed cut to the steps both ran (the same prompts): means and ratios compare like
    with like; a configuration without its pair is kept whole."""
    out = []
    for run in runs:
        other = next((r for r in runs if r["seed"] == run["seed"] and r["name"] != run["name"]), None)
        n = min(len(run["steps"]), len(other["steps"])) if other is not None else len(run["steps"])
        out.append({**run, "steps": run["steps"][:n]})
    return out


def plot(results: dict[str, Any], runs: list[dict[str, Any]], out_dir: Path) -> list[str]:
    """Correctness curves a vs b, step-time split, length histogram, acceptance over steps (headless)."""
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
    plt.close("all")
    return written


def print_table(results: dict[str, Any]) -> None:
    s = results["summary"]
    print(
        f"\n{'config':8} {'step s':>7} {'rollout':>8} {'tail':>6} {'reward':>7} {'train':>6} {'drafter':>7} "
        f"{'tok/s':>8} {'p50':>5} {'p99':>5} {'max':>5} {'accept':>6} {'correct first->last':>20}"
    )
    for name in ("tlt", "nospec"):
        if name in s:
            r = s[name]
            acc = [x for c in r["accept_len_curve"] for x in c if x == x]
            curves = [c for c in r["correctness_curve"] if c]
            k = max(1, min(len(c) for c in curves) // 4) if curves else 1
            first = statistics.fmean(x for c in curves for x in c[:k]) if curves else float("nan")
            last = statistics.fmean(x for c in curves for x in c[-k:]) if curves else float("nan")
            print(
                f"{name:8} {r['step_s']:7.2f} {r['rollout_s']:8.2f} {r['tail_s']:6.2f} {r['reward_s']:7.3f} "
                f"{r['train_s']:6.2f} {r['drafter_s']:7.3f} {r['tokens_per_s']:8.0f} {r['lengths']['p50']:5.0f} "
                f"{r['lengths']['p99']:5.0f} {r['lengths']['max']:5.0f} "
                f"{(statistics.fmean(acc) if acc else float('nan')):6.2f} {first:9.3f} -> {last:.3f}"
            )
    if "trl" in s:
        t = s["trl"]
        timed = (
            "only the first step (warm-up included)"
            if t["first_step_only"]
            else f"{t['steps_timed']} steps after it"
        )
        print(
            f"{'trl':8} {t['step_s']:7.2f}   (first step {t['first_step_s']:.2f} s; mean of {timed}; "
            f"lengths p50 {t['lengths']['p50']:.0f} p99 {t['lengths']['p99']:.0f} max {t['lengths']['max']:.0f})"
        )
    for k, v in results["ratios"].items():  # null where a configuration is not measured yet
        print(f"  {k}: {'not measured yet' if v is None else f'{v:.2f}x'}")
    print(f"  {results['no_accuracy_loss']['judgement']}")
    for name in ("tlt", "nospec"):
        for error in s.get(name, {}).get("errors", []):
            print(f"  {name} STOPPED EARLY: {error}")
    a = s.get("tlt", {})
    if a.get("drafter_steps_per_rl_step", math.nan) == a.get("drafter_steps_per_rl_step"):  # not NaN
        print(f"  co-training (a): {a['drafter_steps_per_rl_step']:.1f} drafter steps per RL step in "
              f"{a['stall_time_available_s']:.2f} s of stalls, measured decode slowdown "
              f"{100 * a['decode_slowdown_measured']:.1f} % (median {100 * a['decode_slowdown_median']:.2f} %)")  # fmt: skip


# ---------------------------------------------------------------------------------------------- main


def engine_options(text: str) -> dict[str, Any]:
    """``--engine``: a JSON object of `RolloutEngine` options."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of engine options, e.g. '{{\"use_cuda_graphs\": false}}', got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--stage", default="all", help="comma-separated: warmstart, ab, trl, or all (the report always)"
    )
    p.add_argument(
        "--budget-s", type=float, default=560.0, help="wall time of this call (units that do not fit wait)"
    )
    p.add_argument("--task", default="countdown_search")
    p.add_argument(
        "--difficulty", type=int, default=3, help="countdown_search level (4: correctness 0 after the warm start)"
    )
    p.add_argument("--arch", default="qwen2")
    p.add_argument("--size", default="0.5b")
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--sft-batch", type=int, default=32, help="sequences per SFT step (fewer when long)")
    p.add_argument("--sft-batch-tokens", type=int, default=16384, help="most padded tokens per SFT batch")
    p.add_argument("--sft-lr", type=float, default=5e-4)
    p.add_argument("--sft-max-length", type=int, default=4160, help="SFT sequences are cut here")
    p.add_argument("--sft-max-time-s", type=float, default=180.0, help="the policy warm start stops by then")
    p.add_argument(
        "--drafter-prompts", type=int, default=32, help="prompts of the drafter's warm-up rollouts"
    )
    p.add_argument("--drafter-samples", type=int, default=2)
    p.add_argument("--drafter-steps", type=int, default=600)
    p.add_argument("--drafter-lr", type=float, default=1e-3, help="offline warm-up learning rate")
    p.add_argument("--cotrain-lr", type=float, default=1e-4, help="co-training learning rate in the stalls")
    p.add_argument(
        "--stall-steps", type=int, default=4,
        help="most drafter steps queued at one stall event (0: the drafter is not trained in the stalls, only "
        "warm-started; splits speculation from the stall training)",
    )  # fmt: skip
    p.add_argument(
        "--side-stream-sms", type=int, default=None,
        help="a: the drafter's stall steps on a CUDA green context of this many SMs (DrafterTrainConfig."
        "side_stream_sms; default: every SM)",
    )
    p.add_argument("--steps", type=int, default=20, help="RL steps of configurations a and b")
    p.add_argument("--skip", type=int, default=2, help="first steps left out of the means (compile, capture)")
    p.add_argument("--trl-steps", type=int, default=3)
    p.add_argument(
        "--trl-budget-s", type=float, default=240.0, help="TRL runs steps while the next one fits in it"
    )
    p.add_argument("--prompts", type=int, default=8, help="prompts per RL step")
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new", type=int, default=4096)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument(
        "--micro-batch", type=int, default=4,
        help="rows per training forward: TRL's per_device_train_batch_size, and a and b's "
        "GRPOConfig.micro_batch_size when --micro-batch-tokens is 0",
    )
    p.add_argument(
        "--master-weights", choices=("float32", "bfloat16"), default="float32",
        help="a and b on the GPU: float32 weights under bf16-mixed (rollouts from a bf16 copy), or the "
        "weights in bf16 (AdamW steps of --lr mostly round away)",
    )
    p.add_argument(
        "--micro-batch-tokens", type=int, default=16384,
        help="a and b: most padded tokens per training forward (GRPOConfig.micro_batch_tokens; 0: rows only); "
        "16,384 holds the logits of 4 rows of 4,096 tokens, as --micro-batch 4 does",
    )
    p.add_argument(
        "--threshold", type=int, default=32, help="speculation gate / stall threshold (active rows)"
    )
    p.add_argument("--seeds", default="0,1")
    p.add_argument(
        "--est-run-s", type=float, default=360.0, help="first guess of one run (a or b), loading and capture included"
    )
    p.add_argument(
        "--engine", type=engine_options, default={},
        help='engine options of a and b as JSON, e.g. \'{"use_cuda_graphs": false}\' or \'{"fuse_projections": true}\'',
    )  # fmt: skip
    p.add_argument(
        "--watchdog-s", type=float, default=30.0,
        help="a and b: a step still running this long after its run's deadline prints every thread's stack "
        "and ends the process (the runs cached before it are kept); 0: off",
    )
    p.add_argument(
        "--step-timeout-s", type=float, default=0.0,
        help="a and b: a step after the first (which compiles and captures) still running this long does what "
        "--watchdog-s does; 0: off",
    )
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "lightning_tlt"))
    p.add_argument("--out", default=None)
    p.add_argument(
        "--carry", default=None, metavar="REPORT",
        help="an earlier report's JSON (same workload): its runs measured with this call's settings fill the "
        "cache where it has none (a fresh machine then measures only what is missing)",
    )
    p.add_argument("--plots", default=str(ROOT / "docs" / "img"))
    p.add_argument(
        "--smoke", action="store_true", help="tiny sizes on the CPU: the whole pipeline in about two minutes"
    )
    args = p.parse_args(argv)
    if args.smoke:
        smoke = ROOT / ".cache" / "e2e_smoke"
        args.size, args.difficulty, args.sft_steps, args.sft_batch, args.sft_max_time_s = (
            "tiny",
            1,
            400,
            32,
            60.0,
        )
        args.sft_max_length, args.sft_batch_tokens, args.drafter_prompts, args.drafter_steps = (
            None,
            None,
            4,
            30,
        )
        args.steps, args.skip, args.trl_steps, args.trl_budget_s, args.prompts = 6, 1, 2, 30.0, 8
        args.generations, args.max_new, args.threshold, args.micro_batch, args.seeds = 4, 96, 4, 8, "0"
        args.lr, args.budget_s, args.est_run_s = 1e-4, 150.0, 20.0
        results = (
            ROOT / "benchmarks" / "results" / "smoke"
        )  # git-ignored, like every benchmark's smoke output
        args.cache_dir, args.plots = str(smoke / "lightning_tlt"), str(results / "img")
        args.out = args.out or str(results / "e2e_smoke.json")
    stages = {s.strip() for s in args.stage.split(",") if s.strip()}
    if stages - {*STAGES, "all", "report"}:
        raise ValueError(f"--stage takes {', '.join(STAGES)}, report or all, got {args.stage!r}")
    args.stages = set(STAGES) if "all" in stages else stages
    if args.carry is not None and not Path(args.carry).is_file():
        raise ValueError(f"--carry takes an earlier report's JSON file, got {args.carry!r} (no such file)")
    if args.step_timeout_s < 0 or args.watchdog_s < 0:
        raise ValueError(f"--step-timeout-s and --watchdog-s must be >= 0 (0: off), got {args.step_timeout_s} and "
                         f"{args.watchdog_s}")
    if args.side_stream_sms is not None and args.side_stream_sms < 1:
        raise ValueError(f"--side-stream-sms must be >= 1 (default: every SM), got {args.side_stream_sms}")
    if args.stall_steps < 0:
        raise ValueError(f"--stall-steps must be >= 0 (0: no drafter steps in the stalls), got {args.stall_steps}")
    return args


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def carry(args: argparse.Namespace, source: Path, parts: Path, trl_dir: Path) -> list[str]:
    """Put the runs of an earlier report (``--carry``) into this machine's cache where it has none.

    Only runs measured with this call's settings are taken: the report's workload must be this one
    (else a `ValueError` before any work), and the runs' settings (`RUN_KEYS`, `DRAFTER_KEYS`,
    `TLT_KEYS`; TRL's `TRL_KEYS`) must equal this call's, a setting the report predates counting as
    its default. A seed's a and b are carried together, and only where neither is cached here.
    Returns what was carried; the report says so under ``carried``, and each carried run keeps the
    report it came from under ``carried_from`` (whichever later call reports it).
    """
    old = json.loads(source.read_text())
    if old.get("workload") != workload_key(args):
        raise ValueError(f"--carry {source}: its workload {old.get('workload')!r} is not this call's {workload_key(args)!r}")
    defaults = vars(parse_args([]))

    def same(keys: tuple[str, ...]) -> bool:
        return all(old["args"].get(k, defaults[k]) == getattr(args, k) for k in keys)

    taken = []
    runs_match = same(RUN_KEYS + DRAFTER_KEYS + TLT_KEYS)  # the report's settings, one for all its runs
    for seed in sorted({run["seed"] for run in old.get("runs", [])} if runs_match else ()):
        # a seed's a and b together or not at all: each is paired with the other, and a carried one beside
        # one measured here would compare runs from two warm starts
        pair = {run["name"]: run for run in old["runs"] if run["seed"] == seed}
        paths = {name: parts / run_file(args, name, seed) for name in ("nospec", "tlt")}
        if set(pair) != set(paths) or any(path.is_file() for path in paths.values()):
            continue
        for name, path in paths.items():
            run = pair[name]
            path.write_text(json.dumps({**run, "carried_from": run.get("carried_from", source.name)}, default=float))
            taken.append(f"{name}, seed {seed}")
    trl_path = trl_dir / "trl.json"
    if old.get("trl_runs") and same(TRL_KEYS) and not trl_path.is_file():
        trl_path.write_text(json.dumps(old["trl_runs"][0], default=float))
        taken.append("trl")
    log(f"carried from {source.name}: {', '.join(taken) or 'nothing (other settings, or already cached)'}")
    return taken


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    budget = Budget(args.budget_s)
    seeds = [int(s) for s in args.seeds.split(",")]
    log(
        f"workload {workload_key(args)}: {args.task} d{args.difficulty}, {args.size}, {args.prompts} prompts x "
        f"{args.generations}, max {args.max_new} new tokens; stages {sorted(args.stages)}"
    )
    recomputed: list[str] = []

    policy_dir = warm_start_dir(args.task, args.arch, args.size, **warm_start_kwargs(args))
    warm: dict[str, Any] = {}
    drafter_dir: Path | None = stage_dir(args, policy_dir, "drafter") / "drafter"
    if "warmstart" in args.stages or args.stages & {"ab", "trl"}:
        policy_dir, warm["policy"] = warm_policy(args, device)
        if warm["policy"]["recomputed"]:
            recomputed.append("policy warm start")
    if "warmstart" in args.stages or "ab" in args.stages:
        drafter_dir, warm["drafter"] = warm_drafter(args, policy_dir, device, dtype)
        if warm["drafter"]["recomputed"]:
            recomputed.append("drafter warm start")

    parts = stage_dir(args, policy_dir, "runs")
    carried = carry(args, Path(args.carry), parts, stage_dir(args, policy_dir, "trl")) if args.carry else []

    def estimate(name: str) -> float:
        """A run's wall time: b's measured total (a runs b's steps), else the first guess."""
        done = [r for s in seeds if (r := _load(parts / run_file(args, "nospec", s)))]
        return done[0]["total_s"] * 1.15 + 30 if done else args.est_run_s

    def run_config(name: str, seed: int) -> None:
        """b (``nospec``) first, then a (``tlt``) over b's steps; each cached as soon as it ends."""
        path = parts / run_file(args, name, seed)
        if path.is_file():
            log(f"{name}, seed {seed}: cached")
            return
        b = _load(parts / run_file(args, "nospec", seed))
        if name == "tlt" and b is None:
            return  # a runs as many steps as b did: b first
        if not budget.allows(estimate(name), f"{name}, seed {seed}"):
            return
        steps = len(b["steps"]) if name == "tlt" and b is not None else args.steps
        run = run_lightning(name, args, seed, policy_dir, drafter_dir if name == "tlt" else None, steps,
                            budget.left() - 10)  # fmt: skip
        text = json.dumps(run, default=float)
        path.write_text(text)
        if args.out:  # beside the report too: a later run the watchdog ends writes no report
            beside = Path(args.out).parent / "e2e_runs" / path.name
            beside.parent.mkdir(parents=True, exist_ok=True)
            beside.write_text(text)
        recomputed.append(f"{name}, seed {seed}")

    def run_trl_stage() -> None:
        path = stage_dir(args, policy_dir, "trl") / "trl.json"
        if path.is_file():
            log("trl: cached")
            return
        if not budget.allows(args.trl_budget_s + 60, "trl"):
            return
        run = run_trl(args, seeds[0], policy_dir, min(args.trl_budget_s, budget.left() - 10))
        path.write_text(json.dumps(run, default=float))
        recomputed.append("trl")

    if "ab" in args.stages:
        for name in ("nospec", "tlt"):
            run_config(name, seeds[0])
    if "trl" in args.stages:
        run_trl_stage()
    if "ab" in args.stages:
        for seed in seeds[1:]:
            for name in ("nospec", "tlt"):
                run_config(name, seed)

    # ------------------------------------------------------------------ report from everything cached
    runs = paired([r for s in seeds for n in ("tlt", "nospec") if (r := _load(parts / run_file(args, n, s)))])
    trl_run = _load(stage_dir(args, policy_dir, "trl") / "trl.json")
    summary: dict[str, Any] = {}
    for name in ("tlt", "nospec"):
        mine = [r for r in runs if r["name"] == name]
        if mine:
            summary[name] = summarize(mine, args.skip)
    if trl_run is not None:
        summary["trl"] = summarize_trl([trl_run])
    results: dict[str, Any] = {
        "benchmark": "e2e",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "card": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "versions": {
            "torch": torch.__version__,
            "lightning": pl.__version__,
            "python": platform.python_version(),
        },
        "args": {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()},
        "workload": workload_key(args),
        "warm_start": warm,
        "recomputed_this_call": recomputed,
        "carried": {"from": Path(args.carry).name, "units": carried} if args.carry else None,
        "summary": summary,
        "ratios": ratios(summary),
        "no_accuracy_loss": no_accuracy_loss(
            [r for r in runs if r["name"] == "tlt"], [r for r in runs if r["name"] == "nospec"]
        ),
        "runs": runs,
        "trl_runs": [trl_run] if trl_run else [],
    }
    for module in ("transformers", "trl"):
        try:
            results["versions"][module] = __import__(module).__version__
        except ImportError:
            pass
    log(f"recomputed this call: {', '.join(recomputed) or 'nothing (all cached)'}")
    if summary:
        print_table(results)
    if args.plots and runs:
        results["plots"] = plot(results, runs, Path(args.plots))
    write_results(results, "e2e", smoke=args.smoke, cuda=cuda, out=args.out)
    return results


if __name__ == "__main__":
    main()
