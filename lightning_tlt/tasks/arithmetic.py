"""Multi-step integer arithmetic with long-tailed worked solutions.

A problem is an expression such as ``Compute 4+7*2`` (``difficulty + 1`` operations among
``+ - *``, usual precedence). The worked solution reduces it one operation per line, keeping the
rest of the expression in view, and ends with ``#### <value>``::

    7*2=14 -> 4+14
    4+14=18
    #### 18

Some traces take detours (their number drawn by `sample_detours`): a slip that is noticed and
redone (``wait, 7*2=14 not 15``), a check pass that inverts every step (``check: 18-14=4 ...``),
or a full recomputation (``again:``). Harder levels have more operations, larger numbers and
more detours.
"""

from __future__ import annotations

import random
import re
from typing import Any

from lightning_tlt.tasks.base import (
    Problem,
    RewardFunc,
    Task,
    column,
    completion_text,
    final_answer,
    sample_detours,
)

_INT = re.compile(r"-?\d{1,30}")
_MAX_OPERAND = {1: 9, 2: 20, 3: 50, 4: 99, 5: 99}


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _render(tokens: list[Any]) -> str:
    return "".join(str(t) for t in tokens)


def reduction_steps(tokens: list[Any]) -> list[tuple[int, str, int, int, str]]:
    """The steps that evaluate ``[n0, op0, n1, ...]``: ``(a, op, b, result, rest_of_expression)``.

    Multiplications first, left to right, then additions and subtractions left to right.
    """
    tokens = list(tokens)
    steps = []
    while len(tokens) > 1:
        ops = tokens[1::2]
        i = 2 * ops.index("*") + 1 if "*" in ops else 1
        a, op, b = tokens[i - 1], tokens[i], tokens[i + 1]
        r = _apply(a, op, b)
        tokens[i - 1 : i + 2] = [r]
        steps.append((a, op, b, r, _render(tokens)))
    return steps


def _line(a: int, op: str, b: int, r: int, rest: str) -> str:
    return f"{a}{op}{b}={r}" + (f" -> {rest}" if rest != str(r) else "")


def _check(a: int, op: str, b: int, r: int) -> str:
    if op == "+":
        return f"{r}-{b}={a}"
    if op == "-":
        return f"{r}+{b}={a}"
    return f"{r}/{b}={a}" if b != 0 else f"{a}*{b}={r}"


def _computation(
    rng: random.Random, steps: list[tuple[int, str, int, int, str]], slips: set[int]
) -> list[str]:
    """One pass over ``steps``; at each step in ``slips`` a wrong result is written, then corrected."""
    lines = []
    for i, (a, op, b, r, rest) in enumerate(steps):
        if i in slips:
            wrong = r + rng.choice((-2, -1, 1, 2)) * (1 if op != "*" else max(1, min(a, b)))
            lines.append(f"{a}{op}{b}={wrong}")
            lines.append(f"wait, {a}{op}{b}={r} not {wrong}")
        lines.append(_line(a, op, b, r, rest))
    return lines


def _worked_solution(rng: random.Random, tokens: list[Any], difficulty: int) -> str:
    """Reduce ``tokens`` step by step, with a heavy-tailed number of detours (slips, checks, redos)."""
    steps = reduction_steps(tokens)
    n_detours = sample_detours(rng, p_any=min(0.15 + 0.05 * (difficulty - 1), 0.5))
    kinds = [rng.choice(("slip", "slip", "check", "again")) for _ in range(n_detours)]
    extra_passes = [k for k in kinds if k != "slip"]
    n_slips = kinds.count("slip")
    # at most one slip per step of a pass: slips beyond that need another pass ("again:")
    while n_slips > len(steps) * (1 + extra_passes.count("again")):
        extra_passes.append("again")
    slots = [(p, i) for p in range(1 + extra_passes.count("again")) for i in range(len(steps))]
    slipped = rng.sample(slots, n_slips)
    slips_in = [{i for q, i in slipped if q == p} for p in range(1 + extra_passes.count("again"))]
    lines = _computation(rng, steps, slips_in[0])
    n_again = 0
    for kind in extra_passes:
        if kind == "check":
            lines.append(
                "check: " + ", ".join(_check(a, op, b, r) for a, op, b, r, _ in reversed(steps)) + " ok"
            )
        else:
            n_again += 1
            lines.append("again:")
            lines.extend(_computation(rng, steps, slips_in[n_again]))
    lines.append(f"#### {steps[-1][3]}")
    return "\n".join(lines)


class ArithmeticTask(Task):
    """Evaluate ``difficulty + 1`` operations among ``+ - *`` (numbers up to 9, 20, 50, 99, 99)."""

    name = "arithmetic"
    max_difficulty = 5

    def make_problem(self, rng: random.Random, difficulty: int) -> Problem:
        self.check_difficulty(difficulty)
        n_ops = difficulty + 1
        hi = _MAX_OPERAND[difficulty]
        ops = [rng.choice("+-*") for _ in range(n_ops)]
        nums = [rng.randint(1, hi)]
        for op in ops:  # keep products readable: the right factor is a single digit
            nums.append(rng.randint(2, 9) if op == "*" else rng.randint(1, hi))
        tokens: list[Any] = [nums[0]]
        for op, b in zip(ops, nums[1:]):
            tokens += [op, b]
        expression = _render(tokens)
        answer = str(reduction_steps(tokens)[-1][3])
        return Problem(
            statement=f"Compute {expression}",
            answer=answer,
            solution=_worked_solution(rng, tokens, difficulty),
            difficulty=difficulty,
        )

    @property
    def reward_funcs(self) -> list[RewardFunc]:
        return [arithmetic_correctness, arithmetic_format]


def extract_integer(completion: Any) -> int | None:
    """The integer after the single final ``####`` of a completion, or ``None`` if malformed."""
    answer = final_answer(completion_text(completion))
    if answer is None or _INT.fullmatch(answer) is None:
        return None
    return int(answer)


def arithmetic_correctness(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion's final ``#### n`` equals the ``answer`` column, else 0.0 (never raises)."""
    answers = column(kwargs, "answer", len(completions), "arithmetic_correctness")
    rewards = []
    for completion, answer in zip(completions, answers):
        got = extract_integer(completion)
        expected = _INT.fullmatch(str(answer).strip())
        rewards.append(1.0 if got is not None and expected is not None and got == int(str(answer)) else 0.0)
    return rewards


def arithmetic_format(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion ends with one line ``#### <integer>`` (and has no other ``####``), else 0.0."""
    return [0.0 if extract_integer(c) is None else 1.0 for c in completions]
