"""The printed summary line: correctness beside the total reward, and its legend."""

from __future__ import annotations

from lightning_tlt.callbacks.rollout_metrics import SUMMARY_LEGEND, short_reward_name, summary_line


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
