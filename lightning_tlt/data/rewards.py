"""Calling TRL-signature reward functions, with TRL's conventions and errors that say what broke.

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns)``
and returns one float (or ``None``) per completion; ``columns`` are the dataset's other columns,
one value per completion. Functions may be ``async``. ``None`` becomes NaN: left out of means
and baselines, never scored as zero (TRL 1.16's ``_calculate_rewards``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)

RewardFunc = Callable[..., Any]
OnRewardError = Literal["raise", "skip"]


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function, the prompt and the completion."""


def reward_func_name(func: RewardFunc) -> str:
    """The name TRL logs a reward function under (``rewards/<name>/mean``)."""
    name = getattr(func, "__name__", None)
    return str(name) if name else type(func).__name__


def _call(func: RewardFunc, kwargs: dict[str, Any]) -> list[Any]:
    out = func(**kwargs)
    if inspect.isawaitable(out):  # an async reward function: run it to completion here
        out = asyncio.run(_await(out))
    return list(out)


async def _await(awaitable: Any) -> Any:
    return await awaitable


class RewardScores(NamedTuple):
    """What `compute_rewards` returns."""

    rewards: Tensor
    """``(N, F)`` float32 rewards, NaN where a completion was not scored."""
    errors: dict[str, int]
    """Per function name, the rows it raised on (or all rows, when it failed for the batch)."""
    nonfinite: dict[str, int]
    """Per function name, the rows it scored NaN or inf (``None`` is missing, not counted here)."""


def _count_error(name: str, count: int, expected: int) -> str:
    return (
        f"reward function {name!r} returned {count} rewards for {expected} completions "
        f"(it must return one per completion, in order)"
    )


def _to_values(values: list[Any]) -> list[float | None]:
    return [None if v is None else float(v) for v in values]


def _row_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    return {k: (v[i : i + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}


def _where(prompts: list[Any], completions: list[Any], i: int) -> str:
    return f"on prompt {prompts[i]!r} with completion {completions[i]!r}"


def _score_rows(
    func: RewardFunc, name: str, kwargs: dict[str, Any], prompts: list[Any], completions: list[Any],
    fail: Callable[[str, BaseException | None, str], None],
) -> tuple[list[float | None], int]:
    """Call ``func`` one completion at a time; the rows that raise get ``None`` (after ``fail``). Returns the
    values and the number of rows that raised."""
    values: list[float | None] = []
    failed = 0
    for i in range(len(completions)):
        try:
            row = _call(func, _row_kwargs(kwargs, i))
            if len(row) != 1:
                raise ValueError(_count_error(name, len(row), 1))
            values.extend(_to_values(row))
        except Exception as row_error:
            message = (
                f"reward function {name!r} raised {type(row_error).__name__}: {row_error} "
                f"{_where(prompts, completions, i)}"
            )
            fail(message, row_error, "reward NaN, left out of the baseline")
            values.append(None)
            failed += 1
    return values, failed


def compute_rewards(
    reward_funcs: Sequence[RewardFunc],
    *,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]] | None = None,
    on_error: OnRewardError = "raise",
    extra_kwargs: dict[str, Any] | None = None,
) -> RewardScores:
    """Score every completion with every reward function.

    Args:
        reward_funcs: TRL-signature functions (sync or async).
        prompts, completions, completion_ids: ``N`` entries each.
        columns: the dataset's other columns, ``N`` values each, passed as keyword arguments.
        on_error: what a broken reward does. A function that raises is re-run one completion at a
            time to find the culprits; a NaN or infinite reward is an error too; a function that
            returns the wrong number of rewards is an error of the whole batch. "raise" stops with a
            `RewardFunctionError` naming the function, the prompt and the completion (or the counts);
            "skip" gives those rows NaN for that function (as if it returned None: they leave the
            baseline, and a row no function scored gets advantage 0) and logs one warning per
            function and batch.
        extra_kwargs: other keyword arguments for every function (e.g. ``trainer_state``).

    Returns:
        `RewardScores`: the ``(N, F)`` rewards and, per function name, how many rows raised and
        how many were scored NaN or inf.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_reward_error must be 'raise' or 'skip', got {on_error!r}")
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"prompts, completions and completion_ids need one length, got {len(prompts)}, {n}, "
                         f"{len(completion_ids)}")
    kwargs: dict[str, Any] = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
    for key, column in (columns or {}).items():
        if key in ("prompt", "completion", "completion_ids"):
            continue
        if len(column) != n:
            raise ValueError(f"column {key!r} has {len(column)} values, expected {n}")
        kwargs[key] = column
    kwargs.update(extra_kwargs or {})

    def fail(message: str, cause: BaseException | None, outcome: str) -> None:
        if on_error == "raise":
            raise RewardFunctionError(message) from cause
        log.warning("%s; skipped (%s)", message, outcome)

    out = torch.full((n, len(reward_funcs)), math.nan, dtype=torch.float32)
    errors: dict[str, int] = {}
    nonfinite: dict[str, int] = {}
    for j, func in enumerate(reward_funcs):
        name = reward_func_name(func)
        values: list[float | None] | None = None
        cause: Exception | None = None
        try:
            raw = _call(func, kwargs)
            if len(raw) != n:  # a contract error of the whole batch, not of a row
                fail(_count_error(name, len(raw), n), None, "all its rewards NaN")
                errors[name] = n
                continue
            values = _to_values(raw)
        except RewardFunctionError:
            raise
        except Exception as batch_error:
            cause = batch_error
        if values is None:  # locate the row(s) that broke it, one completion at a time
            assert cause is not None
            values, errors[name] = _score_rows(func, name, kwargs, prompts, completions, fail)
            if errors[name] == 0:  # only the batched call fails: not attributable to a row
                fail(f"reward function {name!r} raised {type(cause).__name__}: {cause} on the batch", cause,
                     "all its rewards NaN")
                values, errors[name] = [None] * n, n
        bad = [i for i, v in enumerate(values) if v is not None and not math.isfinite(v)]
        if bad:
            more = f" (and {len(bad) - 1} more completions)" if len(bad) > 1 else ""
            fail(f"reward function {name!r} returned {values[bad[0]]!r} {_where(prompts, completions, bad[0])}{more}",
                 None, "those rewards NaN, left out of the baseline")
            nonfinite[name] = len(bad)
            for i in bad:
                values[i] = None
        out[:, j] = torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32)
    return RewardScores(out, errors, nonfinite)
