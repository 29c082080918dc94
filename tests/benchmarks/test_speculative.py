"""benchmarks/speculative.py: capture steps tallied apart in their bins, never dropped."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from lightning_tlt.core.types import StepEvent


def test_capture_steps_are_binned_apart_and_the_tail_rate_counts_them_on_request(
    benchmark_script: Callable[[str], ModuleType],
) -> None:
    speculative = benchmark_script("speculative")
    binner = speculative.RowBinner()

    def step(rows_after: int, tokens: int, seconds: float, captured: bool = False) -> None:
        binner(StepEvent(step=0, phase="decode", active_rows=rows_after, queued_rows=0, num_slots=64,
                         step_time_s=seconds, new_tokens=tokens, captured=captured))

    step(8, 8, 0.01)  # the first step runs on its own rows (8)
    step(4, 8, 0.50, captured=True)  # ran on 8 rows, and captured a graph: 0.5 s, apart
    step(2, 4, 0.01)  # ran on 4 rows
    step(1, 2, 0.02, captured=True)  # ran on 2 rows
    binner(StepEvent(step=0, phase="done", active_rows=0, queued_rows=0, num_slots=64, step_time_s=0.0))
    rates = binner.rates()
    assert (rates["5-8"]["tokens"], rates["5-8"]["captured_tokens"]) == (8, 8)
    assert rates["5-8"]["captured_s"] == 0.5 and rates["2-4"]["captured_s"] == 0.02
    assert binner.captured_s == pytest.approx(0.52)
    assert speculative.tail_rate(rates) == pytest.approx(12 / 0.02)  # the steps that captured nothing
    assert speculative.tail_rate(rates, captures=True) == pytest.approx(22 / 0.54)  # every step


def test_verification_and_deterministic_flags(benchmark_script: Callable[[str], ModuleType]) -> None:
    parser = benchmark_script("speculative").parser
    args = parser().parse_args([])
    assert (args.verification, args.deterministic) == ("rejection", False)
    args = parser().parse_args(["--verification", "coupled", "--deterministic"])
    assert (args.verification, args.deterministic) == ("coupled", True)
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parser().parse_args(["--verification", "maximal"])
