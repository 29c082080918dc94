"""Rewards to advantages: GRPO's group-relative baseline and PPO's GAE, as pure functions.

Every function here is a pure function of tensors: no module state, no randomness. Conventions
are TRL's (1.16): NaN marks a reward a function could not give (``None``), the group of a
completion is ``num_generations`` consecutive rows, and stds are population stds (``nanstd``).
"""

from __future__ import annotations

import torch
from torch import Tensor

ADV_EPS = 1e-4
"""Added to the std before dividing, as TRL does."""


_SCALE_REWARDS = ("group", "batch", "none")


def normalize_scale_rewards(value: str | bool) -> str:
    """TRL's ``scale_rewards``: "group", "batch" or "none"; ``True``/``False`` mean "group"/"none" as in TRL."""
    if value is True:
        return "group"
    if value is False:
        return "none"
    if value not in _SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {_SCALE_REWARDS} (or True/False), got {value!r}")
    return str(value)


def nanstd(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Standard deviation ignoring NaNs, with Bessel's correction (TRL's ``nanstd``)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    variance = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    variance = variance * count / (count - 1)
    out = variance.sqrt()
    if not keepdim:
        out = out.squeeze(dim) if dim is not None else out.reshape(())
    return out


def combine_rewards(rewards_per_func: Tensor, reward_weights: Tensor | None = None) -> Tensor:
    """Weighted sum of the reward functions' outputs, ignoring missing (NaN) entries.

    Args:
        rewards_per_func: ``(N, F)`` one column per reward function; NaN where a function returned None.
        reward_weights: ``(F,)``; ``None`` weighs each function by 1.

    Returns:
        ``(N,)`` rewards; NaN for a row where every function returned None (TRL's "unscorable").
    """
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func must be (N, F), got shape {tuple(rewards_per_func.shape)}")
    n_funcs = rewards_per_func.shape[1]
    if reward_weights is None:
        reward_weights = torch.ones(n_funcs, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    if reward_weights.shape != (n_funcs,):
        raise ValueError(
            f"reward_weights must have one weight per reward function ({n_funcs}), got shape "
            f"{tuple(reward_weights.shape)}"
        )
    rewards = (rewards_per_func * reward_weights.to(rewards_per_func).unsqueeze(0)).nansum(dim=1)  # (N,)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    return rewards.masked_fill(unscorable, float("nan"))


def group_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: str | bool = "group"
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO's advantages: each reward minus its group's mean, optionally divided by a std.

    ``A_i = (r_i - mean(r_group)) / (std + 1e-4)`` (Shao et al. 2024, arXiv 2402.03300, sec. 4.1.2),
    the std being the group's ("group"), the whole batch's ("batch", Liu et al. 2025's suggestion)
    or none ("none": Dr. GRPO, arXiv 2503.20783). NaN rewards stay out of means and stds and get
    advantage 0, as in TRL.

    Args:
        rewards: ``(N,)`` with ``N = P * num_generations``, groups contiguous.
        num_generations: group size G (>= 1).
        scale_rewards: "group", "batch", "none" (or TRL's True / False).

    Returns:
        ``(N,)`` advantages and detached stats: ``std`` ``(N,)`` the std used (or that would be used,
        for "none"), and ``frac_reward_zero_std``.
    """
    scale = normalize_scale_rewards(scale_rewards)
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations!r}")
    if rewards.dim() != 1 or rewards.numel() % num_generations:
        raise ValueError(
            f"rewards must be (N,) with N a multiple of num_generations={num_generations}, got shape "
            f"{tuple(rewards.shape)}"
        )
    rewards = rewards.float()
    grouped = rewards.view(-1, num_generations)  # (P, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations)  # (N,)
    if scale == "batch":
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    elif num_generations > 1:
        std = nanstd(grouped, dim=1).repeat_interleave(num_generations)
    else:
        std = torch.zeros_like(rewards)
    advantages = rewards - mean
    if scale != "none":
        advantages = advantages / (std + ADV_EPS)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return advantages, {"std": std.detach(), "frac_reward_zero_std": is_std_zero.float().mean().detach()}


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is true (all of them, or along ``dim``)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over the masked entries, with Bessel's correction by default (TRL's ``masked_var``)."""
    mean = masked_mean(x, mask)
    variance = masked_mean((x - mean) ** 2, mask)
    if unbiased:
        count = mask.sum()
        if count <= 1:
            raise ValueError(f"masked_var needs at least 2 masked entries for an unbiased variance, got {int(count)}")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """``(x - mean) / sqrt(var + 1e-8)`` over the masked entries; ``shift_mean=False`` adds the mean back."""
    mean, var = masked_mean(x, mask), masked_var(x, mask)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1") -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from samples of ``pi`` (Schulman's k1 / k3).

    k1 = ``log pi - log pi_ref``; k3 = ``(r - 1) - log r`` with ``r = pi_ref / pi``.
    """
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {estimator!r}")


def ppo_token_rewards(
    scores: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    kl_estimator: str = "k1",
    whiten_rewards: bool = False,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token PPO rewards: ``-kl_coef * KL`` at every token, plus the score at the last token.

    The shaped reward of Ziegler et al. 2019 (arXiv 1909.08593, eq. 2), as TRL's PPO trainer builds it.

    Args:
        scores: ``(B,)`` sequence-level reward of each completion.
        logprobs, ref_logprobs: ``(B, T)`` per-token log-probabilities of the policy and the reference.
        mask: ``(B, T)`` true on completion tokens (a prefix of each row).
        kl_coef: weight of the KL penalty.
        kl_estimator: "k1" or "k3".
        whiten_rewards: whiten the rewards over the masked tokens without shifting their mean.

    Returns:
        ``(B, T)`` rewards (0 outside ``mask``) and detached stats ``kl`` ``(B, T)``, ``non_score_reward`` ``(B,)``.
    """
    mask = mask.bool()
    kl = kl_estimate(logprobs, ref_logprobs, kl_estimator).masked_fill(~mask, 0.0)  # (B, T)
    non_score = -kl_coef * kl
    rewards = non_score.clone()
    last = (mask.sum(1) - 1).clamp(min=0)  # (B,) index of each completion's last token
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False).masked_fill(~mask, 0.0)
    return rewards, {"kl": kl.detach(), "non_score_reward": non_score.sum(1).detach()}


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over each completion's tokens.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``
    (Schulman et al. 2016, arXiv 1506.02438, eq. 16), with ``V`` and ``A`` taken as 0 after a
    completion's last token. Returns are ``A + V``.

    Args:
        rewards, values: ``(B, T)``.
        mask: ``(B, T)`` true on completion tokens (a prefix of each row).

    Returns:
        ``(advantages, returns)``, each ``(B, T)``, 0 outside ``mask``.
    """
    mask_f = mask.to(values.dtype)
    values = values * mask_f
    rewards = rewards * mask_f
    steps = rewards.shape[1]
    last_gae = torch.zeros_like(rewards[:, 0])
    reversed_adv: list[Tensor] = []
    for t in reversed(range(steps)):
        next_values = values[:, t + 1] if t < steps - 1 else torch.zeros_like(values[:, t])
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae = (delta + gamma * lam * last_gae) * mask_f[:, t]
        reversed_adv.append(last_gae)
    advantages = torch.stack(reversed_adv[::-1], dim=1)  # (B, T)
    returns = (advantages + values) * mask_f
    return advantages, returns
