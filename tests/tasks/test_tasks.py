"""Synthetic tasks: TRL dataset formats, exact rewards on hand-written completions, the long tail."""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerFast
from trl.data_utils import is_conversational, maybe_apply_chat_template

from lightning_tlt.tasks import (
    TASKS,
    ArithmeticTask,
    arithmetic_correctness,
    arithmetic_format,
    completion_text,
    countdown_correctness,
    countdown_format,
    final_answer,
    get_task,
    sample_detours,
    split_of,
)
from lightning_tlt.tasks.arithmetic import reduction_steps
from lightning_tlt.tasks.countdown import evaluate_expression

# ---------------------------------------------------------------- registry and datasets


def test_registry() -> None:
    assert set(TASKS) >= {"arithmetic", "countdown", "countdown_search"}
    assert get_task("arithmetic") is TASKS["arithmetic"]
    assert get_task(TASKS["countdown"]) is TASKS["countdown"]
    with pytest.raises(
        ValueError,
        match=r"unknown task 'gsm8k'; registered tasks: \['arithmetic', 'countdown', 'countdown_search'\]",
    ):
        get_task("gsm8k")
    for name, task in TASKS.items():
        assert [f.__name__ for f in task.reward_funcs] == [f"{name}_correctness", f"{name}_format"]


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "countdown_search"])
def test_prompt_only_dataset_columns(name: str, tokenizer: PreTrainedTokenizerFast) -> None:
    task = TASKS[name]
    extra = ["numbers", "target"] if name.startswith("countdown") else []
    plain = task.make_dataset(16, difficulty=1, seed=0)
    assert plain.column_names == ["prompt", "answer", "difficulty", *extra]
    assert len(plain) == 16 and set(plain["difficulty"]) == {1}
    assert all(isinstance(p, str) and p.endswith("\n") for p in plain["prompt"])
    assert not is_conversational(plain[0])
    conv = task.make_dataset(16, difficulty=1, seed=0, conversational=True)
    assert conv.column_names == plain.column_names
    assert conv[0]["prompt"] == [{"role": "user", "content": plain[0]["prompt"].rstrip("\n")}]
    assert conv["answer"] == plain["answer"]
    assert is_conversational(conv[0])
    # TRL renders it with our chat template
    rendered = maybe_apply_chat_template(conv[0], tokenizer)["prompt"]
    assert rendered == f"<bos><|user|>{conv[0]['prompt'][0]['content']}<eos><|assistant|>"


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_sft_dataset_columns_and_solutions_score_full_reward(name: str) -> None:
    task = TASKS[name]
    sft = task.make_sft_dataset(300, difficulty=2, seed=3)
    assert sft.column_names[:4] == ["prompt", "completion", "answer", "difficulty"]
    correctness, fmt = task.reward_funcs
    columns = {k: sft[k] for k in sft.column_names if k not in ("prompt", "completion")}
    assert correctness(sft["prompt"], sft["completion"], **columns) == [1.0] * 300
    assert fmt(sft["prompt"], sft["completion"], **columns) == [1.0] * 300
    conv = task.make_sft_dataset(4, difficulty=2, seed=3, conversational=True)
    assert conv[0]["completion"] == [{"role": "assistant", "content": sft[0]["completion"]}]
    assert is_conversational(conv[0])
    assert correctness(conv["prompt"], conv["completion"], **columns_of(conv)) == [1.0] * 4


def columns_of(dataset) -> dict:  # noqa: ANN001
    return {k: dataset[k] for k in dataset.column_names if k not in ("prompt", "completion")}


def test_datasets_are_deterministic_and_split_is_held_out() -> None:
    task = TASKS["arithmetic"]
    a = task.make_dataset(200, difficulty=1, seed=5)
    assert a["prompt"] == task.make_dataset(200, difficulty=1, seed=5)["prompt"]
    assert a["prompt"] != task.make_dataset(200, difficulty=1, seed=6)["prompt"]
    test = task.make_dataset(200, difficulty=1, seed=5, split="test")
    assert set(test["prompt"]).isdisjoint(task.make_dataset(3000, difficulty=1, seed=0)["prompt"])
    assert all(split_of(p.rstrip("\n")) == "test" for p in test["prompt"])
    assert len(task.make_dataset(0, difficulty=1, seed=0)) == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"difficulty": 0}, r"arithmetic: difficulty must be an int in \[1, 5\], got 0"),
        ({"difficulty": 6}, r"difficulty must be an int in \[1, 5\], got 6"),
        ({"difficulty": 1, "split": "val"}, "split must be 'train' or 'test', got 'val'"),
    ],
)
def test_bad_dataset_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TASKS["arithmetic"].make_dataset(4, seed=0, **kwargs)
    with pytest.raises(ValueError, match="n must be >= 0"):
        TASKS["arithmetic"].make_dataset(-1, difficulty=1, seed=0)


def test_arithmetic_problem_and_solution() -> None:
    assert reduction_steps([4, "+", 7, "*", 2]) == [(7, "*", 2, 14, "4+14"), (4, "+", 14, 18, "18")]
    assert reduction_steps([3, "-", 5, "-", 4]) == [(3, "-", 5, -2, "-2-4"), (-2, "-", 4, -6, "-6")]
    for p in ArithmeticTask().problems(500, difficulty=3, seed=0):
        expression = p.statement.removeprefix("Compute ")
        assert int(p.answer) == eval(expression)  # Python's precedence is the task's
        assert p.solution.endswith(f"\n#### {p.answer}")


def test_countdown_problem_and_solution() -> None:
    for p in TASKS["countdown"].problems(500, difficulty=2, seed=0):
        value, used = evaluate_expression(p.answer)
        assert value == p.extra["target"] and sorted(used) == sorted(p.extra["numbers"])
        assert p.statement == f"Use {' '.join(map(str, p.extra['numbers']))} to make {p.extra['target']}"
        lines = p.solution.split("\n")
        assert lines[-1] == f"#### {p.answer}" and lines[-2].endswith(" yes")
        assert all(line.endswith(" no") for line in lines[:-2])


# ---------------------------------------------------------------- rewards (exact values)

_ARITH_CASES: list[tuple[object, float, float]] = [
    ("7*2=14 -> 4+14\n4+14=18\n#### 18", 1.0, 1.0),
    ("#### 18", 1.0, 1.0),
    ("####18\n\n", 1.0, 1.0),
    ([{"role": "assistant", "content": "4+14=18\n#### 18"}], 1.0, 1.0),
    ("7*2=14 -> 4+14\n4+14=17\n#### 17", 0.0, 1.0),
    ("#### 99999999999999999999", 0.0, 1.0),
    ("#### -18", 0.0, 1.0),
    ("18", 0.0, 0.0),
    ("", 0.0, 0.0),
    ("#### 18\n#### 18", 0.0, 0.0),
    ("#### 18 apples", 0.0, 0.0),
    ("#### 18.0", 0.0, 0.0),
    ("#### 1" + "8" * 5000, 0.0, 0.0),  # beyond int() digit limits: still no exception
    ("\x00\x01 ####  \n####", 0.0, 0.0),
    (None, 0.0, 0.0),
    (42, 0.0, 0.0),
    ([{"role": "assistant", "content": None}], 0.0, 0.0),
    ([{"foo": "bar"}], 0.0, 0.0),
]


def test_arithmetic_rewards_exact() -> None:
    completions = [c for c, _, _ in _ARITH_CASES]
    prompts = ["Compute 4+7*2\n"] * len(completions)
    answers = ["18"] * len(completions)
    assert arithmetic_correctness(prompts, completions, answer=answers) == [c for _, c, _ in _ARITH_CASES]
    assert arithmetic_format(prompts, completions, answer=answers) == [f for _, _, f in _ARITH_CASES]
    # negative answers, answers given as ints, TRL's extra kwargs (completion_ids, trainer_state)
    got = arithmetic_correctness(
        ["x", "y"], ["#### -6", "#### 7"], answer=[-6, "seven"], completion_ids=[[1], [2]], trainer_state=None
    )
    assert got == [1.0, 0.0]


def test_rewards_need_the_answer_column() -> None:
    with pytest.raises(ValueError, match="needs the dataset column 'answer'"):
        arithmetic_correctness(["p"], ["#### 1"])
    with pytest.raises(ValueError, match="has 2 rows for 1 completions"):
        countdown_correctness(["p"], ["#### 1"], answer=["1", "2"])


_COUNTDOWN_CASES: list[tuple[object, float, float]] = [
    ("3+5=8, 8*2=16 yes\n#### (3+5)*2", 1.0, 1.0),
    ("#### 2*(5+3)", 1.0, 1.0),
    ([{"role": "assistant", "content": "#### (5+3)*2"}], 1.0, 1.0),
    ("#### 3+5*2", 0.0, 1.0),  # 13
    ("#### (3+5)*2*1", 0.0, 1.0),  # a number that was not given
    ("#### (3+5)*2+2-2", 0.0, 1.0),  # 2 used three times
    ("#### 16", 0.0, 1.0),
    ("#### 5/(3-3)", 0.0, 0.0),  # division by zero
    ("#### 3**2", 0.0, 0.0),
    ("#### -3+5", 0.0, 0.0),
    ("#### __import__('os')", 0.0, 0.0),
    ("#### (3+5)*2\nmore", 0.0, 0.0),
    ("#### (((((", 0.0, 0.0),
    ("#### " + "(" * 150 + "1" + ")" * 150, 0.0, 0.0),
    ("#### 99999999999*99999999999", 0.0, 1.0),
    ("", 0.0, 0.0),
    (None, 0.0, 0.0),
]


def test_countdown_rewards_exact() -> None:
    completions = [c for c, _, _ in _COUNTDOWN_CASES]
    n = len(completions)
    kwargs = {"answer": ["(3+5)*2"] * n, "numbers": [[3, 5, 2]] * n, "target": [16] * n}
    prompts = ["Use 3 5 2 to make 16\n"] * n
    assert countdown_correctness(prompts, completions, **kwargs) == [c for _, c, _ in _COUNTDOWN_CASES]
    assert countdown_format(prompts, completions, **kwargs) == [f for _, _, f in _COUNTDOWN_CASES]
    # without numbers/target columns they are derived from the reference answer
    assert countdown_correctness(prompts, completions, answer=kwargs["answer"]) == [
        c for _, c, _ in _COUNTDOWN_CASES
    ]
    # exact rational arithmetic: 8/3*9 is 24, not 23.999...
    assert countdown_correctness(["p"], ["#### 8/3*9"], answer=["x"], numbers=[[9, 3, 8]], target=[24]) == [
        1.0
    ]
    assert evaluate_expression("8/3") == (Fraction(8, 3), [8, 3])


def test_completion_text_and_final_answer() -> None:
    assert completion_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "a"
    assert completion_text({"role": "assistant", "content": "b"}) == "b"
    assert completion_text(b"bytes") == ""
    assert final_answer("work\n#### 12 \n") == "12"
    assert final_answer("#### 1 #### 2") is None
    assert final_answer("no marker") is None


# ---------------------------------------------------------------- the long tail


def test_sample_detours_law() -> None:
    rng = random.Random(0)
    draws = np.array([sample_detours(rng, p_any=0.2, p_continue=0.75, cap=40) for _ in range(20000)])
    assert abs((draws > 0).mean() - 0.2) < 0.01
    # P(D >= 3 | D >= 1) = 0.75 ** 2
    assert abs((draws >= 3).sum() / (draws >= 1).sum() - 0.5625) < 0.03
    assert draws.max() <= 40
    with pytest.raises(ValueError, match="p_continue"):
        sample_detours(rng, p_any=0.5, p_continue=1.0)


@pytest.mark.parametrize(
    ("name", "difficulty"),
    [
        ("arithmetic", 1), ("countdown", 1), ("arithmetic", 3), ("countdown", 3),
        ("countdown_search", 3), ("countdown_search", 4),
    ],
)
def test_solution_lengths_have_a_long_tail(
    name: str, difficulty: int, tokenizer: PreTrainedTokenizerFast
) -> None:
    task = TASKS[name]
    sft = task.make_sft_dataset(3000, difficulty=difficulty, seed=0)
    lengths = np.array(
        [len(ids) + 1 for ids in tokenizer(list(sft["completion"]), add_special_tokens=False)["input_ids"]]
    )
    p50, p99, top = np.percentile(lengths, 50), np.percentile(lengths, 99), lengths.max()
    assert p99 / p50 >= 5, (p50, p99)
    assert top / p50 >= 10, (p50, top)
    if difficulty == 1:
        assert 20 <= p50 <= 60  # short enough for CPU demos
        # the budget guidance covers 99 % of solutions
        budget = task.max_completion_tokens(difficulty)
        assert budget % 32 == 0 and (lengths <= budget).mean() >= 0.985


@pytest.mark.parametrize("name", ["arithmetic", "countdown", "countdown_search"])
def test_difficulty_stretches_solutions(name: str) -> None:
    task = TASKS[name]
    medians = [
        np.median([len(p.solution) for p in task.problems(400, difficulty=d, seed=0)])
        for d in range(1, task.max_difficulty + 1)
    ]
    assert all(a < b for a, b in zip(medians, medians[1:])), medians
    assert [task.max_completion_tokens(d) for d in (1, 2)] == sorted(
        {task.max_completion_tokens(d) for d in (1, 2)}
    )


@settings(max_examples=150, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from(list("0123456789+-*/() #\n=x.,!") + ["####", "#### ", "\x00", "é", " vs "]), max_size=40
    )
)
def test_rewards_never_raise_on_arbitrary_text(parts: list[str]) -> None:
    text = "".join(parts)
    kwargs = {"answer": ["(3+5)*2"], "numbers": [[3, 5, 2]], "target": [16]}
    for completion in (text, [{"role": "assistant", "content": text}]):
        for reward in (t for name in TASKS for t in TASKS[name].reward_funcs):
            (value,) = reward(["p"], [completion], **kwargs)
            assert value in (0.0, 1.0)
