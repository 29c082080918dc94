"""What every synthetic task shares: problems, worked solutions, TRL datasets, reward plumbing.

A task draws `Problem` s from an explicit ``random.Random`` (never the global one). Each problem
carries a statement (the prompt), a reference answer and a worked solution that reads like a
reasoning trace and ends with the final-answer line ``#### <answer>``. The number of detours in
a trace (re-checks, backtracking, dead ends) is drawn from a heavy-tailed law (`sample_detours`),
so most traces are short and a few are ten or more times longer: the long tail of rollout
lengths that "Taming the Long-Tail" (arXiv 2511.16665, Sec. 2) attacks.

Prompts are split into a train and a held-out test partition by a hash of the statement, so a
model trained on ``split="train"`` is evaluated on problems it never saw.
"""

from __future__ import annotations

import math
import random
import re
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Literal

from lightning_tlt.models.tokenizer import completion_text  # noqa: F401  (re-exported: the tasks' rewards read it)

if TYPE_CHECKING:  # imported where used: problems and rewards work without `datasets` installed
    from datasets import Dataset

Split = Literal["train", "test"]
RewardFunc = Callable[..., list[float]]

ANSWER_MARKER = "####"
"""The final line of every worked solution is ``#### <answer>`` (GSM8K's convention)."""

TEST_FRACTION_MOD = 10
"""One statement in ``TEST_FRACTION_MOD`` (by CRC32) belongs to the held-out test split."""

_FINAL_LINE = re.compile(r"(?:^|\n)####[ ]?([^\n]*)\s*$")


@dataclass(frozen=True)
class Problem:
    """One task instance with its worked solution."""

    statement: str
    """The question, without trailing newline (the user message of the conversational form)."""
    answer: str
    """The reference final answer (what follows ``#### `` in a correct solution)."""
    solution: str
    """A worked solution (reasoning trace) ending with ``#### <answer>``."""
    difficulty: int
    """The difficulty level it was drawn at."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Task-specific dataset columns (e.g. countdown's ``numbers`` and ``target``)."""

    @property
    def prompt(self) -> str:
        """The plain-text prompt: the statement and a newline (the completion starts a new line)."""
        return self.statement + "\n"


def sample_detours(rng: random.Random, p_any: float, p_continue: float = 0.75, cap: int = 40) -> int:
    """Number of detours in one trace: 0 with probability ``1 - p_any``, else ``1 + Geometric``.

    ``P(D >= k) = p_any * p_continue ** (k - 1)`` for ``1 <= k <= cap``: a geometric tail slow
    enough that the 99th percentile of trace lengths is several times the median.
    """
    if not 0.0 <= p_any <= 1.0 or not 0.0 <= p_continue < 1.0:
        raise ValueError(f"need 0 <= p_any <= 1 and 0 <= p_continue < 1, got {p_any!r}, {p_continue!r}")
    if rng.random() >= p_any:
        return 0
    d = 1
    while d < cap and rng.random() < p_continue:
        d += 1
    return d


def split_of(statement: str) -> Split:
    """The partition a statement belongs to: ``"test"`` for one in `TEST_FRACTION_MOD` (by CRC32)."""
    return "test" if zlib.crc32(statement.encode()) % TEST_FRACTION_MOD == 0 else "train"


def final_answer(text: str) -> str | None:
    """What follows the single ``####`` marker on the last line of ``text``, or ``None``.

    The format is strict: exactly one ``####`` in the text, on its last non-blank line.
    """
    if text.count(ANSWER_MARKER) != 1:
        return None
    match = _FINAL_LINE.search(text)
    if match is None:
        return None
    return match.group(1).strip()


def column(kwargs: Mapping[str, Any], name: str, n: int, reward: str) -> list[Any]:
    """Column ``name`` of the reward kwargs (TRL passes every dataset column), checked to have ``n`` rows."""
    values = kwargs.get(name)
    if values is None:
        raise ValueError(
            f"{reward} needs the dataset column {name!r} (TRL passes dataset columns as keyword "
            f"arguments); got columns {sorted(kwargs)}"
        )
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{reward}: column {name!r} has {len(values)} rows for {n} completions")
    return values


class Task(ABC):
    """A synthetic, verifiable reasoning task with long-tailed worked solutions."""

    name: str = ""
    """Registry key; also the prefix of the reward functions' names."""
    max_difficulty: int = 5
    """Highest difficulty level (levels run from 1)."""

    @abstractmethod
    def make_problem(self, rng: random.Random, difficulty: int) -> Problem:
        """Draw one problem and its worked solution at ``difficulty``."""

    @property
    @abstractmethod
    def reward_funcs(self) -> list[RewardFunc]:
        """``[correctness, format]`` rewards with TRL's signature ``f(prompts, completions, **kwargs)``."""

    def check_difficulty(self, difficulty: int) -> int:
        if not isinstance(difficulty, int) or not 1 <= difficulty <= self.max_difficulty:
            raise ValueError(
                f"{self.name}: difficulty must be an int in [1, {self.max_difficulty}], got {difficulty!r}"
            )
        return difficulty

    def problems(self, n: int, *, difficulty: int, seed: int, split: Split = "train") -> list[Problem]:
        """``n`` problems of ``split`` drawn with ``random.Random(seed)`` (repeats possible)."""
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n!r}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.check_difficulty(difficulty)
        rng = random.Random(f"{self.name}/{difficulty}/{seed}/{split}")
        out: list[Problem] = []
        while len(out) < n:
            problem = self.make_problem(rng, difficulty)
            if split_of(problem.statement) == split:
                out.append(problem)
        return out

    def make_dataset(
        self, n: int, *, difficulty: int, seed: int, conversational: bool = False, split: Split = "train"
    ) -> Dataset:
        """A TRL prompt-only dataset: ``prompt`` (str, or user message list), ``answer``, ``difficulty``, extras."""
        rows = []
        for p in self.problems(n, difficulty=difficulty, seed=seed, split=split):
            prompt: Any = [{"role": "user", "content": p.statement}] if conversational else p.prompt
            rows.append({"prompt": prompt, "answer": p.answer, "difficulty": p.difficulty, **p.extra})
        return _from_rows(rows, ["prompt", "answer", "difficulty"])

    def make_sft_dataset(
        self, n: int, *, difficulty: int, seed: int, conversational: bool = False, split: Split = "train"
    ) -> Dataset:
        """A TRL prompt-completion dataset of worked solutions: ``prompt``, ``completion``, ``answer``, ..."""
        rows = []
        for p in self.problems(n, difficulty=difficulty, seed=seed, split=split):
            if conversational:
                prompt: Any = [{"role": "user", "content": p.statement}]
                completion: Any = [{"role": "assistant", "content": p.solution}]
            else:
                prompt, completion = p.prompt, p.solution
            rows.append(
                {
                    "prompt": prompt,
                    "completion": completion,
                    "answer": p.answer,
                    "difficulty": p.difficulty,
                    **p.extra,
                }
            )
        return _from_rows(rows, ["prompt", "completion", "answer", "difficulty"])

    def max_completion_tokens(self, difficulty: int, quantile: float = 0.99) -> int:
        """Guidance for ``max_completion_length``: the ``quantile`` of solution lengths (+1 for eos).

        Measured on 2,000 solutions (seed 0) with the character tokenizer (one token per
        character), rounded up to a multiple of 32. Longer tails are then truncated (clipped).
        """
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")
        self.check_difficulty(difficulty)
        return _length_quantile(self, difficulty, quantile)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, max_difficulty={self.max_difficulty})"


@lru_cache(maxsize=64)
def _length_quantile(task: Task, difficulty: int, quantile: float) -> int:
    lengths = sorted(len(p.solution) + 1 for p in task.problems(2000, difficulty=difficulty, seed=0))
    value = lengths[min(len(lengths) - 1, math.ceil(quantile * len(lengths)) - 1)]
    return int(math.ceil(value / 32) * 32)


def _from_rows(rows: list[dict[str, Any]], columns: list[str]) -> Dataset:
    from datasets import Dataset

    if not rows:
        return Dataset.from_dict({c: [] for c in columns})
    return Dataset.from_list(rows)
