"""The settings of `lightning_tlt.callbacks.drafter_cotrain.DrafterCoTrainCallback` (importable from there too)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_tlt.drafters.trainer import DrafterTrainConfig

WarmStart = Literal["none", "rollouts", "sft"]
STATE_FORMAT = 3
"""The checkpointed state's format (`DrafterCoTrainCallback.state_dict`); another is refused on load."""


@dataclass
class DrafterCoTrainConfig(DrafterTrainConfig):
    """Settings of `DrafterCoTrainCallback`: the train step's (`DrafterTrainConfig`) and these."""

    stall_threshold: int = 8
    """A decode step with at most this many active rows is a stall (the long tail)."""
    max_steps_per_event: int = 4
    """Most drafter steps queued at one stall event."""
    max_decode_slowdown: float | None = 0.05
    """Cap on the measured slowdown of stall decode steps by the drafter work beside them (0.05:
    5 %); the steps per event adapt online (`lightning_tlt.drafters.pacing.StallPacer`). ``None``:
    ``max_steps_per_event`` at every stall event, unmeasured (deterministic)."""
    deterministic: bool = False
    """Pace from counted stall events, never from the clock: each stall event earns
    ``max_decode_slowdown / drafter_step_cost`` drafter steps (as credit, at most
    ``max_steps_per_event``), the steps are handed over even if the side stream's queue is full (the
    host waits), and nothing is trained while waiting for other ranks (how long that is, is timing).
    Two runs with the same seed then make the same drafter steps: bit-identical checkpoints on the CPU.
    The default of the CPU configs."""
    drafter_step_cost: float = 0.25
    """Deterministic mode: the slowdown one drafter step is assumed to add to the stall step beside it
    (0.25: a quarter of that step), instead of measuring it."""
    train_while_waiting: bool = True
    """Under DDP, train after this rank's generation is done while other ranks still generate."""
    wait_max_steps: int = 200
    """Most drafter steps while waiting for the other ranks (TLT: 200)."""
    wait_budget_s: float = 30.0
    """Most host time spent queueing drafter steps while waiting for the other ranks."""
    buffer_tokens: int = 65536
    """Replay buffer size in tokens (features in the policy's dtype, saved in checkpoints)."""
    heldout_fraction: float = 0.1
    """Share of harvested sequences never trained on, to measure acceptance."""
    publish_every_n_steps: int = 1
    """Publish to the engine every this many RL steps, when the weights changed (TLT's docs advise about 10)."""
    eval_every_n_steps: int = 10
    """Held-out acceptance at the first RL step and every this many (queued on the side stream, read
    one step later)."""
    eval_draft_tokens: int = 4
    """k of the logged expected acceptance length ``(1 - α^(k+1)) / (1 - α)``."""
    eval_max_sequences: int = 32
    """Newest held-out sequences used per evaluation."""
    handoff_margin: float | None = 0.0
    """While the engine speculates with a model-free drafter (``SpeculativeConfig(method="suffix")``,
    TLT's cold start), the EAGLE drafter replaces it only once its held-out expected acceptance
    length beats the engine's measured one by this margin (tokens per verify step); ``None``
    publishes it from the first step regardless."""
    publish_if_improves: bool = False
    """Publish only when the latest held-out acceptance rate beats the published drafter's."""
    warm_start: WarmStart = "none"
    """Train before the EAGLE drafter speculates: "sft" on a task's worked solutions at fit start,
    "rollouts" on the first RL step's rollouts at its boundary, "none" not at all."""
    warm_start_steps: int = 200
    """Drafter steps of the warm start."""
    warm_start_task: str | None = None
    """The zoo task whose worked solutions the "sft" warm start reads (its difficulty is the
    datamodule's, its tokenizer the datamodule's)."""
    warm_start_sequences: int = 256
    """Worked solutions the "sft" warm start reads."""
    freeze_after_warm_start: bool = False
    """The frozen-drafter control of a co-training run: the drafter trains in its warm start only (none with
    ``warm_start="none"``), is published once (by the usual rules: at once, or at the hand-over from a
    model-free drafter) and then speculates unchanged: no training in the stalls or while waiting for other
    ranks, no later publication. Harvest and held-out evaluations go on (``drafter/heldout_*``: how the
    frozen drafter fares as the policy moves away from it)."""
    average_across_ranks: bool = True
    """Average the drafter weights across ranks at each RL step boundary (DDP)."""
    feature_layers: tuple[int, int, int] | None = None
    """EAGLE-3 features (three HF ``hidden_states`` indices); ``None``: EAGLE-1 (last hidden state).
    Co-training needs ``None`` for now: the training step harvests the last hidden state only."""
    seed: int = 0
    """Seeds the drafter's init and the buffer's generator."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("stall_threshold", "publish_every_n_steps", "eval_every_n_steps", "eval_max_sequences",
                     "eval_draft_tokens", "warm_start_sequences"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("max_steps_per_event", "wait_max_steps", "warm_start_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not self.drafter_step_cost > 0:
            raise ValueError(f"drafter_step_cost must be > 0, got {self.drafter_step_cost!r}")
        if not self.wait_budget_s >= 0:
            raise ValueError(f"wait_budget_s must be >= 0, got {self.wait_budget_s!r}")
        if self.max_decode_slowdown is not None and not 0.0 < self.max_decode_slowdown <= 1.0:
            raise ValueError(f"max_decode_slowdown must be in (0, 1] or None, got {self.max_decode_slowdown!r}")
        if self.buffer_tokens < self.max_len + 1:
            raise ValueError(f"buffer_tokens must be >= max_len + 1 = {self.max_len + 1}, got {self.buffer_tokens!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")
        if self.warm_start not in ("none", "rollouts", "sft"):
            raise ValueError(f"warm_start must be 'none', 'rollouts' or 'sft', got {self.warm_start!r}")
        if self.warm_start == "sft" and self.warm_start_task is None:
            raise ValueError("warm_start='sft' needs warm_start_task, a zoo task name (e.g. 'countdown')")
        if self.feature_layers is not None:
            layers = tuple(self.feature_layers)
            self.feature_layers = layers  # type: ignore[assignment]
            if len(layers) != 3:
                raise ValueError(
                    f"feature_layers must be three hidden_states indices or None, got {self.feature_layers!r}"
                )
