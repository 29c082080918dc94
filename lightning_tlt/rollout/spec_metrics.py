"""Speculation figures as torchmetrics ``Metric``s (updated on device, read once per ``generate``).

The engine updates these with device tensors inside the decode loop (no host sync: updates are
tensor additions) and reads them with `SpeculationMetrics.stats` when the call ends, to fill
`lightning_tlt.core.types.RolloutOutput.stats`. Being torchmetrics states, they also reduce
across ranks (``sum``) when computed under DDP.

Definitions (EAGLE, Li et al. 2024, "acceptance length" tau and "n-alpha"):

- acceptance length: tokens a row emits per verify step, accepted drafts + 1 (the correction or
  bonus token); 1.0 means no draft was ever accepted;
- acceptance rate at draft position j: P(draft j accepted | drafts 0..j-1 accepted and a draft
  existed at j);
- speculative share: speculative decode steps / all decode steps;
- tokens/s by phase: tokens emitted / seconds spent, per phase ("prefill", "decode",
  "speculative").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

PHASES: tuple[str, ...] = ("prefill", "decode", "speculative")
"""Phases `TokensPerSecond` keeps (`lightning_tlt.core.types.Phase` without "done")."""


class AcceptanceLength(Metric):
    """Mean tokens emitted per row per verify step (accepted drafts + 1)."""

    full_state_update = False
    higher_is_better = True
    emitted: Tensor
    rows: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("emitted", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("rows", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, num_accepted: Tensor | None = None, *, counts: tuple[Tensor, Tensor] | None = None) -> None:
        """``num_accepted``: ``(B,)`` accepted drafts of each row that took part in one verify step; or
        ``counts``: ``(rows, emitted)`` already summed on the device (the compiled step's counters)."""
        if counts is not None:
            self.rows += counts[0].to(self.rows)
            self.emitted += counts[1].to(self.emitted)
        if num_accepted is not None:
            self.emitted += (num_accepted.double() + 1.0).sum()
            self.rows += num_accepted.numel()

    def compute(self) -> Tensor:
        return self.emitted / self.rows


class AcceptanceRateByPosition(Metric):
    """Acceptance rate at each draft position, conditional on reaching it (NaN where never reached)."""

    full_state_update = False
    higher_is_better = True
    accepted: Tensor
    reached: Tensor

    def __init__(self, max_draft_tokens: int = 16, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if max_draft_tokens < 1:
            raise ValueError(f"max_draft_tokens must be >= 1, got {max_draft_tokens!r}")
        self.max_draft_tokens = max_draft_tokens
        zeros = torch.zeros(max_draft_tokens, dtype=torch.float64)
        self.add_state("accepted", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("reached", default=zeros.clone(), dist_reduce_fx="sum")

    def update(
        self, num_accepted: Tensor | None = None, draft_lens: Tensor | None = None, *,
        counts: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        """``num_accepted``, ``draft_lens``: ``(B,)`` from one verify step (`VerifyResult`, `DraftProposal`);
        or ``counts``: ``(reached, accepted)`` per draft position, already summed on the device."""
        if counts is not None:
            k = min(counts[0].numel(), self.max_draft_tokens)
            self.reached[:k] += counts[0][:k].to(self.reached)
            self.accepted[:k] += counts[1][:k].to(self.accepted)
        if num_accepted is None or draft_lens is None:
            return
        pos = torch.arange(self.max_draft_tokens, device=num_accepted.device).unsqueeze(0)  # (1, K)
        acc, lens = num_accepted.unsqueeze(1), draft_lens.unsqueeze(1)  # (B, 1)
        self.reached += ((acc >= pos) & (lens > pos)).double().sum(0)
        self.accepted += (acc > pos).double().sum(0)

    def compute(self) -> Tensor:
        """``(max_draft_tokens,)`` rates."""
        return self.accepted / self.reached


class SpeculativeShare(Metric):
    """Share of decode steps that speculated."""

    full_state_update = False
    speculative: Tensor
    steps: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("speculative", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("steps", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, speculative: bool, steps: int = 1) -> None:
        """Count ``steps`` decode steps, speculative or plain."""
        if speculative:
            self.speculative += steps
        self.steps += steps

    def compute(self) -> Tensor:
        return self.speculative / self.steps


class TokensPerSecond(Metric):
    """Tokens emitted per second of step time, per phase (`PHASES`)."""

    full_state_update = False
    higher_is_better = True
    tokens: Tensor
    seconds: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        zeros = torch.zeros(len(PHASES), dtype=torch.float64)
        self.add_state("tokens", default=zeros.clone(), dist_reduce_fx="sum")
        self.add_state("seconds", default=zeros.clone(), dist_reduce_fx="sum")

    def update(self, phase: str, tokens: Tensor | int, seconds: float) -> None:
        """Add a step of ``phase`` that emitted ``tokens`` (an int or a device tensor) in ``seconds``."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        i = PHASES.index(phase)
        self.tokens[i] += tokens.sum().double() if isinstance(tokens, Tensor) else float(tokens)
        self.seconds[i] += seconds

    def compute(self) -> dict[str, Tensor]:
        return {phase: self.tokens[i] / self.seconds[i] for i, phase in enumerate(PHASES)}


class SpeculationMetrics:
    """The four metrics together, fed from the engine's loop, flattened for ``RolloutOutput.stats``.

    Per speculative step: ``update_verify(result.num_accepted, proposal.lens)``; per decode step:
    ``update_step(speculative, phase, tokens, seconds)``; at the end: ``stats()`` (one host read).
    """

    def __init__(self, max_draft_tokens: int = 16, device: torch.device | str | None = None) -> None:
        # one engine's rollout on one rank: computed where it ran, never gathered (torchmetrics would all_gather
        # these CPU counters once a process group exists, which NCCL refuses: the one-GPU FSDP run, 2026-12-06)
        local = {"sync_on_compute": False}
        self.acceptance_length = AcceptanceLength(**local)
        self.acceptance_by_position = AcceptanceRateByPosition(max_draft_tokens, **local)
        self.speculative_share = SpeculativeShare(**local)
        self.tokens_per_second = TokensPerSecond(**local)
        if device is not None:
            for metric in self._metrics():
                metric.to(device)

    def _metrics(self) -> tuple[Metric, ...]:
        return (
            self.acceptance_length,
            self.acceptance_by_position,
            self.speculative_share,
            self.tokens_per_second,
        )

    def add_counters(self, counters: Tensor) -> None:
        """Add the engine's speculation counters (`lightning_tlt.rollout.slot_state.SlotState.counters`,
        ``(3, K + 1)``: rows, accepted + 1, tokens; reached and accepted per draft position)."""
        k = counters.shape[1] - 1
        self.acceptance_length.update(counts=(counters[0, 0], counters[0, 1]))
        self.acceptance_by_position.update(counts=(counters[1, :k], counters[2, :k]))

    def update_verify(self, num_accepted: Tensor, draft_lens: Tensor) -> None:
        self.acceptance_length.update(num_accepted)
        self.acceptance_by_position.update(num_accepted, draft_lens)

    def update_step(self, speculative: bool, phase: str, tokens: Tensor | int, seconds: float) -> None:
        if phase != "prefill":
            self.speculative_share.update(speculative)
        self.tokens_per_second.update(phase, tokens, seconds)

    def reset(self) -> None:
        for metric in self._metrics():
            metric.reset()

    def stats(self) -> dict[str, float]:
        """Flat ``name -> value`` figures; metrics with no data are left out (no NaN in stats)."""
        out: dict[str, float] = {}
        if float(self.acceptance_length.rows) > 0:
            out["spec/acceptance_length"] = float(self.acceptance_length.compute())
            rates = self.acceptance_by_position.compute().tolist()
            for j, rate in enumerate(rates):
                if rate == rate:  # not NaN: position reached at least once
                    out[f"spec/acceptance_rate_pos{j}"] = rate
        if float(self.speculative_share.steps) > 0:
            out["spec/speculative_step_share"] = float(self.speculative_share.compute())
        seconds = self.tokens_per_second.seconds.tolist()
        for i, phase in enumerate(PHASES):
            if seconds[i] > 0:
                out[f"tokens_per_s/{phase}"] = float(self.tokens_per_second.tokens[i]) / seconds[i]
        return out
