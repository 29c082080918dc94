"""How many tokens to draft, zero included: a bucketed epsilon-greedy bandit on measured tokens per second.

The best draft length k depends on the batch: at batch 1 a verify forward of 9 tokens costs about
what a plain step does, so long drafts pay; at batch 20 the forward is no longer free and short
drafts win. TLT (arXiv 2511.16665) chooses per batch-size bucket with a "bucketed epsilon-greedy"
bandit (epsilon 0.1, median reward over a sliding window, reward = accepted length x batch size /
step time); with its defaults it is in effect the table batch 1 -> 48 verify tokens, 2-4 -> 32,
5-20 -> 16, 21+ -> 8. `DraftLengthTuner` does the same for chain drafts over ``candidates``, with
the static table (the longest candidate for the smallest bucket, shorter for larger ones) as the
prior that exploitation falls back to before an arm has been measured.

Arm ``k = 0`` is plain decoding. Every arm of a bucket is tried ``min_samples`` times before the
bandit exploits, shortest first, and each arm is scored on what it achieved (tokens emitted per
second of device time), so speculation can never stay on while it loses: with a useless drafter the
plain arm wins after a handful of steps, and with a good one the gate's threshold is a cap, not a
guess (a bucket where speculating pays keeps speculating, whatever its size).

Exploring costs most where it matters most: in a short tail, trying every draft length of an
untrained drafter twice per bucket was most of the tail (H200, 0.5 B policy: 0.70x of plain in the
1-8-row tail). So a longer arm is not explored while a shorter one proves it cannot win. Drafting is
a chain: the chance that draft position i is accepted never grows with i, so ``k`` drafts add at
most ``k / j`` times the tokens ``j`` drafts added, and a longer chain costs at least as much a step.
From arm ``j``'s measured rate ``r_j`` and accepted drafts per row and step ``A_j``, arm ``k > j``
reaches at most ``r_j (1 + A_j k / j) / (1 + A_j)``; when that is below ``1 - prune_margin`` of the
bucket's best measured arm, ``k`` is skipped, by the first tries and by epsilon alike. Only arms that
may still win serve as ``j`` (a skipped arm is never measured again), and the shortest drafting arm
is never skipped, so a drafter that gets better (co-training) reopens the longer arms.

Timing never syncs the host with the device inside the decode loop: on CUDA, `start`/`stop` record
an event pair and copy the emitted-token count into pinned host memory asynchronously; the pair is
read (``elapsed_time``) only once ``end.query()`` says it has completed, at a later `choose` or
`poll`. On CPU, `time.perf_counter` is used and read at once. A ``cost_model`` (seconds of a step
as a function of ``k`` and the active rows) replaces the clock (the engine's deterministic mode,
`SpeculativeConfig.deterministic`; tests and simulations): every arm is then scored on the tokens it
counted over its modelled cost, and on CUDA the counts are read at fixed points, not when they
happen to have arrived: `poll` reads every step but the newest (waiting for them, which the engine's
one-step-late reads of the finish flags have mostly done already), so the choices depend on the
counts alone.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from statistics import median
from typing import Any

import torch
from torch import Tensor


@dataclass
class _Timing:
    """One step in flight (returned by `DraftLengthTuner.start`)."""

    bucket: int
    k: int
    start_s: float = 0.0
    start_event: Any = None  # torch.cuda.Event on CUDA
    end_event: Any = None
    slot: int = -1  # index into the pinned token counter ring
    rows: int = 0  # active rows of the step
    tokens: float = 0.0  # CPU: the count, known at once


class DraftLengthTuner:
    """Chooses the draft length k per batch bucket by epsilon-greedy on measured tokens/s.

    Usage per speculative step::

        k = tuner.choose(active_rows)
        timing = tuner.start(k, active_rows)
        ...  # draft k tokens and verify them
        tuner.stop(timing, result.num_emitted.sum())   # a device tensor is fine: read lazily

    Args:
        candidates: the k values to choose among (deduplicated, sorted); 0 is plain decoding.
        epsilon: probability of exploring a uniformly random candidate; 0 keeps the static table
            (or the best measured arm).
        buckets: upper bounds (inclusive) of the batch-size buckets; one more bucket holds larger
            batches. TLT's ``(1, 4, 20)`` gives 1, 2-4, 5-20, 21+.
        window: rewards kept per (bucket, k); the median of the window is the arm's value.
        table: the static choice per bucket (one k per bucket, ``len(buckets) + 1`` entries);
            ``None``: the longest candidate for bucket 0, the next shorter for each larger bucket.
        seed: seeds the tuner's own ``torch.Generator`` when ``generator`` is not given.
        generator: the source of exploration randomness (CPU generator).
        device: where steps run; ``"cuda"`` devices are timed with CUDA events.
        max_pending: most CUDA timings in flight (older ones are read, waiting if needed).
        min_samples: steps of each arm per bucket before exploiting (started steps, so arms whose
            CUDA timing is still in flight are not tried again and again).
        cost_model: ``(k, active_rows) -> seconds`` used instead of measuring (deterministic tests).
        prune_margin: a longer arm is skipped while its bound (above) is below ``1 - prune_margin``
            of the bucket's best measured rate; ``None`` explores every arm.
    """

    def __init__(
        self,
        candidates: Sequence[int] = (2, 4, 6, 8),
        epsilon: float = 0.1,
        buckets: Sequence[int] = (1, 4, 20),
        window: int = 16,
        table: Sequence[int] | None = None,
        seed: int = 0,
        generator: torch.Generator | None = None,
        device: torch.device | str | None = None,
        max_pending: int = 64,
        min_samples: int = 2,
        cost_model: Callable[[int, int], float] | None = None,
        prune_margin: float | None = 0.05,
    ) -> None:
        if not candidates or any(k < 0 for k in candidates):
            raise ValueError(
                f"candidates must be non-empty draft lengths >= 0 (0: plain decoding), got {tuple(candidates)!r}"
            )
        if min_samples < 0:
            raise ValueError(f"min_samples must be >= 0, got {min_samples!r}")
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")
        if any(b < 1 for b in buckets) or list(buckets) != sorted(set(buckets)):
            raise ValueError(
                f"buckets must be strictly increasing positive batch sizes, got {tuple(buckets)!r}"
            )
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending!r}")
        if prune_margin is not None and not 0.0 <= prune_margin < 1.0:
            raise ValueError(f"prune_margin must be in [0, 1) or None, got {prune_margin!r}")
        self.candidates: tuple[int, ...] = tuple(sorted(set(candidates)))
        self.epsilon = epsilon
        self.buckets: tuple[int, ...] = tuple(buckets)
        self.window = window
        num_buckets = len(self.buckets) + 1
        if table is None:
            longest_first = self.candidates[::-1]
            table = [longest_first[min(i, len(longest_first) - 1)] for i in range(num_buckets)]
        if len(table) != num_buckets or any(k not in self.candidates for k in table):
            raise ValueError(
                f"table must give one of the candidates {self.candidates} for each of the {num_buckets} "
                f"buckets, got {tuple(table)!r}"
            )
        self.table: tuple[int, ...] = tuple(table)
        self.min_samples = min_samples
        self.cost_model = cost_model
        self.prune_margin = prune_margin
        self._accepted: dict[tuple[int, int], deque[float]] = {}  # drafts accepted per row and step
        self._started: dict[tuple[int, int], int] = {}
        self._generator = generator if generator is not None else torch.Generator().manual_seed(seed)
        self._rewards: dict[tuple[int, int], deque[float]] = {}
        self._counts: dict[tuple[int, int], int] = {}
        self._cuda = device is not None and torch.device(device).type == "cuda"
        self._pending: deque[_Timing] = deque()
        self._host_counts: Tensor | None = None
        self._next_slot = 0
        self.max_pending = max_pending
        if self._cuda:
            self._host_counts = torch.zeros(max_pending, 2, dtype=torch.float64, pin_memory=True)  # tokens, rows

    def set_device(self, device: torch.device | str) -> None:
        """Time steps on ``device`` (CUDA events there; the host clock elsewhere)."""
        cuda = torch.device(device).type == "cuda"
        if cuda != self._cuda:
            self.flush()
            self._cuda = cuda
            self._host_counts = (
                torch.zeros(self.max_pending, 2, dtype=torch.float64, pin_memory=True) if cuda else None
            )

    # ---------------------------------------------------------------- choosing
    def bucket(self, active_rows: int) -> int:
        """Index of the bucket of a batch of ``active_rows`` rows."""
        if active_rows < 1:
            raise ValueError(f"active_rows must be >= 1, got {active_rows!r}")
        return bisect.bisect_left(self.buckets, active_rows)

    def value(self, bucket: int, k: int) -> float | None:
        """Median measured tokens/s of arm ``k`` in ``bucket``; ``None`` before any measurement."""
        rewards = self._rewards.get((bucket, k))
        return median(rewards) if rewards else None

    def rewards(self) -> dict[tuple[int, int], list[float]]:
        """Measured tokens/s of each ``(bucket, k)`` arm, oldest first, as read so far (a copy; timings
        still in flight on the device are not in it)."""
        return {key: list(values) for key, values in self._rewards.items()}

    def accepted(self) -> dict[tuple[int, int], list[float]]:
        """Drafts accepted per row and step of each ``(bucket, k)`` drafting arm, oldest first (a copy)."""
        return {key: list(values) for key, values in self._accepted.items()}

    def best(self, active_rows: int) -> int:
        """The exploitation choice: the best measured arm, or the static table before any."""
        bucket = self.bucket(active_rows)
        best_k, best_v = self.table[bucket], self.value(bucket, self.table[bucket])
        for k in self.candidates:
            v = self.value(bucket, k)
            if v is not None and (best_v is None or v > best_v):
                best_k, best_v = k, v
        return best_k

    def may_win(self, bucket: int, k: int) -> bool:
        """Whether arm ``k`` can still beat ``bucket``'s best measured arm (the module's bound).

        ``True`` until a shorter drafting arm has both a rate and an acceptance measured, and always
        for plain decoding and the shortest drafting arm.
        """
        return k in self._winnable(bucket)

    def _winnable(self, bucket: int) -> list[int]:
        """The arms of ``bucket`` that may still win, in one pass from the shortest: each arm is
        bounded by the shorter drafting arms already found winnable (a ruled-out arm is not measured
        again, so its old figures must not rule out others)."""
        measured = [v for c in self.candidates if (v := self.value(bucket, c)) is not None]
        if self.prune_margin is None or not measured:
            return list(self.candidates)
        bar = max(measured) * (1.0 - self.prune_margin)
        winnable: list[int] = []
        for k in self.candidates:
            bounded_out = False
            for j in winnable:
                rate, accepted = self.value(bucket, j), self._accepted.get((bucket, j))
                if j == 0 or rate is None or not accepted:
                    continue
                a = max(0.0, sum(accepted) / len(accepted))
                if rate * (1.0 + a * k / j) / (1.0 + a) < bar:
                    bounded_out = True
                    break
            if not bounded_out:
                winnable.append(k)
        return winnable

    def choose(self, active_rows: int) -> int:
        """The k for the next step of a batch of ``active_rows`` rows (0: a plain decode step)."""
        self.poll()
        bucket = self.bucket(active_rows)
        arms = self._winnable(bucket)
        for k in arms:  # plain, then the shortest drafts first: each bounds the longer ones
            if self._started.get((bucket, k), 0) < self.min_samples:
                return k
        if self.epsilon > 0.0:
            draw = torch.rand((), generator=self._generator)
            if float(draw) < self.epsilon:
                index = int(torch.randint(len(arms), (), generator=self._generator))
                return arms[index]
        return self.best(active_rows)

    # ---------------------------------------------------------------- measuring
    def record(self, active_rows: int, k: int, emitted_tokens: float, seconds: float) -> None:
        """Add one measurement: all rows emitted ``emitted_tokens`` in ``seconds`` drafting k each."""
        if k not in self.candidates:
            raise ValueError(f"k must be one of the candidates {self.candidates}, got {k!r}")
        if not seconds > 0.0:
            raise ValueError(f"seconds must be > 0, got {seconds!r}")
        key = (self.bucket(active_rows), k)
        self._started[key] = self._started.get(key, 0) + 1
        self._add(key[0], k, float(emitted_tokens), seconds, active_rows)

    def _add(self, bucket: int, k: int, tokens: float, seconds: float, rows: float) -> None:
        key = (bucket, k)
        self._rewards.setdefault(key, deque(maxlen=self.window)).append(tokens / max(seconds, 1e-9))
        self._counts[key] = self._counts.get(key, 0) + 1
        if k > 0 and rows > 0:  # every active row emits one token a step, plus its accepted drafts
            self._accepted.setdefault(key, deque(maxlen=self.window)).append(tokens / rows - 1.0)

    def start(self, k: int, active_rows: int) -> _Timing:
        """Begin timing a step that drafts ``k`` tokens for ``active_rows`` rows."""
        if k not in self.candidates:
            raise ValueError(f"k must be one of the candidates {self.candidates}, got {k!r}")
        timing = _Timing(bucket=self.bucket(active_rows), k=k, rows=active_rows)
        key = (timing.bucket, k)
        self._started[key] = self._started.get(key, 0) + 1
        if self._cuda and self.cost_model is None:
            timing.start_event = torch.cuda.Event(enable_timing=True)
            timing.start_event.record()
        else:
            timing.start_s = time.perf_counter()
        return timing

    def stop(self, timing: _Timing, emitted_tokens: Tensor | int | float, *, captured: bool = False) -> None:
        """End the step begun by `start`; ``emitted_tokens`` (all rows) may be a device tensor.

        A tensor is read per row: its sum is the step's tokens, and its rows that emitted any are the
        rows whose acceptance counts (rows that had finished, whose flags the engine reads a step
        late, emit none and would drag the acceptance estimate down). A number counts
        ``active_rows`` rows.

        ``captured``: the step also captured a CUDA graph (and compiled): its measured time is not the
        step's, so it is forgotten unscored (with a `cost_model` there is no measured time to spoil).
        """
        if captured and self.cost_model is None:
            key = (timing.bucket, timing.k)
            self._started[key] = max(0, self._started.get(key, 0) - 1)
            return
        if not self._cuda:
            if self.cost_model is not None:
                seconds = self.cost_model(timing.k, timing.rows)
            else:
                seconds = time.perf_counter() - timing.start_s
            count, rows = self._tokens_and_rows(emitted_tokens, timing.rows)
            self._add(timing.bucket, timing.k, float(count), seconds, float(rows))
            return
        assert self._host_counts is not None
        if len(self._pending) >= self.max_pending:
            self._harvest(self._pending.popleft(), wait=True)
        timing.slot = self._next_slot
        self._next_slot = (self._next_slot + 1) % self.max_pending
        count, rows = self._tokens_and_rows(emitted_tokens, timing.rows)
        if isinstance(count, Tensor) and isinstance(rows, Tensor):
            # device -> pinned host copy, asynchronous: read after end_event completes
            self._host_counts[timing.slot].copy_(torch.stack([count, rows]).to(torch.float64), non_blocking=True)
        else:
            self._host_counts[timing.slot, 0] = float(count)
            self._host_counts[timing.slot, 1] = float(rows)
        timing.end_event = torch.cuda.Event(enable_timing=True)
        timing.end_event.record()
        self._pending.append(timing)

    def _harvest(self, timing: _Timing, wait: bool = False) -> None:
        assert self._host_counts is not None
        if wait:
            timing.end_event.synchronize()
        if self.cost_model is not None:
            seconds = self.cost_model(timing.k, timing.rows)
        else:
            seconds = timing.start_event.elapsed_time(timing.end_event) / 1000.0
        tokens, rows = self._host_counts[timing.slot].tolist()
        self._add(timing.bucket, timing.k, tokens, seconds, rows)

    @staticmethod
    def _tokens_and_rows(emitted: Tensor | int | float, active_rows: int) -> tuple[Tensor | float, Tensor | float]:
        if isinstance(emitted, Tensor):
            per_row = emitted.reshape(-1)
            return per_row.sum().to(torch.float64), (per_row > 0).sum().to(torch.float64)
        return float(emitted), float(active_rows)

    def poll(self) -> int:
        """Read the CUDA timings that have completed (in order, without waiting); returns how many.

        With a ``cost_model``: every step but the newest, waiting if needed (fixed points, not timing).
        """
        read = 0
        if self.cost_model is not None:
            while len(self._pending) > 1:
                self._harvest(self._pending.popleft(), wait=True)
                read += 1
            return read
        while self._pending and self._pending[0].end_event.query():
            self._harvest(self._pending.popleft())
            read += 1
        return read

    def flush(self) -> None:
        """Wait for and read every timing in flight (at the end of a ``generate`` call)."""
        while self._pending:
            self._harvest(self._pending.popleft(), wait=True)

    # ---------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """Measured rewards per (bucket, k), counts and the exploration generator's state."""
        self.flush()
        return {
            "candidates": self.candidates,
            "buckets": self.buckets,
            "rewards": self.rewards(),
            "accepted": self.accepted(),
            "counts": dict(self._counts),
            "started": dict(self._started),
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if tuple(state_dict["candidates"]) != self.candidates or tuple(state_dict["buckets"]) != self.buckets:
            raise ValueError(
                f"state was saved for candidates {tuple(state_dict['candidates'])} and buckets "
                f"{tuple(state_dict['buckets'])}, this tuner has {self.candidates} and {self.buckets}"
            )
        self._rewards = {
            tuple(key): deque(values, maxlen=self.window) for key, values in state_dict["rewards"].items()
        }
        self._accepted = {  # absent from checkpoints written before the bound existed
            tuple(key): deque(values, maxlen=self.window) for key, values in state_dict.get("accepted", {}).items()
        }
        self._counts = {tuple(key): int(n) for key, n in state_dict["counts"].items()}
        self._started = {tuple(key): int(n) for key, n in state_dict.get("started", state_dict["counts"]).items()}
        self._generator.set_state(state_dict["generator"])

    def summary(self) -> dict[str, float]:
        """Flat figures for logging: the median tokens/s of each measured (bucket, k) arm."""
        return {f"tuner/b{b}_k{k}_tok_s": median(v) for (b, k), v in sorted(self._rewards.items()) if v}
