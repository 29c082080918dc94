"""benchmarks/reproducible.py: where two runs' rollouts first differ, and the race's margin there."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from lightning_tlt.core.sampling import NOISE_SAMPLE, call_seed, keyed_exponential, row_keys
from lightning_tlt.core.types import RolloutOutput


def _out(completions: list[list[int]], logprobs: list[list[float]]) -> RolloutOutput:
    return RolloutOutput(prompt_ids=[[1]] * len(completions), completion_ids=completions, logprobs=logprobs,
                         finish_reasons=["length"] * len(completions), stats={})


def test_divergence_by_hand(benchmark_script: Callable[[str], ModuleType]) -> None:
    bench = benchmark_script("reproducible")
    keys = row_keys(3, [[1], [2], [3]])
    ref = _out([[5, 6, 7], [8, 9], [4, 4, 4]], [[-1.0, -2.0, -0.5], [-0.1, -0.2], [-1.0] * 3])
    out = _out([[5, 6, 7], [8, 2, 3], [4, 4]], [[-1.0, -2.0, -0.5], [-0.1, -0.7, -0.3], [-1.0] * 2])
    d = bench.divergence(ref, out, keys)
    assert d["rows"] == 3 and d["identical_share"] == pytest.approx(1 / 3)
    assert d["first_difference"] == [1, 2] and d["first_difference_median"] == 1.5
    e = keyed_exponential(torch.tensor([keys[1]]), torch.tensor([1]), NOISE_SAMPLE, torch.tensor([9, 2]))[0]
    margin = (-0.2 - math.log(float(e[0]))) - (-0.7 - math.log(float(e[1])))
    assert d["race_margin_nats"][0] == pytest.approx(margin)
    assert math.isnan(d["race_margin_nats"][1])  # row 2 ended a token early: no race to compare
    assert d["race_margin_abs_median"] == pytest.approx(abs(margin))


def test_call_keys_are_the_engines(benchmark_script: Callable[[str], ModuleType]) -> None:
    bench = benchmark_script("reproducible")
    prompts = [[4, 5], [6]]
    seed = call_seed(torch.Generator().manual_seed(7))
    assert bench.call_keys(7, prompts, 2) == row_keys(seed, prompts, 2)
    args = bench.parser().parse_args(["--arms", "off,coupled"])
    assert args.arms == "off,coupled" and args.seed == 7
