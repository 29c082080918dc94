"""When a co-trained drafter reaches the engine: the boundary's publish decision, agreed across ranks.

At each RL step boundary `lightning_tlt.callbacks.drafter_cotrain.DrafterCoTrainCallback` publishes
its drafter to the engine (`publish_drafter`: finite-checked, in place, versioned) every
``publish_every_n_steps`` when an update was applied since. Two rules can hold it back
(`publish_due`):

- the hand-over (TLT's cold start): while the engine drafts with a model-free drafter
  (`drafts_model_free`), the EAGLE drafter replaces it only once its held-out expected acceptance
  length ``(1 - α^(k+1)) / (1 - α)`` beats the engine's measured one by ``handoff_margin``;
- ``publish_if_improves``: only when the latest held-out acceptance rate beats the published
  drafter's.

Under DDP every rank decides alike: the figures decided on are rank means, and whether the drafter
changed is whether it changed on any rank, agreed in one reduce (`agree_across_ranks`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
from torch import Tensor

from lightning_tlt.core.types import DrafterHost
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.loss import expected_acceptance_length

Heldout = tuple[float, float]
"""Held-out acceptance rates ``(trained, published)``: the trained drafter's and the published one's."""


def publish_drafter(engine: DrafterHost, drafter: EagleDrafter, version: int) -> EagleDrafter | None:
    """Publish ``drafter``'s weights to ``engine`` as ``version``; returns the engine's drafter.

    The engine refuses non-finite weights (keeping what it drafts with) and copies in place where it
    can (`lightning_tlt.core.types.DrafterHost.set_drafter`).
    """
    engine.set_drafter(drafter, version)
    return cast(EagleDrafter | None, engine.drafter)


def drafts_model_free(engine: DrafterHost, handoff_margin: float | None) -> bool:
    """Whether the engine drafts with a model-free drafter that the EAGLE drafter must beat first
    (never, when ``handoff_margin`` is ``None``)."""
    current = engine.drafter
    return handoff_margin is not None and current is not None and not isinstance(current, EagleDrafter)


def publish_due(
    heldout: Heldout | None,
    measured: float,
    *,
    model_free: bool,
    has_published: bool,
    handoff_margin: float | None,
    draft_tokens: int,
    publish_if_improves: bool,
) -> bool:
    """Whether a changed drafter that is due for publication is published (see the module docstring).

    Args:
        heldout: the latest rank-mean held-out rates, ``None`` before the first evaluation.
        measured: the engine's rank-mean measured acceptance length (tokens per verify step).
        model_free: the engine drafts with a model-free drafter (`drafts_model_free`).
        has_published: a drafter was published before.
        handoff_margin: tokens per verify step by which the drafter must beat a model-free one.
        draft_tokens: ``k`` of the expected acceptance length.
        publish_if_improves: publish only a drafter whose held-out rate beats the published one's.
    """
    if model_free:
        if heldout is None:
            return False
        expected = expected_acceptance_length(min(1.0, max(0.0, heldout[0])), draft_tokens)
        if not expected > measured + cast(float, handoff_margin):
            return False
    if publish_if_improves and has_published:
        if heldout is None or not heldout[0] > heldout[1]:
            return False
    return True


def agree_across_ranks(
    measured: float,
    heldout: Heldout | None,
    changed: bool,
    *,
    world_size: int,
    reduce_sum: Callable[[Tensor], Tensor],
    device: torch.device,
) -> tuple[float, Heldout | None, bool]:
    """What every rank decides on: the rank-means of the engine's measured acceptance length and of the
    held-out rates (of the ranks that have them), and whether the drafter changed on any rank.

    One ``reduce_sum`` (e.g. ``trainer.strategy.reduce(t, reduce_op="sum")``) of a float64 tensor on
    ``device``; with one rank, the figures as they are.
    """
    if world_size == 1:
        return measured, heldout, changed
    local = torch.tensor([measured, *(heldout or (0.0, 0.0)), float(heldout is not None), float(changed)],
                         dtype=torch.float64, device=device)  # fmt: skip
    total = reduce_sum(local).tolist()
    rates = None if total[3] == 0 else (total[1] / total[3], total[2] / total[3])
    return total[0] / float(world_size), rates, total[4] > 0
