"""Rank-local state in a checkpoint that one rank writes: every rank's, so each resumes with its own.

Lightning's checkpoint (DDP's file, or the metadata beside ``ModelParallelStrategy``'s sharded one) is
written by rank 0, from rank 0's ``state_dict`` s. Some state differs per rank: the datamodule's
sampling generator (each rank samples its own stream) and token counts, the drafter co-training's
replay buffer (each rank harvests its own rollouts), its optimizer moments and pacer. A resume that gave
every rank rank 0's would not continue the run exactly.

`gather_rank_states` (called from such a ``state_dict`` on every rank, as Lightning's checkpoint dump
does) returns this rank's state and, on rank 0, every other rank's under `RANKS_KEY`, gathered to rank
0 on the CPU; `rank_state` picks a rank's back when loading. A one-rank run's state has no `RANKS_KEY`,
and a checkpoint without it gives every rank the state it holds. The one collective is
``torch.distributed.gather_object``: Lightning's strategies have no gather of objects. A dump that one
rank makes alone (`lightning_tlt.callbacks.interrupt_checkpoint`'s exception checkpoint under DDP) runs
inside `saving_alone`, which gathers nothing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RANKS_KEY", "current_rank", "gather_rank_states", "rank_state", "saving_alone"]

RANKS_KEY = "other_ranks"
"""Where rank 0's state holds the other ranks' (``{rank: state}``)."""

_ALONE = [False]


@contextlib.contextmanager
def saving_alone() -> Iterator[None]:
    """Inside: `gather_rank_states` gathers nothing (one rank dumps a checkpoint without the others)."""
    before = _ALONE[0]
    _ALONE[0] = True
    try:
        yield
    finally:
        _ALONE[0] = before


def _cpu(node: Any) -> Any:
    if isinstance(node, torch.Tensor):
        return node.detach().cpu()
    if isinstance(node, dict):
        return {k: _cpu(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_cpu(v) for v in node)
    return node


def gather_rank_states(state: dict[str, Any], world_size: int) -> dict[str, Any]:
    """``state`` (this rank's), on rank 0 with every other rank's under `RANKS_KEY` (a collective: every
    rank calls it, in the same order; nothing is gathered for one rank or inside `saving_alone`)."""
    if world_size <= 1 or _ALONE[0] or not dist.is_available() or not dist.is_initialized():
        return state
    rank = dist.get_rank()
    gathered: list[Any] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(_cpu(state), gathered, dst=0)
    if gathered is None:
        return state
    return {**state, RANKS_KEY: {r: s for r, s in enumerate(gathered) if r != 0}}


def rank_state(saved: dict[str, Any], rank: int, what: str) -> dict[str, Any]:
    """The state ``rank`` saved (rank 0's when the checkpoint holds no other: a one-rank run, or one of
    an earlier version; a warning when the checkpoint had other ranks but not this one)."""
    others = saved.get(RANKS_KEY)
    own = {k: v for k, v in saved.items() if k != RANKS_KEY}
    if rank == 0 or not others:
        return own
    if rank not in others:
        warnings.warn(
            f"{what}: the checkpoint holds the state of ranks {[0, *sorted(others)]}, not of rank {rank} "
            "(resumed on more ranks than it was saved from); this rank continues from rank 0's",
            stacklevel=2,
        )
        return own
    return dict(others[rank])


def current_rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
