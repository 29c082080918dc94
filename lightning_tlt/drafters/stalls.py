"""`StallScheduler`: which of the engine's step events queue drafter steps, and how many.

The co-trained drafter (`lightning_tlt.callbacks.drafter_cotrain.DrafterCoTrainCallback`) trains in
the rollout's stalls, the time in which the GPU is nearly idle because only the long tail still
decodes. After a decode or speculative step with at most ``stall_threshold`` active rows, the
`StallPacer` says how many drafter steps to queue, so that the measured decode slowdown stays under
its cap, and the `DrafterTrainer` hands them to the device: on CUDA a captured step replayed on a side
stream (the decode loop never waits for it), on the CPU the same step run at once. Under DDP a rank
whose generation is done trains while the other ranks still generate (`train_while_waiting`).

Between two RL step boundaries the scheduler counts what it saw (`StallWindow`, read and reset by
`take_metrics`) and keeps a log of every event that queued steps (`step_log`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from lightning_tlt.core.types import StepEvent
from lightning_tlt.drafters.pacing import StallPacer
from lightning_tlt.drafters.trainer import DrafterTrainer


@dataclass
class StallWindow:
    """Figures accumulated between two RL step boundaries (then logged and reset by `StallScheduler.take_metrics`)."""

    stall_events: int = 0
    stall_time_s: float = 0.0
    wait_steps: int = 0


class StallScheduler:
    """Queues paced drafter steps at stall events (see the module docstring).

    Args:
        stall_threshold: a decode or speculative step with at most this many active rows is a stall.
        pacer: how many drafter steps each stall event queues.
        deterministic: hand the steps over even when the side stream's queue is full (the host waits),
            so that the same stall events give the same drafter steps in every run.
        wait_max_steps: most drafter steps while waiting for the other ranks (`train_while_waiting`).
        wait_budget_s: most host time spent queueing drafter steps while waiting for the other ranks.
        frozen: the frozen-drafter control (``freeze_after_warm_start``): stalls are counted and logged,
            never used.
    """

    def __init__(
        self,
        stall_threshold: int,
        pacer: StallPacer,
        *,
        deterministic: bool = False,
        wait_max_steps: int = 200,
        wait_budget_s: float = 30.0,
        frozen: bool = False,
    ) -> None:
        self.stall_threshold = stall_threshold
        self.pacer = pacer
        self.deterministic = deterministic
        self.wait_max_steps = wait_max_steps
        self.wait_budget_s = wait_budget_s
        self.frozen = frozen
        self.window = StallWindow()
        """What this RL step's events held so far."""
        self.step_log: list[tuple[str, int, int]] = []
        """``(reason, active_rows, steps)`` of every event that queued drafter steps (reason "stall" or "wait")."""

    def on_step(self, event: StepEvent, learner: DrafterTrainer) -> int:
        """Queue the drafter steps a decode or speculative step's event earns (none outside the stalls);
        returns how many the learner took."""
        if event.phase not in ("decode", "speculative") or not 0 < event.active_rows <= self.stall_threshold:
            self.pacer.skip(learner.in_flight())
            return 0
        self.window.stall_events += 1
        self.window.stall_time_s += event.step_time_s
        if self.frozen:  # the frozen control: the stalls are seen (logged), never used
            return 0
        n = self.pacer.plan(event.phase, event.active_rows, event.step_time_s, learner.in_flight(), event.captured,
                            event.draft_tokens)
        if not n:
            return 0
        queued = learner.enqueue(n, block=self.deterministic)
        self.pacer.queued(queued, learner.in_flight())
        if queued:
            self.step_log.append(("stall", event.active_rows, queued))
        return queued

    def train_while_waiting(self, learner: DrafterTrainer) -> int:
        """Queue drafter steps until every rank has finished generating (or the wait's budget is spent);
        returns how many.

        The one collective of co-training outside Lightning's ``trainer.strategy``: the strategy's
        collectives (``reduce``, ``barrier``) block, and this rank must keep training while the others
        generate, so it polls an asynchronous all-reduce (``async_op=True``) that completes once all ranks
        have entered it. Every rank calls it once its generation is done.
        """
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        flag = torch.ones(1, device=device)
        work = dist.all_reduce(flag, async_op=True)  # completes once every rank has finished generating
        start = time.perf_counter()
        steps = 0
        while steps < self.wait_max_steps and time.perf_counter() - start < self.wait_budget_s:
            if work.is_completed():
                break
            queued = learner.enqueue(1)
            if not queued:  # the side stream is full: let it drain
                time.sleep(0.0005)
            steps += queued
        work.wait()
        self.window.wait_steps += steps
        if steps:
            self.step_log.append(("wait", 0, steps))
        return steps

    def take_metrics(self) -> dict[str, float]:
        """The figures of the stalls since the last call (``drafter/...`` names, as logged), then a new window."""
        w, paced = self.window, self.pacer.take_window()
        self.window = StallWindow()
        pacer = self.pacer
        return {
            "drafter/stall_events": float(w.stall_events),
            "drafter/stall_time_available_s": w.stall_time_s,
            # over this RL step's measured stall steps, as measured (the controller caps outliers)
            "drafter/decode_slowdown": paced["slowdown"],
            "drafter/loaded_stall_share": paced["loaded_share"],
            "drafter/loaded_step_slowdown": paced["loaded_slowdown"],
            "drafter/steps_per_event": pacer.rate if pacer.max_slowdown is not None else float(pacer.max_per_event),
            "drafter/wait_steps": float(w.wait_steps),
        }
