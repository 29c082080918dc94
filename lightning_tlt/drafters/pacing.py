"""`StallPacer`: how many drafter steps to queue at each stall event, so decode slows by a bounded share.

The drafter trains on a side stream beside decoding; on a GPU the two contend for the same SMs and
memory bandwidth, so what is bounded is the *effect* on decode, measured: the step time of decode
steps that ran beside drafter work over the step time of comparable decode steps that did not
(same phase, same draft length ``k``, same bucket of active rows: a speculative step of k = 8
costs more than one of k = 2, and the tuner changes k from step to step, so comparing across k would
measure the tuner's choices instead of the drafter). The engine reports each step's host wall time
(`lightning_tlt.core.types.StepEvent.step_time_s`), which with its one-step-lagged host reads
tracks the GPU step time.

Control: a rate of drafter steps per stall event, accumulated as credit (so rates below one queue
a step every few events). Each stall step gives an observation ``s = time / clean_time - 1`` (0 for
a clean step), and the rate moves in log space by ``gain * (cap - s) / cap``: an integral
controller whose fixed point is a mean observed slowdown equal to the cap (a clean step raises the
rate a little, a step slowed by twice the cap lowers it as much). One observation lowers the log
rate by at most ``gain * max_penalty`` (a factor of 0.37 at the defaults): a step that a host pause,
a garbage collection or the drafter's own first capture held up for seconds would otherwise throw
the rate to its floor, where it needs about 170 stall steps to climb back (measured in
simulation; on the H200 the e2e's co-training sat at 0.002 drafter steps per event). An outlier is
judged against what loaded steps usually measure: the limit is ``(1 + max_penalty)`` times the
larger of the cap and the median of the last 16 loaded observations. A lone pause stays an outlier
(the median does not move); drafter work that slows every step beside it by more than
``(1 + max_penalty)`` times the cap counts in full, so the cap holds for it too. With a fixed limit
of 105 % it did not: on the H200 a float32 drafter step slowed the decode steps beside it 6x
(`benchmarks/drafter_step.py`); each such step counted as 105 %, the controller settled at one loaded
stall step in 21, and the mean slowdown was 24 % against a cap of 5 % (in simulation: 5 % now).
The rate never falls below ``min_rate``, but the integral does: what one observation would have taken
the rate below the floor by is owed, and clean steps pay it back before the rate rises again. Without
it the cap did not hold once one loaded step's penalty passed the floor: on the H100 a decode step beside
a drafter step took about 5.5x a clean one (the e2e's ``loaded_step_slowdown``, every step of every seed),
so every loaded observation threw the rate to the floor, whence it climbed back in about 80 clean steps;
at one loaded step a drafter step the mean was 5.7 % against a cap of 5 %, and at two (a drafter step
outlasting two short decode steps: plain decoding in the tail) 11.2 % (the e2e measured 6.3 % and 10.5 %;
in simulation, 5.0 % both with the debt). An outlier on a loaded step (a host pause there) is owed too, up to
its limit of ``(1 + max_penalty)`` times what loaded steps usually measure: about 20 loaded steps' worth of
clean steps before the drafter trains again, where the floor used to forget it.
Clean baselines are refreshed by probing: when a bucket's baseline is missing or old, the pacer
queues nothing until the side stream has drained, and the next step of that bucket is clean.

Deterministic pacing (``step_cost``): no clock is read. Each drafter step is assumed to slow the
stall step beside it by ``step_cost`` (a fraction of that step), so the cap allows
``max_slowdown / step_cost`` drafter steps per stall event (at most ``max_per_event``), queued as
credit exactly as above: the same stall events give the same drafter steps in every run, which is
what makes two same-seed runs bit-identical (`DrafterCoTrainConfig.deterministic`).

What it reports is kept apart from what steers it: `take_window` gives, since its last call, the
mean slowdown of stall steps with every observation as measured (clean steps 0, nothing limited),
the share of stall steps that ran beside drafter work and their median slowdown. The callback used
to log the controller's moving average of limited observations, read at the end of a rollout (the
last few stall steps): 2 % in the run above.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class StallPacer:
    """Drafter steps per stall event, adapted online to a cap on the measured decode slowdown.

    Args:
        max_per_event: most steps queued at one event.
        max_slowdown: cap on the mean relative slowdown of stall steps (0.05: 5 %); ``None`` queues
            ``max_per_event`` at every stall event, unmeasured (deterministic: tests, resume).
        smoothing: weight of the newest observation in the moving averages (clean baselines, the
            reported `slowdown`).
        probe_every: loaded stall steps of a bucket after which its clean baseline is measured again.
        gain: the controller's step in log rate per observation, relative to the cap.
        min_rate: the rate never falls below this (so it can always measure its way back up).
        max_penalty: most one observation counts against the rate, in units of the controller's
            step, relative to what loaded steps usually measure (see the module docstring); the
            moving average `slowdown` averages the limited observations alike.
        step_cost: deterministic pacing: the slowdown one drafter step is assumed to add to the stall
            step beside it; the rate is then fixed at ``max_slowdown / step_cost`` (capped at
            ``max_per_event``) and no step time is read. ``None``: paced on measured step times.
    """

    max_per_event: int
    max_slowdown: float | None = 0.05
    smoothing: float = 0.2
    probe_every: int = 64
    gain: float = 0.05
    min_rate: float = 1e-3
    max_penalty: float = 20.0
    step_cost: float | None = None
    rate: float = 1.0
    """Current drafter steps per stall event."""
    slowdown: float = 0.0
    """Moving average of the observed relative slowdown of stall steps (0.05: 5 % slower)."""
    _credit: float = 0.0
    _debt: float = 0.0  # log rate below the floor the controller asked for (paid back before the rate rises)
    _loaded: bool = False  # drafter work may overlap the step the next event reports
    _clean: dict[tuple[str, int, int], float] = field(default_factory=dict)
    _since_clean: dict[tuple[str, int, int], int] = field(default_factory=dict)
    _recent: deque[float] = field(default_factory=lambda: deque(maxlen=16))  # the last loaded observations
    _window: list[float] = field(default_factory=list)  # uncapped observations since `take_window`
    _window_loaded: list[float] = field(default_factory=list)  # the loaded steps' among them

    def __post_init__(self) -> None:
        if self.max_per_event < 0:
            raise ValueError(f"max_per_event must be >= 0, got {self.max_per_event!r}")
        if self.max_slowdown is not None and not self.max_slowdown > 0:
            raise ValueError(f"max_slowdown must be > 0 or None, got {self.max_slowdown!r}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing!r}")
        if not self.max_penalty > 0:
            raise ValueError(f"max_penalty must be > 0, got {self.max_penalty!r}")
        if self.step_cost is not None and not self.step_cost > 0:
            raise ValueError(f"step_cost must be > 0 or None, got {self.step_cost!r}")
        if self.step_cost is not None and self.max_slowdown is not None:
            self.rate = self.max_slowdown / self.step_cost
        self.rate = min(self.rate, float(self.max_per_event))

    @property
    def loaded(self) -> bool:
        """Whether drafter work may overlap the step the next event reports (its time is then a loaded one)."""
        return self._loaded

    @staticmethod
    def bucket(phase: str, active_rows: int, draft_tokens: int = 0) -> tuple[str, int, int]:
        """Steps comparable in cost: same phase and draft length, active rows rounded up to a power of two."""
        return phase, draft_tokens, 1 << max(0, active_rows - 1).bit_length()

    def plan(
        self,
        phase: str,
        active_rows: int,
        step_time_s: float,
        in_flight: int,
        captured: bool = False,
        draft_tokens: int = 0,
    ) -> int:
        """Steps to queue after a stall step that took ``step_time_s``, with ``in_flight`` steps
        still running on the side stream; ``captured``: that time includes a graph capture (or a
        compile), so it measures nothing (one such step as a clean baseline would hide every real
        slowdown of its bucket; as a loaded one it would throw the rate to its floor);
        ``draft_tokens``: the step's ``k`` (`lightning_tlt.core.types.StepEvent.draft_tokens`)."""
        if self.max_slowdown is None:
            return self.max_per_event
        if self.step_cost is not None:  # deterministic: a fixed rate, as credit, whatever the clock says
            self._credit = min(self._credit + self.rate, float(self.max_per_event))
            n = int(self._credit)
            self._credit -= n
            return n
        key = self.bucket(phase, active_rows, draft_tokens)
        clean = self._clean.get(key)
        a = self.smoothing
        observed = float("nan")  # stays NaN for a step whose time held a capture: it measures nothing
        if captured:
            pass
        elif not self._loaded:
            self._clean[key] = step_time_s if clean is None else (1 - a) * clean + a * step_time_s
            self._since_clean[key] = 0
            observed = 0.0
        else:
            self._since_clean[key] = self._since_clean.get(key, 0) + 1
            observed = step_time_s / clean - 1.0 if clean else float("nan")
        if observed == observed:  # a comparable clean baseline exists
            self._window.append(observed)
            usual = self.max_slowdown
            if self._loaded:
                self._window_loaded.append(observed)
                usual = max(usual, statistics.median(self._recent)) if self._recent else usual
                self._recent.append(observed)
            observed = min(observed, (1 + self.max_penalty) * usual)  # one outlier weighs this much
            self.slowdown = (1 - a) * self.slowdown + a * observed
            step = self.gain * (self.max_slowdown - observed) / self.max_slowdown
            # the integral, below the floor too: what the floor kept the rate from falling by is owed
            level = math.log(self.rate) - self._debt + step
            self._debt = max(0.0, math.log(self.min_rate) - level)
            self.rate = min(float(self.max_per_event), max(self.min_rate, math.exp(level)))
        probing = clean is None or self._since_clean.get(key, 0) >= self.probe_every
        n = 0
        if not probing:
            self._credit = min(self._credit + self.rate, float(self.max_per_event))
            n = int(self._credit)
            self._credit -= n
        self._loaded = in_flight + n > 0
        return n

    def state_dict(self) -> dict[str, float]:
        """The controller's rate, queued credit and debt below its floor (a resumed run paces on from where it was)."""
        return {"rate": self.rate, "credit": self._credit, "debt": self._debt}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.rate = float(state["rate"])
        self._credit = float(state["credit"])
        self._debt = float(state.get("debt", 0.0))  # a checkpoint from before the debt: none owed

    def take_window(self) -> dict[str, float]:
        """Since the last call (then reset): ``slowdown``, the mean relative slowdown of the measured
        stall steps (clean ones 0, uncapped: what the cap bounds, as it happened); ``loaded_share``,
        the share of them that ran beside drafter work; ``loaded_slowdown``, those steps' median
        slowdown (NaN when none ran beside drafter work)."""
        window, loaded = self._window, self._window_loaded
        self._window, self._window_loaded = [], []
        n = len(window)
        return {
            "slowdown": sum(window) / n if n else 0.0,
            "loaded_share": len(loaded) / n if n else 0.0,
            "loaded_slowdown": statistics.median(loaded) if loaded else float("nan"),
        }

    def queued(self, accepted: int, in_flight: int) -> None:
        """What the learner accepted of the last `plan` (fewer when its queue is full or its buffer
        empty): the next step is loaded only by work that really runs beside it (``accepted`` counts
        too where the steps ran at once, on the CPU, and are no longer in flight)."""
        self._loaded = in_flight + accepted > 0

    def skip(self, in_flight: int) -> None:
        """An event outside the stalls (nothing measured, nothing queued): the next step is loaded
        only by what is still in flight."""
        self._loaded = in_flight > 0

