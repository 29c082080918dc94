"""countdown_search: the written-out search, its abandoned searches, exact rewards, never raising."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_tlt.tasks import TASKS, countdown_search_correctness, countdown_search_format
from lightning_tlt.tasks.search import (
    SEARCH_LEVELS,
    CountdownSearchTask,
    SearchLevel,
    check_steps,
    parse_steps,
    search_nodes,
)

# the module docstring's example, worked by hand: pairs left to right, then + - * /
SEARCH_3_6_1_TO_17 = [
    "6+3=9 1 9",
    " 9+1=10 vs 17",
    " 9-1=8 vs 17",
    "6-3=3 1 3",
    " 3+1=4 vs 17",
    " 3-1=2 vs 17",
    "6*3=18 1 18",
    " 18+1=19 vs 17",
    " 18-1=17 vs 17 !",
]


def test_search_nodes_by_hand() -> None:
    nodes = search_nodes([3, 6, 1], 17)
    assert [n.line for n in nodes] == SEARCH_3_6_1_TO_17
    assert nodes[-1].hit is True and nodes[-1].path == ("6*3=18", "18-1=17")
    assert [n.hit for n in nodes] == [None, False, False, None, False, False, None, False, True]
    assert nodes[1].path == ("6+3=9", "9+1=10")
    # "/" only when exact, "-" only to a positive result, no "* 1" or "/ 1"; without a hit, the whole tree
    assert [n.line for n in search_nodes([4, 2], 99)] == ["4+2=6 vs 99", "4-2=2 vs 99", "4*2=8 vs 99", "4/2=2 vs 99"]
    assert [n.line for n in search_nodes([3, 3], 99, ops="+-")] == ["3+3=6 vs 99"]
    assert [n.line for n in search_nodes([5, 1], 99)] == ["5+1=6 vs 99", "5-1=4 vs 99"]


def test_four_numbers_nest_and_backtrack() -> None:
    nodes = search_nodes([1, 2, 3, 4], 24, ops="+*")
    depths = [len(n.line) - len(n.line.lstrip(" ")) for n in nodes]
    assert depths[:4] == [0, 1, 2, 2]  # 2+1=3 3 4 3, then 4+3=7 3 7, then its two leaves
    assert nodes[0].line == "2+1=3 3 4 3" and nodes[1].line == " 4+3=7 3 7"
    assert max(depths) == 2 and nodes[-1].line.endswith("vs 24 !")
    assert check_steps(parse_steps(",".join(nodes[-1].path)) or [], [1, 2, 3, 4], 24)


def test_problems_solutions_and_abandoned_searches() -> None:
    task = TASKS["countdown_search"]
    assert isinstance(task, CountdownSearchTask) and task.max_difficulty == len(SEARCH_LEVELS) == 5
    for difficulty in (1, 2, 3):
        level = SEARCH_LEVELS[difficulty]
        problems = task.problems(600, difficulty=difficulty, seed=0)
        abandoned = with_miss = 0
        for p in problems:
            numbers, target = p.extra["numbers"], p.extra["target"]
            assert len(numbers) == level.numbers and max(numbers) <= level.max_number
            assert 2 <= target <= 999 and target not in numbers
            assert p.statement == f"Use {' '.join(map(str, numbers))} to make {target}"
            full = [n.line for n in search_nodes(numbers, target, level.ops)]
            lines = p.solution.split("\n")
            assert lines[:-1] == full[: len(lines) - 1]  # a prefix of the search, cut at a leaf
            assert check_steps(parse_steps(p.answer) or [], numbers, target)  # the reference path hits
            given = parse_steps(lines[-1].removeprefix("#### "))
            assert given is not None and lines[-1].startswith("#### ")
            with_miss += full[0] != lines[0] or any(" vs " in x and not x.endswith("!") for x in full[:-1])
            if lines[-2].endswith(" !"):
                assert lines[-1] == f"#### {p.answer}"
            else:  # an abandoned search answers the miss it stopped at: right format, wrong answer
                abandoned += 1
                assert check_steps(given, numbers, target) is False
                if level.abandon == "first":
                    assert sum(" vs " in x for x in lines[:-1]) == 1
        # give_up of the searches that miss before they hit are abandoned (binomial, 4 sigma)
        assert abs(abandoned - level.give_up * with_miss) < 4 * (with_miss * 0.25) ** 0.5, (abandoned, with_miss)


def test_rewards_of_worked_solutions() -> None:
    task = TASKS["countdown_search"]
    sft = task.make_sft_dataset(400, difficulty=2, seed=1)
    assert sft.column_names == ["prompt", "completion", "answer", "difficulty", "numbers", "target"]
    columns = {k: sft[k] for k in ("answer", "numbers", "target")}
    correct = countdown_search_correctness(sft["prompt"], sft["completion"], **columns)
    assert countdown_search_format(sft["prompt"], sft["completion"], **columns) == [1.0] * 400
    finished = [c.split("\n")[-2].endswith(" !") for c in sft["completion"]]
    assert correct == [1.0 if f else 0.0 for f in finished]
    assert 0.4 < sum(correct) / 400 < 0.8  # abandoned searches leave room to learn


_CASES: list[tuple[object, float, float]] = [
    ("6+3=9 1 9\n 18-1=17 vs 17 !\n#### 6*3=18,18-1=17", 1.0, 1.0),
    ("#### 6*3=18,18-1=17", 1.0, 1.0),
    ("#### 6*3=18, 18-1=17\n", 1.0, 1.0),
    ("#### 3*6=18,18-1=17", 1.0, 1.0),  # operand order is free
    ("#### 6+1=7,7+3=10", 0.0, 1.0),  # valid steps, wrong target
    ("#### 6*3=18,18-1=16", 0.0, 1.0),  # arithmetic slip
    ("#### 6*3=18", 0.0, 1.0),  # a number left over
    ("#### 6*3=18,18-1=17,17+1=18", 0.0, 1.0),  # 1 used twice
    ("#### 6*3=18,18-2=16", 0.0, 1.0),  # 2 was not given
    ("#### 6/3=2,2+1=3", 0.0, 1.0),
    ("#### 7/2=3,3+1=4", 0.0, 1.0),  # inexact division is never right
    ("#### 6*3=18,18-1=17 !", 0.0, 0.0),
    ("#### (6*3)-1", 0.0, 0.0),  # an expression is not the answer format
    ("#### 17", 0.0, 0.0),
    ("#### 6*3=18,,18-1=17", 0.0, 0.0),
    ("#### -6*3=18", 0.0, 0.0),
    ("#### 6*3=18\n#### 18-1=17", 0.0, 0.0),
    ("#### " + ",".join(["1+1=2"] * 17), 0.0, 0.0),  # more steps than any level has
    ("#### 999999999*999999999=999999998000000001", 0.0, 1.0),
    ("", 0.0, 0.0),
    (None, 0.0, 0.0),
    ([{"role": "assistant", "content": "#### 6*3=18,18-1=17"}], 1.0, 1.0),
]


def test_rewards_exact() -> None:
    completions = [c for c, _, _ in _CASES]
    n = len(completions)
    kwargs = {"answer": ["6*3=18,18-1=17"] * n, "numbers": [[3, 6, 1]] * n, "target": [17] * n}
    assert countdown_search_correctness(["p"] * n, completions, **kwargs) == [c for _, c, _ in _CASES]
    assert countdown_search_format(["p"] * n, completions, **kwargs) == [f for _, _, f in _CASES]
    # unusable columns score 0 rather than raise; missing columns are an error naming them
    bad = {"answer": ["x"] * 3, "numbers": [None, "3 6 1", [3, "six", 1]], "target": [17, 17, 17]}
    assert countdown_search_correctness(["p"] * 3, ["#### 6*3=18,18-1=17"] * 3, **bad) == [0.0] * 3
    with pytest.raises(ValueError, match="needs the dataset column 'numbers'"):
        countdown_search_correctness(["p"], ["#### 1+1=2"], answer=["1+1=2"], target=[2])


@settings(max_examples=200, deadline=None)
@given(
    parts=st.lists(
        st.sampled_from(["6", "3", "1", "18", "17", "0", "+", "-", "*", "/", "=", ",", " ", "\n", "!", "vs",
                         "#### ", "####", "6*3=18", "18-1=17", "99999999999999", "\x00", "é"]),
        max_size=30,
    ),
    numbers=st.lists(st.integers(-3, 50), max_size=5),
    target=st.integers(-5, 1000),
)
def test_rewards_never_raise(parts: list[str], numbers: list[int], target: int) -> None:
    text = "".join(parts)
    for completion in (text, [{"role": "assistant", "content": text}]):
        for reward in TASKS["countdown_search"].reward_funcs:
            (value,) = reward(["p"], [completion], answer=["x"], numbers=[numbers], target=[target])
            assert value in (0.0, 1.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"numbers": 1, "max_number": 5}, r"need numbers >= 2 and max_number >= 2, got 1, 5"),
        ({"numbers": 3, "max_number": 5, "ops": "+^"}, r"ops must be distinct characters of '\+-\*/', got '\+\^'"),
        ({"numbers": 3, "max_number": 5, "ops": "++"}, "ops must be distinct"),
        ({"numbers": 3, "max_number": 5, "give_up": 1.0}, r"give_up must be in \[0, 1\), got 1.0"),
        ({"numbers": 3, "max_number": 5, "abandon": "last"}, "abandon must be 'first' or 'random', got 'last'"),
    ],
)
def test_bad_levels(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SearchLevel(**kwargs)


def test_lengths_grow_with_difficulty_and_fit_the_gpu_workload() -> None:
    """The GPU workload's level (4) has the tail the issue asks of rollouts: p50 >= 300, p99 >= 2,500."""
    task = TASKS["countdown_search"]
    lengths = np.array([len(p.solution) + 1 for p in task.problems(1500, difficulty=4, seed=0)])
    assert np.percentile(lengths, 50) >= 300 and np.percentile(lengths, 99) >= 2500
    assert (lengths > 4096).mean() > 0.01  # some reach a 4,096-token cap
