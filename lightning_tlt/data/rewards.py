"""Calling TRL-signature reward functions, with TRL's conventions and errors that say what broke.

A reward function is called as ``f(prompts=..., completions=..., completion_ids=..., **columns)``
and returns one float (or ``None``) per completion; ``columns`` are the dataset's other columns,
one value per completion. Functions may be ``async``. ``None`` becomes NaN: left out of means
and baselines, never scored as zero (TRL 1.16's ``_calculate_rewards``).

Rewards are checked as the training sees them, in float32: ``1e39`` is finite in Python but ``inf``
in float32, so it is a non-finite reward like ``inf`` itself. A function returning a string, bytes, a
dict or an element that is not a number (``"11111111"`` is not eight rewards of 1) is refused with
its name. `drop_overflowing_groups` reports the groups whose rewards are finite one by one but whose
sum over functions or std overflows (``±3e38``), which would otherwise zero their advantages.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import Tensor

from lightning_tlt.rl.advantages import nanstd

log = logging.getLogger(__name__)

RewardFunc = Callable[..., Any]
OnRewardError = Literal["raise", "skip"]


class RewardFunctionError(RuntimeError):
    """A reward function raised; the message names the function, the prompt and the completion."""


def reward_func_name(func: RewardFunc) -> str:
    """The name TRL logs a reward function under (``rewards/<name>/mean``)."""
    name = getattr(func, "__name__", None)
    return str(name) if name else type(func).__name__


def _call(func: RewardFunc, kwargs: dict[str, Any]) -> Any:
    out = func(**kwargs)
    if inspect.isawaitable(out):  # an async reward function: run it to completion here
        out = asyncio.run(_await(out))
    return out


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


_NOT_A_LIST = (str, bytes, bytearray, Mapping)
"""Iterable, but never a list of rewards: a string would be read as one reward per character."""


def _is_reward(value: Any) -> bool:
    """``None``, a real number (bool, int, float, NumPy scalar) or a one-element real tensor or array."""
    if value is None or (isinstance(value, numbers.Real) and not isinstance(value, _NOT_A_LIST)):
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch
        return False
    return isinstance(value, np.ndarray) and value.size == 1 and np.issubdtype(value.dtype, np.number) and (
        not np.issubdtype(value.dtype, np.complexfloating))


def _as_list(name: str, out: Any, expected: int) -> list[Any]:
    """A reward function's result as a list of ``expected`` rewards, or a `ValueError` saying what it returned."""
    if isinstance(out, _NOT_A_LIST):
        raise ValueError(
            f"reward function {name!r} returned a {type(out).__name__} ({str(out)[:40]!r}), not a list of rewards; "
            "it must return one float (or None) per completion"
        )
    try:
        values = list(out)
    except TypeError:
        raise ValueError(f"reward function {name!r} returned {type(out).__name__} {out!r}, not a list of rewards; "
                         "it must return one float (or None) per completion") from None
    if len(values) != expected:
        raise ValueError(_count_error(name, len(values), expected))
    for i, value in enumerate(values):
        if not _is_reward(value):
            raise ValueError(
                f"reward function {name!r} returned {str(value)[:40]!r} ({type(value).__name__}) for completion {i}; "
                "a reward is a float or None, not a string, bytes or a container"
            )
    return values


def _to_float(value: Any) -> float:
    """A checked reward as a Python float (NaN for ``None``; an int too large for a float is infinite)."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except OverflowError:  # an int past 1e308
        return math.inf if value > 0 else -math.inf


def _finite_in_python(value: Any) -> bool:
    """Whether a checked reward is finite before conversion (an int past 1e308 is)."""
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return True


def _row_kwargs(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    return {k: (v[i : i + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}


def _where(prompts: list[Any], completions: list[Any], i: int) -> str:
    return f"on prompt {prompts[i]!r} with completion {completions[i]!r}"


def _score_rows(
    func: RewardFunc, name: str, kwargs: dict[str, Any], prompts: list[Any], completions: list[Any],
    fail: Callable[[str, BaseException | None, str], None],
) -> tuple[list[Any], int]:
    """Call ``func`` one completion at a time; the rows that raise get ``None`` (after ``fail``). Returns the
    values and the number of rows that raised."""
    values: list[Any] = []
    failed = 0
    for i in range(len(completions)):
        try:
            values.extend(_as_list(name, _call(func, _row_kwargs(kwargs, i)), 1))
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
            time to find the culprits; a reward that is NaN or infinite in float32 (``1e39``
            overflows) is an error too; a function that returns the wrong number of rewards, or
            anything but numbers and ``None`` (a string, bytes, a dict, nested lists), is an error of
            the whole batch. "raise" stops with a
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
        values: list[Any] | None = None
        cause: Exception | None = None
        try:
            raw = _call(func, kwargs)
        except RewardFunctionError:
            raise
        except Exception as batch_error:
            cause = batch_error
        if cause is None:
            try:
                values = _as_list(name, raw, n)
            except ValueError as contract:  # an error of the whole batch, not of a row
                fail(str(contract), None, "all its rewards NaN")
                errors[name] = n
                continue
        if values is None:  # locate the row(s) that broke it, one completion at a time
            assert cause is not None
            values, errors[name] = _score_rows(func, name, kwargs, prompts, completions, fail)
            if errors[name] == 0:  # only the batched call fails: not attributable to a row
                fail(f"reward function {name!r} raised {type(cause).__name__}: {cause} on the batch", cause,
                     "all its rewards NaN")
                values, errors[name] = [None] * n, n
        scores = torch.tensor([_to_float(v) for v in values], dtype=torch.float32)  # the training dtype
        bad = [i for i, v in enumerate(values) if v is not None and not math.isfinite(scores[i])]
        if bad:
            more = f" (and {len(bad) - 1} more completions)" if len(bad) > 1 else ""
            value = values[bad[0]]
            overflow = ", which is inf in float32 (the training dtype)" if _finite_in_python(value) else ""
            fail(f"reward function {name!r} returned {value!r}{overflow} {_where(prompts, completions, bad[0])}{more}",
                 None, "those rewards NaN, left out of the baseline")
            nonfinite[name] = len(bad)
            scores[torch.tensor(bad)] = math.nan
        out[:, j] = scores
    return RewardScores(out, errors, nonfinite)


def drop_overflowing_groups(
    rewards: Tensor, num_generations: int, scale_rewards: str, prompts: list[Any], on_error: OnRewardError = "raise"
) -> tuple[Tensor, int]:
    """Find the groups whose combined rewards or std are infinite in float32, though each reward is finite.

    Rewards of ``±3e38`` are finite, but their std (or their sum over functions) is ``inf``, and
    dividing by it would zero the group's advantages without a word. Such a group is an error
    ("raise": `RewardFunctionError` naming the prompt and the rewards) or is left out ("skip": its
    rewards NaN, so its advantages are 0 and it stays out of the logged means, with a warning).

    Args:
        rewards: ``(N,)`` combined rewards, groups of ``num_generations`` contiguous rows; NaN = missing.
        num_generations: group size G.
        scale_rewards: "group", "batch" or "none" (a batch std that overflows fails every group).
        prompts: ``N`` prompts (one per row), to name the group.
        on_error: "raise" or "skip".

    Returns:
        The rewards (the dropped groups NaN) and how many groups were dropped.
    """
    grouped = rewards.float().view(-1, num_generations)  # (P, G)
    bad = torch.isinf(grouped).any(dim=1)
    if num_generations > 1:
        bad |= torch.isinf(nanstd(grouped, dim=1))
    if scale_rewards == "batch" and rewards.numel() > 1:  # a batch std that overflows zeroes every group
        kept = grouped.masked_fill(bad.unsqueeze(1), math.nan)
        if torch.isinf(nanstd(kept.view(-1))):
            bad |= ~torch.isnan(grouped).all(dim=1)
    if not bad.any():
        return rewards, 0
    first = int(bad.nonzero()[0])
    values = ", ".join(f"{v:.4g}" for v in grouped[first].tolist())
    count = int(bad.sum())
    message = (
        f"the rewards of prompt {prompts[first * num_generations]!r} ([{values}]) overflow float32 when combined or "
        f"scaled (sum or std inf){f' (and {count - 1} more groups)' if count > 1 else ''}; keep rewards well "
        "below 1e38"
    )
    if on_error == "raise":
        raise RewardFunctionError(message)
    log.warning("%s; skipped (those groups' rewards NaN, advantages 0)", message)
    return rewards.masked_fill(bad.repeat_interleave(num_generations), math.nan), count
