"""Synthetic, verifiable reasoning tasks with long-tailed worked solutions.

``TASKS`` maps a name to a `Task`; each gives TRL datasets (prompt-only and prompt-completion,
plain or conversational), worked solutions for the SFT warm start and TRL reward functions
(``task.reward_funcs``: correctness, format).

Example::

    task = get_task("arithmetic")
    train = task.make_dataset(1000, difficulty=1, seed=0)  # columns: prompt, answer, difficulty
    GRPOTrainer(..., reward_funcs=task.reward_funcs, train_dataset=train)
"""

from __future__ import annotations

from lightning_tlt.tasks.arithmetic import ArithmeticTask, arithmetic_correctness, arithmetic_format
from lightning_tlt.tasks.base import (
    Problem,
    Task,
    completion_text,
    final_answer,
    sample_detours,
    split_of,
)
from lightning_tlt.tasks.countdown import CountdownTask, countdown_correctness, countdown_format
from lightning_tlt.tasks.search import (
    CountdownSearchTask,
    countdown_search_correctness,
    countdown_search_format,
)

TASKS: dict[str, Task] = {task.name: task for task in (ArithmeticTask(), CountdownTask(), CountdownSearchTask())}
"""The registered tasks by name."""


def get_task(name: str | Task) -> Task:
    """The task registered as ``name`` (a `Task` passes through)."""
    if isinstance(name, Task):
        return name
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {sorted(TASKS)}")
    return TASKS[name]


__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CountdownSearchTask",
    "CountdownTask",
    "Problem",
    "Task",
    "arithmetic_correctness",
    "arithmetic_format",
    "completion_text",
    "countdown_correctness",
    "countdown_format",
    "countdown_search_correctness",
    "countdown_search_format",
    "final_answer",
    "get_task",
    "sample_detours",
    "split_of",
]
