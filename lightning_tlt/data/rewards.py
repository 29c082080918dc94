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
from typing import Any, Literal

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


def _to_floats(name: str, values: list[Any], expected: int) -> list[float]:
    if len(values) != expected:
        raise ValueError(
            f"reward function {name!r} returned {len(values)} rewards, expected {expected} "
            f"(one per prompt-completion pair)"
        )
    return [math.nan if v is None else float(v) for v in values]


def _row_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    return {k: (v[i : i + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}


def compute_rewards(
    reward_funcs: Sequence[RewardFunc],
    *,
    prompts: list[Any],
    completions: list[Any],
    completion_ids: list[list[int]],
    columns: dict[str, list[Any]] | None = None,
    on_error: OnRewardError = "raise",
    extra_kwargs: dict[str, Any] | None = None,
) -> tuple[Tensor, dict[str, int]]:
    """Score every completion with every reward function.

    Args:
        reward_funcs: TRL-signature functions (sync or async).
        prompts, completions, completion_ids: ``N`` entries each.
        columns: the dataset's other columns, ``N`` values each, passed as keyword arguments.
        on_error: "raise" stops with a `RewardFunctionError` naming the prompt and completion that
            broke the function; "skip" gives the rows it cannot score NaN (as if it returned None:
            they leave the baseline, and a row no function scored gets advantage 0) and logs a warning.
        extra_kwargs: other keyword arguments for every function (e.g. ``trainer_state``).

    Returns:
        ``(N, F)`` float32 rewards (NaN = not scored) and, per function name, how many rows it
        failed on.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_reward_error must be 'raise' or 'skip', got {on_error!r}")
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"prompts, completions and completion_ids need one length, got {len(prompts)}, {n}, "
                         f"{len(completion_ids)}")
    kwargs: dict[str, Any] = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids}
    for key, values in (columns or {}).items():
        if key in ("prompt", "completion", "completion_ids"):
            continue
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values, expected {n}")
        kwargs[key] = values
    kwargs.update(extra_kwargs or {})

    out = torch.full((n, len(reward_funcs)), math.nan, dtype=torch.float32)
    failures: dict[str, int] = {}
    for j, func in enumerate(reward_funcs):
        name = reward_func_name(func)
        try:
            values = _to_floats(name, _call(func, kwargs), n)
        except Exception as batch_error:  # locate the row(s) that broke it, one completion at a time
            values, failed = [], 0
            for i in range(n):
                try:
                    values.extend(_to_floats(name, _call(func, _row_kwargs(kwargs, i)), 1))
                except Exception as row_error:
                    message = (
                        f"reward function {name!r} raised {type(row_error).__name__}: {row_error} "
                        f"on prompt {prompts[i]!r} with completion {completions[i]!r}"
                    )
                    if on_error == "raise":
                        raise RewardFunctionError(message) from row_error
                    log.warning("%s; skipped (reward NaN, left out of the baseline)", message)
                    values.append(math.nan)
                    failed += 1
            if failed == 0:  # only the batched call fails: not attributable to a row
                message = f"reward function {name!r} raised {type(batch_error).__name__}: {batch_error} on the batch"
                if on_error == "raise":
                    raise RewardFunctionError(message) from batch_error
                log.warning("%s; skipped (all its rewards NaN)", message)
                values, failed = [math.nan] * n, n
            failures[name] = failed
        out[:, j] = torch.tensor(values, dtype=torch.float32)
    return out, failures
