"""Reward functions of the own-data example, in TRL's signature: the config names them by import path.

TRL calls ``f(prompts=..., completions=..., completion_ids=..., **columns)``: each column of the dataset
other than ``prompt`` arrives as a keyword argument with one value per completion (here ``answer``).
A function returns one float per completion, or ``None`` where it cannot judge (left out of the baseline).
"""

from __future__ import annotations

import re
from typing import Any

_FINAL = re.compile(r"####\s*(-?\d+)\s*$")


def _text(completion: Any) -> str:
    """A completion's text: a string, or (conversational prompts) a list with one assistant message."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def exact_answer(completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 where the completion's last line is ``#### <answer>``, else 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer):
        match = _FINAL.search(_text(completion).strip())
        rewards.append(1.0 if match is not None and match.group(1) == str(expected).strip() else 0.0)
    return rewards


def answer_line(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 where the completion ends with exactly one ``#### <integer>`` line, else 0.0."""
    return [1.0 if _text(c).count("####") == 1 and _FINAL.search(_text(c).strip()) else 0.0 for c in completions]
