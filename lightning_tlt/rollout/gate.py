"""When to speculate: only in the long tail, with hysteresis.

Speculation pays when decoding is memory-bound, i.e. when few rows are still running: verifying k
drafts then costs about one plain step (measured on an H200: 8 drafts at batch 1 cost 1.2x a
plain step), while at large batch the verify forward is compute-bound and speculation slows
decoding down (FastGRPO, MagicDec). TLT's adaptive speculation (arXiv 2511.16665): off
while the running batch is larger than 32; on after 10 consecutive decode steps at or below 32.
The hysteresis keeps the engine from flapping between its plain and speculative graph sets (and
from rebuilding the drafter's state each time) when the batch hovers around the threshold.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class AdaptiveGate:
    """Decides, step by step, whether the engine speculates.

    Off at start. Turns on after ``hysteresis_steps`` consecutive steps with ``active_rows <=
    threshold``; turns off after ``hysteresis_steps`` consecutive steps above it, or at once when
    ``active_rows > hard_limit`` (e.g. the largest batch the speculative CUDA graphs were captured
    for). Call `reset` at the start of every ``generate`` call (a new batch starts large).

    Args:
        threshold: speculate only while at most this many rows are active (TLT: 32).
        hysteresis_steps: consecutive steps on the other side of ``threshold`` before switching
            (TLT: 10); 1 switches on the first such step.
        hard_limit: above this many active rows speculation is off immediately; ``None``: no limit.
    """

    def __init__(
        self, threshold: int = 32, hysteresis_steps: int = 10, hard_limit: int | None = None
    ) -> None:
        if threshold < 1:
            raise ValueError(f"threshold must be >= 1, got {threshold!r}")
        if hysteresis_steps < 1:
            raise ValueError(f"hysteresis_steps must be >= 1, got {hysteresis_steps!r}")
        if hard_limit is not None and hard_limit < threshold:
            raise ValueError(f"hard_limit must be >= threshold={threshold} or None, got {hard_limit!r}")
        self.threshold = threshold
        self.hysteresis_steps = hysteresis_steps
        self.hard_limit = hard_limit
        self._on = False
        self._streak = 0  # consecutive steps on the side that would switch the gate
        self._switches = 0

    @property
    def on(self) -> bool:
        """Whether the engine currently speculates."""
        return self._on

    @property
    def switches(self) -> int:
        """How many times the gate changed state since construction (or `load_state_dict`)."""
        return self._switches

    def update(self, active_rows: int) -> bool:
        """Feed the number of rows about to decode; returns whether this step speculates."""
        if active_rows < 0:
            raise ValueError(f"active_rows must be >= 0, got {active_rows!r}")
        if self._on and self.hard_limit is not None and active_rows > self.hard_limit:
            self._set(False)
            return False
        wants_on = active_rows <= self.threshold
        if wants_on == self._on:
            self._streak = 0
        else:
            self._streak += 1
            if self._streak >= self.hysteresis_steps:
                self._set(wants_on)
        return self._on

    def _set(self, on: bool) -> None:
        if on != self._on:
            self._switches += 1
        self._on = on
        self._streak = 0

    def reset(self) -> None:
        """Back to off with no streak (the switch counter is kept)."""
        self._on = False
        self._streak = 0

    def state_dict(self) -> dict[str, Any]:
        return {"on": self._on, "streak": self._streak, "switches": self._switches}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self._on = bool(state_dict["on"])
        self._streak = int(state_dict["streak"])
        self._switches = int(state_dict["switches"])
