"""The EAGLE drafter loss: regress the next feature, match the policy's next-token distribution.

EAGLE (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty") trains the drafter with ``L = L_reg + w_cls · L_cls``:

    L_reg = SmoothL1(f̂_{t+1}, f_{t+1})                                         (feature regression)
    L_cls = CrossEntropy(softmax(lm_head(f_{t+1})), log_softmax(lm_head(f̂_{t+1})))  (soft labels)

with ``w_cls = 0.1``, masked to the rows the engine drafts at (TLT uses the same two terms and
weights). The soft cross-entropy compares the drafter's distribution with the policy's full
next-token distribution (not a sampled token), which is what acceptance ``Σ min(p, q)`` rewards.
Pure function: it returns the loss and detached statistics; skipping non-finite losses is the
caller's job (`lightning_tlt.callbacks.drafter_cotrain`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass
class DrafterLossOutput:
    """The loss to back-propagate and what to log about it."""

    loss: Tensor
    """Scalar, with gradient."""
    stats: dict[str, Tensor]
    """Detached scalars: ``feature_loss``, ``token_loss``, ``top1_accuracy``, ``accept_rate``, ``num_rows``."""


def eagle_loss(
    pred_features: Tensor,
    target_features: Tensor,
    pred_logits: Tensor,
    target_logits: Tensor,
    mask: Tensor,
    *,
    feature_weight: float = 1.0,
    token_weight: float = 0.1,
    temperature: float = 1.0,
) -> DrafterLossOutput:
    """EAGLE's drafter loss, averaged over the masked rows.

    Args:
        pred_features: ``(B, T, H)`` the drafter's predicted next features ``f̂_{t+1}``.
        target_features: ``(B, T, H)`` the policy's next features ``f_{t+1}``.
        pred_logits: ``(B, T, V)`` ``lm_head(f̂_{t+1})``.
        target_logits: ``(B, T, V)`` ``lm_head(f_{t+1})`` (no gradient needed).
        mask: ``(B, T)`` rows that count (bool or 0/1).
        feature_weight: weight of the SmoothL1 feature term (EAGLE: 1.0).
        token_weight: weight of the soft cross-entropy term (EAGLE: 0.1).
        temperature: divides both logits in the statistics ``accept_rate`` (the expected acceptance
            ``Σ min(p, q)`` of one draft at that temperature); the loss itself uses temperature 1.

    Returns:
        `DrafterLossOutput`; with no masked row the loss is a zero that still has a gradient path.
    """
    if not feature_weight >= 0 or not token_weight >= 0:
        raise ValueError(
            f"loss weights must be >= 0, got feature_weight={feature_weight!r}, token_weight={token_weight!r}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    m = mask.float()  # (B, T) float32 even under bf16 autocast: row counts above 256 stay exact
    rows = m.sum()
    denom = rows.clamp_min(1.0)
    feat = F.smooth_l1_loss(pred_features.float(), target_features.float(), reduction="none").mean(
        -1
    )  # (B, T)
    feature_loss = (feat * m).sum() / denom
    target_probs = target_logits.detach().float().softmax(-1)  # (B, T, V)
    pred_logp = pred_logits.float().log_softmax(-1)
    token = -(target_probs * pred_logp).sum(-1)  # (B, T)
    token_loss = (token * m).sum() / denom
    loss = feature_weight * feature_loss + token_weight * token_loss
    with torch.no_grad():
        top1 = (pred_logits.argmax(-1) == target_logits.argmax(-1)).to(m.dtype)
        p = (target_logits.float() / temperature).softmax(-1)
        q = (pred_logits.float() / temperature).softmax(-1)
        accept = torch.minimum(p, q).sum(-1)  # (B, T)
        stats = {
            "feature_loss": feature_loss.detach(),
            "token_loss": token_loss.detach(),
            "top1_accuracy": (top1 * m).sum() / denom,
            "accept_rate": (accept * m).sum() / denom,
            "num_rows": rows.detach(),
        }
    return DrafterLossOutput(loss=loss, stats=stats)


def expected_acceptance_length(accept_rate: float, k: int) -> float:
    """Expected tokens per verify step for k drafts accepted independently with rate ``accept_rate``.

    Leviathan et al. 2023, eq. (1): ``(1 - α^(k+1)) / (1 - α)``; ``k + 1`` when ``α = 1``.
    """
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"accept_rate must be in [0, 1], got {accept_rate!r}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k!r}")
    if accept_rate >= 1.0:
        return float(k + 1)
    return (1.0 - accept_rate ** (k + 1)) / (1.0 - accept_rate)
