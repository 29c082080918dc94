"""The printed summary line: correctness beside the total reward, and its legend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lightning_tlt.callbacks.rollout_metrics import (
    SUMMARY_LEGEND,
    RolloutMetricsCallback,
    short_reward_name,
    summary_line,
)


def test_summary_line_shows_each_reward_function_beside_the_total() -> None:
    metrics = {
        "reward": 1.4,
        "reward_std": 0.3,
        "rewards/countdown_search_correctness/mean": 0.42,
        "rewards/countdown_search_correctness/std": 0.49,
        "rewards/countdown_search_format/mean": 0.98,
        "rewards/my_bonus/mean": 0.1,
        "completions/mean_length": 40.25,
        "completions/clipped_ratio": 0.03,
        "rollout/tokens_per_s": 5123.0,
        "spec/fraction": 0.4,
        "spec/accept_len": 1.6,
    }
    assert summary_line(4, metrics, {"step_time": 2.1}) == (
        "step 4 | reward 1.400 ± 0.300 (correctness 0.420, format 0.980, my_bonus 0.100) | len 40.2 (clipped 3%) "
        "| 5,123 tok/s | spec 40% accept 1.60 | 2.10 s"
    )
    # without per-function metrics (or any reward) the line keeps its other columns
    assert summary_line(2, {"reward": 0.5}, {}) == "step 2 | reward 0.500 ± 0.000"
    assert summary_line(2, {}, {"step_time": 1.0}) == "step 2 | 1.00 s"


def test_short_reward_names_and_legend() -> None:
    assert short_reward_name("arithmetic_correctness") == "correctness"
    assert short_reward_name("countdown_search_format") == "format"
    assert short_reward_name("correctness") == "correctness"
    assert short_reward_name("informat") == "informat"
    for column in ("step", "reward", "correctness", "format", "len", "tok/s", "spec/accept", "rewards/<func>/mean"):
        assert column in SUMMARY_LEGEND, column


def test_validation_is_timed_apart_from_the_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 2.0, 2.5, 50.5, 53.5])  # fit start, step 1 end, validation 2.5-50.5 s, step 2 end
    monkeypatch.setattr("lightning_tlt.callbacks.rollout_metrics.time.perf_counter", lambda: next(clock))
    printed: list[str] = []
    monkeypatch.setattr("lightning_tlt.callbacks.rollout_metrics.print_line", lambda trainer, text: printed.append(text))
    logged: dict[str, list[float]] = {}
    module = SimpleNamespace(log=lambda name, value, **kw: logged.setdefault(name, []).append(value))
    trainer = SimpleNamespace(datamodule=None, global_step=0, max_steps=4, callback_metrics={},
                              state=SimpleNamespace(fn="fit"))
    callback = RolloutMetricsCallback(print_every_n_steps=1)
    batch = type("Batch", (), {"metrics": {"reward": 1.0}, "__len__": lambda self: 2})()
    callback.on_fit_start(trainer, module)
    trainer.global_step = 2
    callback.on_train_batch_end(trainer, module, None, batch, 0)
    callback.on_validation_start(trainer, module)
    trainer.callback_metrics = {"eval_reward": torch.tensor(1.5), "eval_rewards/f/mean": torch.tensor(0.75)}
    callback.on_validation_end(trainer, module)
    trainer.global_step = 4
    callback.on_train_batch_end(trainer, module, None, batch, 1)
    assert logged["step_time"] == [2.0, 3.5]  # step 2: 53.5 - 2.0 less the validation's 48 s (51.5 s before)
    assert printed[-2] == "validation at step 2 | reward 1.500 ± 0.000 (f 0.750) | 48.00 s"
    assert callback.state_dict()["validations"] == [{"step": 2, "seconds": 48.0, "reward": 1.5,
                                                     "rewards/f/mean": 0.75}]


def test_paused_seconds_are_left_out_of_the_next_step_whenever_they_were_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([0.0, 10.0, 25.0, 40.0])  # fit start, then three step ends
    monkeypatch.setattr("lightning_tlt.callbacks.rollout_metrics.time.perf_counter", lambda: next(clock))
    logged: dict[str, list[float]] = {}
    module = SimpleNamespace(log=lambda name, value, **kw: logged.setdefault(name, []).append(value))
    trainer = SimpleNamespace(datamodule=None, global_step=0, max_steps=3)
    callback = RolloutMetricsCallback(print_every_n_steps=0)
    callback.on_fit_start(trainer, module)
    callback.pause(4.0)  # an evaluation before the first step (step 0's control)
    callback.on_train_batch_end(trainer, module, None, [], 0)
    callback.on_train_batch_end(trainer, module, None, [], 1)
    callback.pause(5.0)  # at step 2's end, after this callback's end of it: step 3 leaves it out
    callback.on_train_batch_end(trainer, module, None, [], 2)
    assert logged["step_time"] == [6.0, 15.0, 10.0]
