"""What a ``generate`` call spent compiling and capturing: its figures, its progress line, the cache.

A compiled engine compiles each step function once, on its first use (one version over every
batch bucket and draft length, `lightning_tlt.rollout.steps`), and captures each step profile's
CUDA graph on its first use. A cold first call can spend tens of seconds in that: it says so on
the console (``capturing graphs: 12 in 8.1 s (compiling 6.0 s)``) so it never looks like a hang,
and a call that compiled something saves the persistent compile cache
(`lightning_tlt.core.compile_cache`) for the next process.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from lightning_tlt.core.compile_cache import CompileCache
from lightning_tlt.rollout.cuda_graphs import GraphStats, compile_seconds

REPORT_AFTER_S = 2.0
"""A call's compiling and capturing is reported once it has taken this long."""
REPORT_EVERY_S = 5.0
"""... and then at most this often, and once at the end of the call."""


def say(message: str) -> None:
    """One console line on rank zero, through tqdm so that a progress bar on screen is redrawn below it."""
    if torch.distributed.is_available() and torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    from tqdm.auto import tqdm

    tqdm.write(f"lightning-tlt: {message}", file=sys.stderr)


class CompileTracker:
    """The per-call bookkeeping of compiling and capturing.

    Args:
        cache: the persistent compile cache, or ``None``.
        report: print the progress line (the engine's ``log_compile``).
    """

    def __init__(self, cache: CompileCache | None, report: bool = True) -> None:
        self.cache = cache
        self.report = report
        self._start = (0.0, 0, 0.0, 0.0)  # compile seconds, captures, capture seconds, wall clock
        self._last_said = 0.0
        self._said = False

    def begin(self, stats: GraphStats | None) -> None:
        """Start of a call: the counters it will report against."""
        captures, capture_s = (stats.captures, stats.capture_time_s) if stats is not None else (0, 0.0)
        self._start = (compile_seconds(), captures, capture_s, time.perf_counter())
        self._said = False

    def spent(self, stats: GraphStats | None) -> dict[str, float]:
        """Since `begin`: ``compile_s`` (Dynamo, in or out of captures), ``captures``, ``capture_s``."""
        compiled, captures, capture_s, _ = self._start
        return {
            "compile_s": compile_seconds() - compiled,
            "captures": float((stats.captures if stats is not None else 0) - captures),
            "capture_s": (stats.capture_time_s if stats is not None else 0.0) - capture_s,
        }

    def before_capture(self, stats: GraphStats | None, what: str) -> None:
        """About to capture (and perhaps first compile) ``what``: a line when the call has taken a while."""
        if not self.report:
            return
        now = time.perf_counter()
        spent = self.spent(stats)
        first = stats is not None and stats.captures == 0 and spent["captures"] == 0
        if first:  # the engine's very first capture: compiling may take a while, say so before it starts
            where = f"; compile cache {self.cache.path}" if self.cache is not None else ""
            say(f"compiling the rollout steps and capturing CUDA graphs ({what} first{where})")
            self._last_said, self._said = now, True
        elif spent["capture_s"] + spent["compile_s"] >= REPORT_AFTER_S and now - self._last_said >= REPORT_EVERY_S:
            say(self._line(spent, f"; next: {what}"))
            self._last_said, self._said = now, True

    def end(self, stats: GraphStats | None) -> dict[str, float]:
        """End of a call: its figures; the cache saved when it compiled something; a last line if it reported."""
        spent = self.spent(stats)
        if self.cache is not None and spent["compile_s"] > 0:
            self.cache.save()
        if self.report and self._said:
            say(self._line(spent, ""))
        return spent

    @staticmethod
    def _line(spent: dict[str, Any], tail: str) -> str:
        return (f"captured {spent['captures']:.0f} graphs in {spent['capture_s']:.1f} s "
                f"(compiling {spent['compile_s']:.1f} s){tail}")


__all__ = ["CompileTracker", "say"]
