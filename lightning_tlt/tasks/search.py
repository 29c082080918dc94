"""Countdown as a written-out search: the long-tail reasoning workload (Stream of Search style).

Prompt: ``Use 3 6 1 to make 17`` (reach the target with ``+ - * /``, every number used once).
The worked solution is the depth-first search written out, in the spirit of Stream of Search
(Gandhi et al. 2024, arXiv 2404.03683): every line is one node of the search tree, a step on two
of the numbers left followed by the numbers left after it; a deeper indent is a step below its
parent and a return to a shallower indent is backtracking; when one number is left it is compared
with the target (``vs 17``) and the hit is marked ``!``. The final line repeats the path that
hit::

    6+3=9 1 9
     9+1=10 vs 17
     9-1=8 vs 17
    6-3=3 1 3
     3+1=4 vs 17
     3-1=2 vs 17
    6*3=18 1 18
     18+1=19 vs 17
     18-1=17 vs 17 !
    #### 6*3=18,18-1=17

The search tries pairs in the order of the numbers left and operations in the order ``+ - * /``
(a fixed order a small model can follow), so the length of a solution is the number of nodes
visited before the first hit: short when the target has many solutions, long when it has few, a
heavy tail that comes from the search itself (the long tail TLT attacks, arXiv 2511.16665,
Sec. 2). Some worked solutions are abandoned searches (`SearchLevel.give_up`): they stop at a
miss and answer it, wrong, as the unsuccessful searches Stream of Search trains on. A
warm-started policy inherits that habit, which keeps its correctness well below 1 and gives RL
something to learn: to keep searching (and so to write longer). The format is compact in
characters (the kit's tokenizer has one token per character).

Correctness reads only the final line: every step ``a<op>b=c`` must combine two numbers still
available (the given ones, then results), compute ``c`` exactly (division only when exact), and
the last number left must be the target, every given number used once. Nothing a completion can
hold makes the rewards raise.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from lightning_tlt.tasks.base import Problem, RewardFunc, Task, column, completion_text, final_answer


@dataclass(frozen=True)
class SearchLevel:
    """What one difficulty level of `CountdownSearchTask` draws."""

    numbers: int
    """How many numbers are given (the search tree's depth is one less)."""
    max_number: int
    """Numbers are drawn uniformly from ``1..max_number``."""
    ops: str = "+-*/"
    """The operations the search tries, in this order."""
    give_up: float = 0.5
    """Share of worked solutions (among those with a miss before the hit) that abandon the search
    and answer a miss: a wrong guess, as in the unsuccessful searches Stream of Search trains on."""
    abandon: Literal["first", "random"] = "random"
    """Where an abandoned search stops: at its first miss (a one-shot guess) or at a random miss."""

    def __post_init__(self) -> None:
        if self.numbers < 2 or self.max_number < 2:
            raise ValueError(f"need numbers >= 2 and max_number >= 2, got {self.numbers!r}, {self.max_number!r}")
        if not self.ops or set(self.ops) - set("+-*/") or len(set(self.ops)) != len(self.ops):
            raise ValueError(f"ops must be distinct characters of '+-*/', got {self.ops!r}")
        if not 0.0 <= self.give_up < 1.0:
            raise ValueError(f"give_up must be in [0, 1), got {self.give_up!r}")
        if self.abandon not in ("first", "random"):
            raise ValueError(f"abandon must be 'first' or 'random', got {self.abandon!r}")


SEARCH_LEVELS: dict[int, SearchLevel] = {
    1: SearchLevel(3, 5, "+-", abandon="first"),  # the CPU demo: a tiny model learns it in a minute or two
    2: SearchLevel(3, 9, abandon="first"),
    3: SearchLevel(4, 5, give_up=0.4),  # the GPU workload (benchmarks/e2e.py, configs/grpo_gpu_*.yaml)
    4: SearchLevel(4, 9, give_up=0.4),  # p50 of a few hundred tokens, a tail of thousands (0.5 B: correctness 0 after SFT)
    5: SearchLevel(4, 20, give_up=0.4),
}
"""Difficulty levels: more numbers make the tree deeper (and the tail far longer), larger ones
make hits rarer."""

MAX_TARGET = 999
"""Targets lie in ``2..MAX_TARGET`` and are never one of the given numbers."""

_STEP = re.compile(r"(\d{1,9})([-+*/])(\d{1,9})=(\d{1,20})")


def _ops(a: int, b: int, ops: str) -> list[tuple[str, int]]:
    """The legal steps on ``a >= b`` among ``ops``: positive integer results, no multiplying or dividing by 1."""
    legal = {
        "+": a + b,
        "-": a - b if a > b else None,
        "*": a * b if b > 1 else None,
        "/": a // b if b > 1 and a % b == 0 else None,
    }
    return [(op, c) for op in ops if (c := legal[op]) is not None]


def _moves(pool: list[int], ops: str) -> list[tuple[str, list[int]]]:
    """Every step on two numbers of ``pool`` as ``(line, numbers left)``, in the search's order.

    Pairs in the order of the pool (left to right, a result joins at the end), then ``+ - * /``.
    """
    moves = []
    for i in range(len(pool)):
        for j in range(i + 1, len(pool)):
            a, b = max(pool[i], pool[j]), min(pool[i], pool[j])
            rest = [x for k, x in enumerate(pool) if k not in (i, j)]
            for op, c in _ops(a, b, ops):
                moves.append((f"{a}{op}{b}={c}", [*rest, c]))
    return moves


@dataclass(frozen=True)
class SearchNode:
    """One line of a search trace."""

    line: str
    """The line as written: indent (the depth), step, then the numbers left (inner node) or
    ``" vs <target>"``, followed by ``" !"`` on a hit (leaf)."""
    path: tuple[str, ...]
    """The steps from the root to this node."""
    hit: bool | None
    """At a leaf (one number left): whether it is the target; ``None`` at an inner node."""


def search_nodes(numbers: list[int], target: int, ops: str = "+-*/") -> list[SearchNode]:
    """The depth-first search from ``numbers`` to ``target``, node by node, up to the first hit.

    Every visited node is one line, indented by its depth; inner nodes list the numbers left
    after their step, leaves (one number left) compare it with the target and are marked
    ``" !"`` on a hit, where the search stops. Without a hit the whole tree is returned.
    """
    nodes: list[SearchNode] = []

    def visit(pool: list[int], path: tuple[str, ...]) -> bool:
        indent = " " * len(path)
        for step, rest in _moves(pool, ops):
            here = (*path, step)
            if len(rest) == 1:
                hit = rest[0] == target
                nodes.append(SearchNode(indent + step + f" vs {target}" + (" !" if hit else ""), here, hit))
                if hit:
                    return True
                continue
            nodes.append(SearchNode(indent + step + " " + " ".join(map(str, rest)), here, None))
            if visit(rest, here):
                return True
        return False

    visit(list(numbers), ())
    return nodes


def _random_target(rng: random.Random, numbers: list[int], ops: str) -> int:
    """The result of a random sequence of steps using every number (so a solution exists)."""
    pool = list(numbers)
    while len(pool) > 1:
        pool = rng.choice(_moves(pool, ops))[1]
    return pool[0]


class CountdownSearchTask(Task):
    """Countdown whose worked solution is the whole depth-first search (see the module docstring)."""

    name = "countdown_search"
    max_difficulty = max(SEARCH_LEVELS)

    def make_problem(self, rng: random.Random, difficulty: int) -> Problem:
        self.check_difficulty(difficulty)
        level = SEARCH_LEVELS[difficulty]
        while True:
            numbers = [rng.randint(1, level.max_number) for _ in range(level.numbers)]
            target = _random_target(rng, numbers, level.ops)
            if 2 <= target <= MAX_TARGET and target not in numbers:
                break
        nodes = search_nodes(numbers, target, level.ops)
        assert nodes[-1].hit, "a target made from the numbers is always reachable"
        answer = ",".join(nodes[-1].path)
        misses = [i for i, node in enumerate(nodes) if node.hit is False]
        if misses and rng.random() < level.give_up:  # an abandoned search answers the miss it stops at
            nodes = nodes[: (misses[0] if level.abandon == "first" else rng.choice(misses)) + 1]
        lines = [node.line for node in nodes]
        return Problem(
            statement=f"Use {' '.join(map(str, numbers))} to make {target}",
            answer=answer,
            solution="\n".join([*lines, "#### " + ",".join(nodes[-1].path)]),
            difficulty=difficulty,
            extra={"numbers": numbers, "target": target},
        )

    @property
    def reward_funcs(self) -> list[RewardFunc]:
        return [countdown_search_correctness, countdown_search_format]


def parse_steps(answer: str) -> list[tuple[int, str, int, int]] | None:
    """The steps ``(a, op, b, c)`` of a final answer ``a<op>b=c,...``; ``None`` if it is not that."""
    parts = [p.strip() for p in answer.split(",")]
    if not 1 <= len(parts) <= 16:
        return None
    steps = []
    for part in parts:
        match = _STEP.fullmatch(part)
        if match is None:
            return None
        a, op, b, c = match.groups()
        steps.append((int(a), op, int(b), int(c)))
    return steps


def check_steps(steps: list[tuple[int, str, int, int]], numbers: list[int], target: int) -> bool:
    """Whether ``steps`` turn ``numbers`` (each used once) into ``target``, with exact arithmetic."""
    pool = Counter(numbers)
    for a, op, b, c in steps:
        if op == "+":
            ok = a + b == c
        elif op == "-":
            ok = a - b == c
        elif op == "*":
            ok = a * b == c
        else:
            ok = b != 0 and a == b * c
        need = Counter([a, b])
        if not ok or need - pool:
            return False
        pool = pool - need + Counter([c])
    return pool == Counter([target])


def _given(numbers: Any, target: Any) -> tuple[list[int], int] | None:
    try:
        return [int(x) for x in numbers], int(target)
    except (TypeError, ValueError):
        return None


def countdown_search_correctness(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the final ``#### a<op>b=c,...`` reaches the target from the given numbers, else 0.0.

    Reads the ``numbers`` and ``target`` columns; never raises on a malformed completion.
    """
    n = len(completions)
    numbers_col = column(kwargs, "numbers", n, "countdown_search_correctness")
    target_col = column(kwargs, "target", n, "countdown_search_correctness")
    rewards = []
    for completion, numbers, target in zip(completions, numbers_col, target_col):
        given = _given(numbers, target)
        answer = final_answer(completion_text(completion))
        steps = parse_steps(answer) if answer is not None else None
        rewards.append(1.0 if given is not None and steps is not None and check_steps(steps, *given) else 0.0)
    return rewards


def countdown_search_format(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 when the completion ends with one line ``#### a<op>b=c,...`` (well-formed steps), else 0.0."""
    answers = [final_answer(completion_text(c)) for c in completions]
    return [0.0 if a is None or parse_steps(a) is None else 1.0 for a in answers]
