"""Countdown: combine the given numbers with ``+ - * /`` to reach a target (each number once).

Prompt: ``Use 3 5 2 to make 16``. The worked solution is a search: each line is one attempt
that combines two numbers at a time until one is left, marked ``no`` when it misses the target
and ``yes`` when it hits it; the last line gives the expression::

    5-3=2, 2*2=4 no
    3+5=8, 8*2=16 yes
    #### (3+5)*2

The number of failed attempts before the hit is heavy-tailed (`sample_detours`), so a few
searches wander ten or more times longer than the median one. Harder levels use more and
larger numbers and wander more.

Answers are checked exactly, with fractions: every given number used exactly once, only
``+ - * /`` and parentheses, the value equal to the target. Division by zero, unary minus,
powers, unknown numbers and garbage score 0 and never raise.
"""

from __future__ import annotations

import ast
import random
import re
from fractions import Fraction
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

_MAX_NUMBER = {1: 9, 2: 15, 3: 25, 4: 50}
_MAX_TARGET = 999
_EXPRESSION_CHARS = re.compile(r"[0-9+\-*/() ]{1,200}")
_Item = tuple[int, str, str]  # (value, expression, its top-level operator or "" for a number)


def _operand(item: _Item, op: str, side: str) -> str:
    """``item``'s expression as an operand of ``op``, parenthesized only where precedence needs it."""
    _, expression, top = item
    if not top:
        return expression
    if side == "left":
        needs = op in "*/" and top in "+-"
    else:
        needs = (op in "-*" and top in "+-") or op == "/"
    return f"({expression})" if needs else expression


def _combine(rng: random.Random, a: _Item, b: _Item) -> tuple[str, _Item]:
    """One random legal step on ``a`` and ``b``: positive integer results, no trivial * or /."""
    va, vb = a[0], b[0]
    choices = ["+"]
    if va > vb:
        choices.append("-")
    if va > 1 and vb > 1:
        choices.append("*")
    if vb > 1 and va % vb == 0:
        choices.append("/")
    op = rng.choice(choices)
    value = va + vb if op == "+" else va - vb if op == "-" else va * vb if op == "*" else va // vb
    expression = _operand(a, op, "left") + op + _operand(b, op, "right")
    return f"{va}{op}{vb}={value}", (value, expression, op)


def _attempt(rng: random.Random, numbers: list[int]) -> tuple[list[str], _Item]:
    """A random full attempt: combine two numbers at a time until one is left."""
    pool: list[_Item] = [(n, str(n), "") for n in numbers]
    steps = []
    while len(pool) > 1:
        i, j = rng.sample(range(len(pool)), 2)
        a, b = pool[i], pool[j]
        if a[0] < b[0] and rng.random() < 0.8:  # mostly put the larger first, as people do
            a, b = b, a
        line, item = _combine(rng, a, b)
        steps.append(line)
        pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [item]
    return steps, pool[0]


class CountdownTask(Task):
    """Reach a target from ``difficulty + 2`` numbers (up to 9, 15, 25, 50) with ``+ - * /``."""

    name = "countdown"
    max_difficulty = 4

    def make_problem(self, rng: random.Random, difficulty: int) -> Problem:
        self.check_difficulty(difficulty)
        n = difficulty + 2
        hi = _MAX_NUMBER[difficulty]
        while True:
            numbers = [rng.randint(1, hi) for _ in range(n)]
            steps, (target, expression, _) = _attempt(rng, numbers)
            if 2 <= target <= _MAX_TARGET and target not in numbers:
                break
        lines = []
        n_failures = sample_detours(rng, p_any=min(0.35 + 0.1 * (difficulty - 1), 0.65), p_continue=0.85)
        for _ in range(n_failures):
            tried, (value, tried_expression, _) = _attempt(rng, numbers)
            if value == target:  # a lucky hit is a valid solution too: the search ends there
                steps, expression = tried, tried_expression
                break
            lines.append(", ".join(tried) + " no")
        lines.append(", ".join(steps) + " yes")
        lines.append(f"#### {expression}")
        return Problem(
            statement=f"Use {' '.join(map(str, numbers))} to make {target}",
            answer=expression,
            solution="\n".join(lines),
            difficulty=difficulty,
            extra={"numbers": numbers, "target": target},
        )

    @property
    def reward_funcs(self) -> list[RewardFunc]:
        return [countdown_correctness, countdown_format]


def evaluate_expression(expression: str) -> tuple[Fraction, list[int]] | None:
    """Exact value and the numbers of an expression of ints, ``+ - * /`` and parentheses.

    Returns ``None`` for anything else (unary signs, powers, names, division by zero, garbage).
    """
    if _EXPRESSION_CHARS.fullmatch(expression) is None:
        return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    numbers: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            numbers.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Add):
                return left + right
            if isinstance(node.op, ast.Sub):
                return left - right
            if isinstance(node.op, ast.Mult):
                return left * right
            if right == 0:
                raise ZeroDivisionError
            return left / right
        raise ValueError(f"unsupported node {type(node).__name__}")

    try:
        value = walk(tree.body)
    except (ZeroDivisionError, ValueError, RecursionError):
        return None
    return value, numbers


def _expected(answer: Any, numbers: Any, target: Any) -> tuple[list[int], Fraction] | None:
    """The given numbers and target of one row; derived from the reference ``answer`` when absent."""
    try:
        if numbers is not None and target is not None:
            return sorted(int(x) for x in numbers), Fraction(int(target))
        reference = evaluate_expression(str(answer))
        if reference is None:
            return None
        return sorted(reference[1]), reference[0]
    except (TypeError, ValueError):
        return None


def countdown_correctness(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the final ``#### expr`` uses each given number once and equals the target, else 0.0.

    Reads the ``numbers`` and ``target`` columns, or derives them from the reference ``answer``
    column (an expression) when those are absent. Never raises on a malformed completion.
    """
    n = len(completions)
    answers = column(kwargs, "answer", n, "countdown_correctness")
    numbers_col = kwargs.get("numbers") or [None] * n
    target_col = kwargs.get("target") or [None] * n
    rewards = []
    for completion, answer, numbers, target in zip(completions, answers, numbers_col, target_col):
        expected = _expected(answer, numbers, target)
        expression = final_answer(completion_text(completion))
        got = evaluate_expression(expression) if expression is not None else None
        ok = (
            expected is not None
            and got is not None
            and sorted(got[1]) == expected[0]
            and got[0] == expected[1]
        )
        rewards.append(1.0 if ok else 0.0)
    return rewards


def countdown_format(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion ends with one line ``#### <expression>`` that evaluates, else 0.0."""
    rewards = []
    for completion in completions:
        expression = final_answer(completion_text(completion))
        rewards.append(1.0 if expression is not None and evaluate_expression(expression) is not None else 0.0)
    return rewards
