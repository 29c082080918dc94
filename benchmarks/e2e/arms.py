"""Running an arm: a (``tlt``) and b (``nospec``) with the kit under a Lightning ``Trainer``, timed step by
step (`StepRecorder`), and c (``trl``) with TRL's ``GRPOTrainer``; each run a unit with its provenance."""

from __future__ import annotations

import collections
import datetime as dt
import faulthandler
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from lightning_tlt.core import stored_compile
from lightning_tlt.core.stored_compile import stats_by_function
from lightning_tlt.core.types import SpeculativeConfig, StepEvent
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.rl.warmstart import warm_start_metadata
from lightning_tlt.rollout.cuda_graphs import compile_seconds
from lightning_tlt.tasks import get_task

from .options import ROOT, E2EOptions
from .workload import (
    TRL_GENERATION,
    UNIT_START,
    free,
    grpo_settings,
    load_policy,
    log,
    percentiles,
    stage_dir,
    sync,
)


def device_name() -> str:
    """The card (``torch.cuda.get_device_name``), or the CPU's name."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def code_commit(given: str | None) -> str:
    """``given``, else the checkout's ``git rev-parse HEAD`` (``-dirty`` when tracked files differ from it),
    else "unknown" (a copy of the tree without its git folder)."""
    if given:
        return given

    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *argv], capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "HEAD").strip()
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(commit: str | None, policy_dir: Path) -> dict[str, Any]:
    """A measured unit's provenance: the code's commit, the date it ended, the device it ran on, and the
    warm start it began from (its cache name and final SFT loss: units of one warm start share both)."""
    meta = warm_start_metadata(policy_dir)
    return {"commit": code_commit(commit), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name(), "measured": True,
            "warm_start": {"policy": policy_dir.name, "final_loss": meta["final_loss"]}}


def _new_versions(now: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """The versions compiled ahead of time since ``before`` (`stats_by_function` taken twice), by function:
    ``{name: {"compiled": versions, "compile_s": seconds}}``, functions that compiled nothing left out."""
    out = {}
    for name, f in now.items():
        was = before.get(name, {})
        n, s = f.get("compiled", 0) - was.get("compiled", 0), f.get("compile_s", 0.0) - was.get("compile_s", 0.0)
        if n or s > 0:
            out[name] = {"compiled": float(n), "compile_s": float(s)}
    return out


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
        self._check_s = 0.0  # seconds of the finite check after the update (the marker's), part of boundary_s
        self._graphs_seen = (0.0, 0.0)  # the engine's (captures, capture s) at the last step's end
        self._recent: collections.deque[StepEvent] = collections.deque(maxlen=8)  # for the watchdog's report
        self._timer: threading.Timer | None = None
        self.trainer: pl.Trainer | None = None
        self._compiled_seen = compile_seconds()  # Dynamo's seconds in this process at the last step's end
        self._by_function_seen = stats_by_function()  # versions compiled ahead of time, by function, likewise

    def _on_event(self, event: StepEvent) -> None:
        self._recent.append(event)
        if event.phase == "done":
            return
        if event.active_rows <= self.tail_rows:
            self._tail_s += event.step_time_s
        else:
            self._bulk_s += event.step_time_s

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trainer = trainer
        sync()
        self._start = self._last_end = time.perf_counter()
        self._compiled_seen = compile_seconds()
        self._by_function_seen = stats_by_function()

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._engine_hooked:  # the engine exists once the first batch was generated
            trainer.datamodule.add_listener(self._on_event)  # type: ignore[attr-defined]
            self._engine_hooked = True
        sync()
        self._nonfinite_before_update = nonfinite_parameters(pl_module)  # after the rollout, before the update
        self._train_start = time.perf_counter()  # (the check's read-back waited for the device)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sync()
        now = time.perf_counter()
        train_end = self._train_end or now
        m = dict(batch.metrics)
        lengths = batch.completion_mask.sum(1).tolist()
        cotrain = cotrain_callbacks(trainer)
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
        # where boundary_s went: the update's finite check (after train_end), then the drafter callback's parts
        r["boundary_parts"] = {"nonfinite_check": self._check_s,
                               **(dict(getattr(cotrain[0], "last_boundary", {})) if cotrain else {})}
        # graphs captured in this step (a one-time cost: the first time a batch bucket or k is met)
        graphs = getattr(trainer.datamodule.engine, "graph_stats", None) or {}  # type: ignore[attr-defined]
        seen = (float(graphs.get("captures", 0.0)), float(graphs.get("capture_time_s", 0.0)))
        r["graph_captures"], r["capture_s"] = (now_ - was for now_, was in zip(seen, self._graphs_seen))
        self._graphs_seen = seen
        # every second Dynamo compiled in this step, in a capture or not (the staged drafter compiles ahead
        # outside any capture: the graph cache's own counter missed 56 s of a's step 0 on the H200)
        compiled = compile_seconds()
        r["compile_s"], self._compiled_seen = max(0.0, compiled - self._compiled_seen), compiled
        # which step functions compiled a version in this step, and for how long: a step after the first
        # that compiles names the shape a first step did not meet
        by_function = stats_by_function()
        r["compiled_by_function"] = _new_versions(by_function, self._by_function_seen)
        self._by_function_seen = by_function
        self.steps.append(r)
        acc = f" accept {r['accept_len']:.2f}" if r["accept_len"] == r["accept_len"] else ""
        lp = percentiles([float(n) for n in lengths])
        log(
            f"{self.name} step {r['step']}: {r['wall_s']:.2f} s (rollout {r['rollout_s']:.2f}, tail {r['tail_s']:.2f}, "
            f"reward {r['reward_s']:.3f}, train {r['train_s']:.2f}, drafter {r['drafter_s']:.2f}) | len p50 "
            f"{lp['p50']:.0f} max {lp['max']:.0f} | correct {r['correctness']:.3f} | spec "
            f"{100 * r['spec_fraction']:.0f}%{acc}" + (" eagle" if r["eagle_drafting"] == 1.0 else "")
            + f" | grad norm {r['grad_norm']:.3g}"
            + (f" | {r['graph_captures']:.0f} graphs captured ({r['capture_s']:.1f} s, compiling {r['compile_s']:.1f} s)"
               if r["graph_captures"] else "")
            + "".join(f" | compiled {name} x{f['compiled']:.0f} in {f['compile_s']:.1f} s"
                      for name, f in r["compiled_by_function"].items())
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
        self.disarm_watchdog()
        if bounds:
            self._timer = threading.Timer(min(bounds), self._hung)
            self._timer.daemon = True
            self._timer.start()
            # the backstop, from a C thread: it fires even where the hung call holds the GIL
            faulthandler.dump_traceback_later(min(bounds) + 30.0, exit=True)

    def disarm_watchdog(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        faulthandler.cancel_dump_traceback_later()

    def _hung(self) -> None:
        """The watchdog fired: say which side is stuck (the device's main stream, the drafter's side stream,
        or neither: the host), the engine's last steps, then every thread's stack; end the process."""
        lines = [f"{self.name}: WATCHDOG after {len(self.steps)} finished steps; the engine's last step events:"]
        lines += [f"  {e.phase} rows {e.active_rows} queued {e.queued_rows} k {e.draft_tokens} "
                  f"captured {e.captured} {e.step_time_s * 1e3:.1f} ms" for e in self._recent]
        try:  # queries never wait for the device
            lines.append(f"  main stream idle: {torch.cuda.default_stream().query()}" if torch.cuda.is_available()
                         else "  (CPU)")
            cotrain = cotrain_callbacks(self.trainer) if self.trainer is not None else []
            learner = cotrain[0].learner if cotrain else None
            if learner is not None:
                lines.append(f"  drafter steps in flight on the side stream: {learner.in_flight()} "
                             f"{learner.in_flight_states()} (handed over so far: {learner.steps_enqueued}); "
                             f"last pacing: {list(cotrain[0].step_log[-4:])}")
        except Exception as err:  # the report must not hide the stacks below
            lines.append(f"  (state unreadable: {err!r})")
        lines += gpu_activity()
        log("\n".join(lines))
        faulthandler.dump_traceback(all_threads=True)
        sys.stderr.flush()
        os._exit(3)


def gpu_activity(samples: int = 3) -> list[str]:
    """``nvidia-smi``'s utilization, power and SM clock, ``samples`` times a second apart: at a stall, a kernel
    that never ends keeps the GPU busy (near 100 %), a wait nothing will end leaves it idle (0 %)."""
    query = ["nvidia-smi", "--query-gpu=utilization.gpu,power.draw,clocks.sm", "--format=csv,noheader"]
    lines = []
    for i in range(samples):
        try:
            done = subprocess.run(query, capture_output=True, text=True, timeout=5)
            lines.append(f"  nvidia-smi (utilization, power, SM clock): {done.stdout.strip() or done.stderr.strip()}")
        except (OSError, subprocess.SubprocessError) as err:  # no driver tool (the CPU): say so, go on
            return [f"  nvidia-smi unavailable: {err!r}"]
        if i + 1 < samples:
            time.sleep(1.0)
    return lines


def cotrain_callbacks(trainer: pl.Trainer) -> list[Any]:
    """The run's `DrafterCoTrainCallback` (a list: none in b), found by name: a and b share this recorder."""
    return [c for c in trainer.callbacks if type(c).__name__ == "DrafterCoTrainCallback"]  # type: ignore[attr-defined]


class _TrainEndMarker(Callback):
    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        sync()
        self.recorder._train_end = start = time.perf_counter()
        # after the RL update, before any other callback's boundary work (the drafter's)
        self.recorder._nonfinite_after_update = nonfinite_parameters(pl_module)
        self.recorder._check_s = time.perf_counter() - start  # in boundary_s (a device read: it waits for the GPU)


def nonfinite_parameters(pl_module: pl.LightningModule, most: int = 5) -> list[str]:
    """The names of (at most ``most``) policy weights that are not finite: one reduction per tensor, one sync."""
    named = list(pl_module.policy.named_parameters())  # type: ignore[union-attr]
    flags = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
    return [name for (name, _), ok in zip(named, flags) if not ok][:most]


def run_lightning(
    name: str,
    args: E2EOptions,
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
    # every run traces its own step functions and loads the stored versions of them, as a restarted process
    # would: a and b alike, whichever ran first in this process (Inductor's on-disk caches and the store stay: a
    # restart on the same machine). Versions held from an earlier run gave b's first step after the warm start,
    # in the same process, its 8 plain graphs in 0.2 s, where a fresh process took 1.6 s (H100, 2026-12-08)
    torch._dynamo.reset()
    stored_compile.reset()
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
    speculative = SpeculativeConfig(method="suffix", threshold=args.threshold, verification=args.verification,
                                    deterministic=args.deterministic) if name == "tlt" else None
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
                deterministic=args.deterministic,
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
        recorder.disarm_watchdog()
    total = time.perf_counter() - t0
    graphs = getattr(data.engine, "graph_stats", None)
    job = getattr(data.engine, "background_compile_job", None)
    learners = [c.learner for c in callbacks if getattr(c, "learner", None) is not None]
    run = {
        "name": name,
        "seed": seed,
        "total_s": total,
        "steps": recorder.steps,
        "graph_stats": dict(graphs) if isinstance(graphs, dict) else None,
        # the child that compiled speculation, if one started (a cold store): its phases and compile seconds
        "background_compile": None if job is None else job.report(),
        # the SMs the drafter's side stream ran on (--side-stream-sms resolved; None: every SM, or no side stream)
        "side_stream_sms": learners[0].side_stream_sms if learners else None,
        "error": error,
        # traced afresh, its versions loaded from the store (see above); units of format 3 were "dynamo_reset" (the
        # versions an earlier run loaded stayed held), and earlier units shared traces too
        "start": UNIT_START,
        "provenance": provenance(args.commit, policy_dir),
    }
    del trainer, module, data, policy, callbacks, recorder
    free()
    return run


# ---------------------------------------------------------------------------------------------- TRL


def run_trl(args: E2EOptions, seed: int, policy_dir: Path, budget_s: float) -> dict[str, Any]:
    """Configuration c: TRL's GRPOTrainer with its default HF ``generate`` (no vLLM), from the same warm
    start, in bf16 on the GPU; ``--trl-steps`` steps, fewer only where the next one would not fit in
    ``budget_s`` (the report then has no steady TRL figure, never the first step in its place)."""
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
            sync()
            self.t = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, control: Any, **k: Any) -> None:
            sync()
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
        # the weights in bf16 on the GPU, so that TRL's HF `generate` (no autocast around it) samples in
        # bf16 as a and b roll out from their bf16 copy; its update then runs in bf16 too (no float32
        # master weights: if anything, cheaper than a and b's)
        model_init_kwargs={"dtype": TRL_GENERATION} if cuda else None,
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
        "generation_dtype": TRL_GENERATION if cuda else "float32",
        "provenance": provenance(args.commit, policy_dir),
    }
    del trainer
    free()
    return run
