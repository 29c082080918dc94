"""`EagleBatch`: the EAGLE drafter's training rows, and `align_for_eagle`, which pairs them.

vLLM's alignment (``v1/spec_decode/eagle.py``; `lightning_tlt.drafters.eagle`'s docstring): draft
row ``t`` gets the policy's feature ``h_t``, the embedding of token ``x_{t+1}`` and position ``t``,
and predicts the feature ``h_{t+1}``. So the features are not shifted and the tokens are shifted
left by one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class EagleBatch:
    """Drafter training rows aligned by `align_for_eagle` (T - 1 rows per sequence)."""

    features: Tensor
    """``(B, T-1, F)`` ``h_t``: the policy's features at positions ``0..T-2`` (F = H, or 3H for EAGLE-3)."""
    input_ids: Tensor
    """``(B, T-1)`` ``x_{t+1}``: the tokens shifted left by one."""
    position_ids: Tensor
    """``(B, T-1)`` the positions ``t`` of the features."""
    target_features: Tensor
    """``(B, T-1, H)`` ``h_{t+1}``: the policy's next last-layer features, what row t predicts."""
    loss_mask: Tensor
    """``(B, T-1)`` bool: rows whose input token ``x_{t+1}`` is a completion token (where the engine
    drafts), with ``h_{t+1}`` a real position."""
    attention_mask: Tensor | None = None
    """``(B, T-1)`` bool: real rows (``None``: all); padding rows are never attended to. Or, for rows
    that pack several sequences, a ``(B, T-1, T-1)`` bool keep-mask (query, key): block-causal."""

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    def select(self, start: int, stop: int) -> EagleBatch:
        """The sequences ``start:stop`` (to evaluate a large batch in chunks)."""
        return EagleBatch(
            features=self.features[start:stop],
            input_ids=self.input_ids[start:stop],
            position_ids=self.position_ids[start:stop],
            target_features=self.target_features[start:stop],
            loss_mask=self.loss_mask[start:stop],
            attention_mask=None if self.attention_mask is None else self.attention_mask[start:stop],
        )


def align_for_eagle(
    features: Tensor,
    tokens: Tensor,
    completion_mask: Tensor,
    *,
    last_features: Tensor | None = None,
    position_ids: Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> EagleBatch:
    """Pair features and tokens the way the drafter is fed (see the module docstring).

    Args:
        features: ``(B, T, F)`` the policy's features at each position (F = H, or 3H for EAGLE-3).
        tokens: ``(B, T)`` the sequence ``x`` (prompt then completion, right-padded).
        completion_mask: ``(B, T)`` 1 on completion tokens, 0 on prompt and padding.
        last_features: ``(B, T, H)`` the last-layer features (the regression target), when
            ``features`` are EAGLE-3's concatenation; ``None``: ``features`` themselves.
        position_ids: ``(B, T)`` positions; ``None``: ``0..T-1``.
        attention_mask: ``(B, T)`` 1 on real tokens (right padding only: positions count from the
            first column); ``None``: all real.
    """
    if tokens.dim() != 2 or features.shape[:2] != tokens.shape or completion_mask.shape != tokens.shape:
        raise ValueError(
            f"features (B, T, F), tokens (B, T) and completion_mask (B, T) must agree, got "
            f"{tuple(features.shape)}, {tuple(tokens.shape)}, {tuple(completion_mask.shape)}"
        )
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    last = features if last_features is None else last_features
    loss_mask = completion_mask[:, 1:].bool()
    real = None
    if attention_mask is not None:
        real = attention_mask.bool()
        loss_mask = loss_mask & real[:, 1:]
        real = real[:, :-1]
    return EagleBatch(
        features=features[:, :-1],
        input_ids=tokens[:, 1:],
        position_ids=position_ids[:, :-1],
        target_features=last[:, 1:],
        loss_mask=loss_mask,
        attention_mask=real,
    )
