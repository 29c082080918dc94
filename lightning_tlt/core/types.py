"""Value types shared by the rollout engines, the drafters and the RL modules.

These are the contracts between the parts of the kit: `SamplingConfig` (what to sample),
`RolloutOutput` (what came out, in the shape TRL's ``rollout_func`` returns) and `StepEvent`
(what the engine tells its listeners after every step).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

__all__ = [
    "DTYPES",
    "mixed_precision_dtype",
    "Phase",
    "FinishReason",
    "SamplingConfig",
    "RolloutOutput",
    "StepEvent",
    "StepListener",
    "RolloutBackend",
    "DrafterHost",
    "SpecMethod",
    "Verification",
    "SpeculativeConfig",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""The parameter dtypes configurations name (a policy's ``dtype``, an engine's ``dtype``)."""


def mixed_precision_dtype(precision: object) -> torch.dtype | None:
    """The dtype a Lightning mixed ``precision`` computes in (``"bf16-mixed"``: bfloat16,
    ``"16-mixed"``: float16) over float32 master weights; ``None`` for any other precision."""
    return {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(str(precision))

Phase = Literal["prefill", "decode", "speculative", "done"]
FinishReason = Literal["stop", "length"]


@dataclass
class SamplingConfig:
    """How completions are sampled. Names and defaults follow TRL's ``GRPOConfig``."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy (argmax)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches ``top_p``; in (0, 1]."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens; 0 disables the filter."""
    max_new_tokens: int = 512
    """Most tokens generated per completion (TRL's ``max_completion_length``)."""
    stop_token_ids: list[int] | None = None
    """Tokens that end a completion (kept in it); ``None`` means the model's eos token(s)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if self.stop_token_ids is not None and any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class RolloutOutput:
    """Completions of one ``generate`` call, grouped by prompt.

    For ``P`` prompts and ``num_samples = G`` every list has ``P * G`` entries: the G samples of
    prompt 0, then the G samples of prompt 1, and so on (TRL's order for ``num_generations``).
    """

    prompt_ids: list[list[int]]
    """The prompt of each completion (repeated G times)."""
    completion_ids: list[list[int]]
    """Generated tokens, the stop token included when one fired."""
    logprobs: list[list[float]]
    """Per generated token, its log-probability under the distribution it was sampled from
    (after temperature, top-k and top-p), as TRL's ``rollout_func`` expects."""
    finish_reasons: list[FinishReason]
    """"stop" when a stop token ended the completion, "length" when ``max_new_tokens`` did."""
    stats: dict[str, float] = field(default_factory=dict)
    """Counters and timings: tokens, steps, wall time, time per phase, tokens/s, speculation figures."""

    def __len__(self) -> int:
        return len(self.completion_ids)


@dataclass(frozen=True)
class StepEvent:
    """What the engine tells its listeners after each step (the hook of the gate and of co-training)."""

    step: int
    """Steps taken so far in this ``generate`` call (prefills included)."""
    phase: Phase
    """What the step did; "done" is sent once when the call has finished all its requests."""
    active_rows: int
    """Rows still decoding after the step."""
    queued_rows: int
    """Requests waiting for a free slot."""
    num_slots: int
    """Slots the engine has (its largest batch)."""
    step_time_s: float
    """Host wall time of the step (timed without a device sync where possible: an upper bound then)."""
    new_tokens: int = 0
    """Tokens this step appended over all rows."""
    captured: bool = False
    """The step's time includes capturing a CUDA graph (and compiling): not the step's own cost."""
    draft_tokens: int = 0
    """Tokens drafted per row (``k``) of a speculative step; 0 for any other step. A step's cost
    depends on it as much as on the rows: what compares step times keys on both."""


StepListener = Callable[[StepEvent], None]


@runtime_checkable
class RolloutBackend(Protocol):
    """What the RL side needs of an engine: `RolloutEngine` (native) and ``VLLMRolloutEngine`` both are one."""

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig | None = None,
        num_samples: int = 1,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput: ...

    @property
    def device(self) -> torch.device: ...

    def add_listener(self, fn: StepListener) -> None: ...

    def remove_listener(self, fn: StepListener) -> None: ...

    def adaptive_state_dict(self) -> dict[str, Any]: ...

    def load_adaptive_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class DrafterHost(Protocol):
    """What a drafter's trainer may ask of a rollout backend that drafts (the co-training callback's
    contract): `RolloutEngine` (native) and ``VLLMRolloutEngine`` both are one.

    ``drafter`` is what speculation drafts with now, ``drafter_version`` the version last published.
    ``set_drafter`` publishes a drafter's weights (a training drafter is copied, never held; a drafter
    whose weights are not all finite is refused and ``False`` returned); ``stage_drafter`` gets ready
    for one that will be published later (a backend with nothing to prepare does nothing). The
    listeners receive every decode step's `StepEvent`; ``last_stats`` are the figures of the last
    ``generate``; ``draft_vocab_ids()`` the draft vocabulary a drafter's head is restricted to, or ``None``.
    """

    @property
    def drafter(self) -> Any: ...

    @property
    def drafter_version(self) -> int: ...

    @property
    def last_stats(self) -> dict[str, float]: ...

    def draft_vocab_ids(self) -> torch.Tensor | None: ...

    def set_drafter(self, drafter: Any, version: int | None = None) -> bool: ...

    def stage_drafter(self, drafter: Any) -> None: ...

    def add_listener(self, fn: StepListener) -> None: ...

    def remove_listener(self, fn: StepListener) -> None: ...


SpecMethod = Literal["eagle", "suffix", "none"]
Verification = Literal["rejection", "coupled"]


@dataclass
class SpeculativeConfig:
    """When and how the engine speculates (TLT's adaptive speculative decoding).

    Speculation only ever changes speed: verification by rejection sampling keeps every sampled
    distribution exactly the policy's.
    """

    method: SpecMethod = "none"
    """"eagle" (learned drafter over the policy's hidden states), "suffix" (model-free matching over
    the prompt and sibling rollouts) or "none"."""
    num_draft_tokens: int | None = None
    """A fixed number k of drafted tokens per row; ``None`` lets the tuner choose per batch bucket."""
    draft_candidates: tuple[int, ...] = (2, 4, 6, 8)
    """The k values the tuner chooses among."""
    threshold: int = 32
    """Speculate only while at most this many rows are active (TLT's default: 32)."""
    hysteresis_steps: int = 10
    """Consecutive steps on the other side of ``threshold`` before the gate switches (TLT: 10)."""
    tuner_epsilon: float = 0.1
    """Exploration rate of the epsilon-greedy draft-length tuner; 0 keeps the static table."""
    plain_arm: bool = True
    """The tuner's arms include k = 0 (a plain decode step) in every batch bucket, scored on the same
    measured tokens/s: speculation that does not pay switches itself off."""
    tuner_min_samples: int = 2
    """Steps of each arm per batch bucket before the tuner exploits what it measured."""
    tuner_prune_margin: float | None = 0.05
    """A longer draft is not explored while a shorter one's measured acceptance bounds it below this
    fraction under the bucket's best arm (`DraftLengthTuner`); ``None`` explores every draft length."""
    draft_vocab_size: int | None = 32768
    """Rows of the EAGLE drafter's head: the most frequent tokens of the policy's own rollouts (the
    first ids before any are counted); ``None``: the whole vocabulary. Verification stays exact."""
    drafter_path: str | None = None
    """Directory of an exported EAGLE drafter (``EagleDrafter.save_pretrained``) to load; ``None``
    starts a cold drafter from the policy (``EagleDrafter.from_target``)."""
    verification: Verification = "rejection"
    """How drafts are verified, both lossless: "rejection" (speculative rejection sampling, Leviathan
    et al. 2023) or "coupled" (`lightning_tlt.rollout.verify.verify_coupled`: a draft is accepted iff
    it is the token plain decoding draws with the row's keyed noise, so speculation on or off gives
    the same tokens for the same seed; an EAGLE drafter races with that same noise)."""
    deterministic: bool = False
    """The tuner scores draft lengths on a fixed cost model (a step drafting k tokens a row costs
    ``1 + tuner_draft_cost * k`` plain steps) and the tokens it counted, never on measured time, and
    reads those counts at fixed points (on CUDA: one step late, waiting if needed): its choices, hence
    the rollouts, repeat exactly for the same seed. The default of the CPU configs; on a GPU it trades
    the measured choice of k for reproducibility."""
    tuner_draft_cost: float = 0.1
    """Deterministic mode: the cost of drafting and verifying one more token a row, in plain decode
    steps."""

    def __post_init__(self) -> None:
        if self.method not in ("eagle", "suffix", "none"):
            raise ValueError(f"method must be 'eagle', 'suffix' or 'none', got {self.method!r}")
        if not self.tuner_draft_cost >= 0:
            raise ValueError(f"tuner_draft_cost must be >= 0, got {self.tuner_draft_cost!r}")
        if self.verification not in ("rejection", "coupled"):
            raise ValueError(f"verification must be 'rejection' or 'coupled', got {self.verification!r}")
        if self.num_draft_tokens is not None and not 1 <= self.num_draft_tokens <= 16:
            raise ValueError(f"num_draft_tokens must be in [1, 16] or None, got {self.num_draft_tokens!r}")
        if not self.draft_candidates or any(not 1 <= k <= 16 for k in self.draft_candidates):
            raise ValueError(f"draft_candidates must be non-empty, each in [1, 16], got {self.draft_candidates!r}")
        self.draft_candidates = tuple(sorted(set(self.draft_candidates)))
        if self.threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {self.threshold!r}")
        if self.hysteresis_steps < 1:
            raise ValueError(f"hysteresis_steps must be >= 1, got {self.hysteresis_steps!r}")
        if not 0.0 <= self.tuner_epsilon <= 1.0:
            raise ValueError(f"tuner_epsilon must be in [0, 1], got {self.tuner_epsilon!r}")
        if self.tuner_min_samples < 0:
            raise ValueError(f"tuner_min_samples must be >= 0, got {self.tuner_min_samples!r}")
        if self.tuner_prune_margin is not None and not 0.0 <= self.tuner_prune_margin < 1.0:
            raise ValueError(f"tuner_prune_margin must be in [0, 1) or None, got {self.tuner_prune_margin!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1 or None, got {self.draft_vocab_size!r}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"
