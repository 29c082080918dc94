"""GRPO and PPO losses as pure functions returning the loss and detached statistics.

GRPO's per-token clipped surrogate is shared by its variants; what differs is how the per-token
losses are aggregated into one number, which `LOSS_AGGREGATIONS` maps by TRL's ``loss_type``
name. Every function matches TRL 1.16's ``GRPOTrainer._compute_loss`` on one process without
gradient accumulation; with micro-batches, pass the whole batch's ``num_sequences`` and
``num_items`` so the chunks' losses add up to the whole batch's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from lightning_tlt.rl.advantages import masked_mean


@dataclass
class LossOutput:
    """A loss to back-propagate and statistics about it (detached scalars, TRL's metric names)."""

    loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


Aggregation = Callable[..., Tensor]


def _agg_grpo(per_token_loss: Tensor, mask: Tensor, *, num_sequences: int, **_: object) -> Tensor:
    """"grpo": mean over each sequence's tokens, then mean over sequences (Shao et al. 2024, eq. 3)."""
    per_seq = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return per_seq.sum() / num_sequences


def _agg_bnpo(per_token_loss: Tensor, mask: Tensor, **_: object) -> Tensor:
    """"bnpo": sum over the tokens / number of tokens of this (micro-)batch (TRL: local normaliser)."""
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)


def _agg_dr_grpo(
    per_token_loss: Tensor, mask: Tensor, *, num_sequences: int, max_completion_length: int, **_: object
) -> Tensor:
    """"dr_grpo": sum over all tokens / (B * max_completion_length): no length bias (Liu et al. 2025)."""
    return (per_token_loss * mask).sum() / (num_sequences * max_completion_length)


def _agg_dapo(per_token_loss: Tensor, mask: Tensor, *, num_items: Tensor | float, **_: object) -> Tensor:
    """"dapo": sum over all tokens / tokens of the whole generation batch (Yu et al. 2025, eq. 8)."""
    return (per_token_loss * mask).sum() / torch.as_tensor(num_items).clamp(min=1.0)


LOSS_AGGREGATIONS: dict[str, Aggregation] = {
    "grpo": _agg_grpo,
    "bnpo": _agg_bnpo,
    "dr_grpo": _agg_dr_grpo,
    "dapo": _agg_dapo,
}
"""``loss_type`` -> aggregation of per-token losses ``(B, T)`` under ``mask`` into a scalar."""


def grpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    importance_sampling_level: str = "token",
    beta: float = 0.0,
    ref_logps: Tensor | None = None,
    use_bias_correction_kl: bool = True,
    max_completion_length: int = 512,
    num_sequences: int | None = None,
    num_items: Tensor | float | None = None,
) -> LossOutput:
    """The clipped GRPO objective with TRL's variants.

    Per token: ``ratio = exp(logp - old_logp)`` (or, at "sequence" level, the exp of the masked
    mean log-ratio of the sequence, GSPO), ``loss = -min(ratio * A, clip(ratio, 1 - eps_low,
    1 + eps_high) * A) + beta * KL``, with the k3 estimator ``KL = exp(ref - logp) - (ref - logp) - 1``
    (multiplied by the ratio when ``use_bias_correction_kl``). Then aggregated per ``loss_type``.

    Args:
        logps: ``(B, T)`` log-probabilities of the completion tokens under the current policy (with grad).
        old_logps: ``(B, T)`` the same under the policy that sampled them (detached).
        advantages: ``(B,)`` or ``(B, T)``.
        mask: ``(B, T)`` 1 on tokens that count.
        loss_type: a key of `LOSS_AGGREGATIONS`.
        epsilon_low, epsilon_high: clipping ranges.
        importance_sampling_level: "token" or "sequence".
        beta: KL weight; ``ref_logps`` ``(B, T)`` is required when > 0.
        use_bias_correction_kl: TRL's importance correction of the KL term.
        max_completion_length: normaliser of "dr_grpo".
        num_sequences: sequences of the whole batch (default ``B``), for micro-batching.
        num_items: masked tokens of the whole batch (default ``mask.sum()``), for micro-batching.

    Returns:
        `LossOutput` with stats ``kl`` (when beta > 0), ``clip_ratio/low_mean``,
        ``clip_ratio/high_mean``, ``clip_ratio/region_mean`` (masked token means) and ``policy_loss``.
    """
    aggregate = LOSS_AGGREGATIONS.get(loss_type)
    if aggregate is None:
        raise ValueError(f"loss_type must be one of {sorted(LOSS_AGGREGATIONS)}, got {loss_type!r}")
    if logps.shape != old_logps.shape or logps.shape != mask.shape:
        raise ValueError(
            f"logps, old_logps and mask must have one shape, got {tuple(logps.shape)}, "
            f"{tuple(old_logps.shape)}, {tuple(mask.shape)}"
        )
    mask = mask.to(logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # (B, 1)
    log_ratio = logps - old_logps  # (B, T)
    if importance_sampling_level == "token":
        log_weights = log_ratio
    elif importance_sampling_level == "sequence":
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # (B, 1)
    else:
        raise ValueError(f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}")
    coef_1 = torch.exp(log_weights)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)  # (B, T) or (B, 1)

    stats: dict[str, Tensor] = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps (the reference model's log-probabilities)")
        per_token_kl = torch.exp(ref_logps - logps) - (ref_logps - logps) - 1  # k3, (B, T)
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1
        per_token_loss = per_token_loss + beta * per_token_kl
        stats["kl"] = masked_mean(per_token_kl.detach(), mask)
    per_token_loss = per_token_loss.expand_as(mask)

    loss = aggregate(
        per_token_loss,
        mask,
        num_sequences=logps.shape[0] if num_sequences is None else num_sequences,
        num_items=mask.sum() if num_items is None else num_items,
        max_completion_length=max_completion_length,
    )

    def clip_mean(flags: Tensor) -> Tensor:
        if flags.shape[1] == 1:  # sequence level: one flag per sequence
            return flags.float().mean()
        return masked_mean(flags.float(), mask)

    with torch.no_grad():
        low = (coef_1 < 1 - epsilon_low) & (advantages < 0)
        high = (coef_1 > 1 + epsilon_high) & (advantages > 0)
        stats["clip_ratio/low_mean"] = clip_mean(low)
        stats["clip_ratio/high_mean"] = clip_mean(high)
        stats["clip_ratio/region_mean"] = clip_mean(low | high)
        stats["policy_loss"] = loss.detach()
    return LossOutput(loss=loss, stats=stats)


def ppo_policy_loss(
    logps: Tensor, old_logps: Tensor, advantages: Tensor, mask: Tensor, *, cliprange: float
) -> LossOutput:
    """PPO's clipped surrogate (Schulman et al. 2017, eq. 7), a masked token mean as in TRL.

    ``loss = mean_t max(-A_t * r_t, -A_t * clip(r_t, 1 - c, 1 + c))`` with ``r_t = exp(logp - old_logp)``.

    Returns:
        `LossOutput` with stats ``policy/clipfrac``, ``policy/approxkl`` (``0.5 * mean((logp - old)^2)``)
        and ``loss/policy``.
    """
    ratio = torch.exp(logps - old_logps)  # (B, T)
    losses1 = -advantages * ratio
    losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(losses1, losses2), mask)
    with torch.no_grad():
        stats = {
            "policy/clipfrac": masked_mean((losses2 > losses1).float(), mask),
            "policy/approxkl": 0.5 * masked_mean((logps - old_logps) ** 2, mask),
            "loss/policy": loss.detach(),
        }
    return LossOutput(loss=loss, stats=stats)


def ppo_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, cliprange_value: float
) -> LossOutput:
    """PPO's clipped value loss, ``0.5 * mean_t max((V - R)^2, (clip(V, V_old +- c) - R)^2)`` (TRL's form).

    Returns:
        `LossOutput` with stats ``val/clipfrac`` and ``loss/value``.
    """
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    losses1 = (values - returns) ** 2
    losses2 = (clipped - returns) ** 2
    loss = 0.5 * masked_mean(torch.max(losses1, losses2), mask)
    with torch.no_grad():
        stats = {"val/clipfrac": masked_mean((losses2 > losses1).float(), mask), "loss/value": loss.detach()}
    return LossOutput(loss=loss, stats=stats)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax of ``logits`` ``(..., V)``, per position ``(...)``."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
