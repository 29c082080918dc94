"""Advantages (each scale_rewards), reward combination with None, KL-shaped rewards and GAE by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_tlt.rl.advantages import (
    ADV_EPS,
    combine_rewards,
    gae,
    group_advantages,
    kl_estimate,
    masked_whiten,
    ppo_token_rewards,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of 4; the second has std 0


def test_group_scaling_by_hand() -> None:
    adv, stats = group_advantages(REWARDS, 4, "group")
    std = math.sqrt(4 * 0.25 / 3)  # Bessel-corrected std of (1, 0, 0, 1)
    a = 0.5 / (std + ADV_EPS)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a, 0.0, 0.0, 0.0, 0.0]))
    assert stats["frac_reward_zero_std"].item() == pytest.approx(0.5)


def test_batch_scaling_by_hand() -> None:
    adv, _ = group_advantages(REWARDS, 4, "batch")
    std = math.sqrt(5.5 / 7)  # over all 8 rewards, mean 1.25
    centred = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, centred / (std + ADV_EPS))


def test_no_scaling_and_trl_booleans() -> None:
    adv, _ = group_advantages(REWARDS, 4, "none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(REWARDS, 4, False)[0], adv)
    torch.testing.assert_close(group_advantages(REWARDS, 4, True)[0], group_advantages(REWARDS, 4, "group")[0])


def test_trl_formula_on_random_rewards() -> None:
    # TRL 1.16 `_generate_and_score_completions`, "sum_then_normalize", re-derived
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g)
    rewards[5] = float("nan")
    mean = torch.nanmean(rewards.view(-1, 6), dim=1).repeat_interleave(6)
    for scale in ("group", "batch", "none"):
        std = nanstd(rewards) if scale == "batch" else nanstd(rewards.view(-1, 6), dim=1).repeat_interleave(6)
        expected = rewards - mean
        if scale != "none":
            expected = expected / (std + 1e-4)
        expected = torch.nan_to_num(expected, nan=0.0)
        torch.testing.assert_close(group_advantages(rewards, 6, scale)[0], expected)


def test_combine_rewards_weights_and_none_like_trl() -> None:
    nan = float("nan")
    per_func = torch.tensor([[1.0, 2.0], [nan, 3.0], [nan, nan], [0.5, nan]])
    out = combine_rewards(per_func, torch.tensor([1.0, 0.5]))
    assert out[0].item() == pytest.approx(2.0)
    assert out[1].item() == pytest.approx(1.5)  # a None counts as missing, not as a score
    assert math.isnan(out[2].item())  # unscorable: every function returned None
    assert out[3].item() == pytest.approx(0.5)
    adv, _ = group_advantages(out, 4, "none")
    assert adv[2].item() == 0.0  # unscorable rows get no advantage
    assert adv[0].item() == pytest.approx(2.0 - 4.0 / 3)  # the baseline ignores the NaN row


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="scale_rewards must be one of .* got 'std'"):
        group_advantages(REWARDS, 4, "std")
    with pytest.raises(ValueError, match="multiple of num_generations=3"):
        group_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="one weight per reward function"):
        combine_rewards(torch.zeros(2, 2), torch.ones(3))
    with pytest.raises(ValueError, match="kl_estimator must be 'k1' or 'k3', got 'k2'"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k2")


def test_gae_by_hand() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 7.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - .7 = .3; d1 = .9*.7 - .6 = .03; d0 = .9*.6 - .5 = .04; gamma*lam = .72
    a2 = 0.3
    a1 = 0.03 + 0.72 * a2
    a0 = 0.04 + 0.72 * a1
    # row 1 ends after two tokens: d1 = 1 - .4 = .6; d0 = .9*.4 - .2 = .16
    b1 = 0.6
    b0 = 0.16 + 0.72 * b1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2], [b0, b1, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.6, a2 + 0.7], [b0 + 0.2, b1 + 0.4, 0.0]]))


def test_gae_matches_trl_loop_on_full_rows() -> None:
    g = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    last, out = 0.0, []
    for t in reversed(range(5)):  # TRL's PPO trainer loop
        nextv = values[:, t + 1] if t < 4 else 0.0
        delta = rewards[:, t] + 0.97 * nextv - values[:, t]
        last = delta + 0.97 * 0.9 * last
        out.append(last)
    expected = torch.stack(out[::-1], dim=1)
    adv, ret = gae(rewards, values, torch.ones(3, 5), gamma=0.97, lam=0.9)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected + values)


def test_kl_shaped_rewards_and_whitening() -> None:
    logp = torch.tensor([[-1.0, -2.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0]])
    rewards, stats = ppo_token_rewards(torch.tensor([3.0]), logp, ref, mask, kl_coef=0.1, kl_estimator="k1")
    # k1 = logp - ref = [.5, -1, masked]; score lands on the last completion token (index 1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.1 + 3.0, 0.0]]))
    assert stats["non_score_reward"].item() == pytest.approx(0.05)
    k3 = kl_estimate(logp, ref, "k3")
    assert k3[0, 0].item() == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    assert (k3 >= 0).all()
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    m = torch.tensor([[1, 1, 1, 0]])
    w = masked_whiten(x, m, shift_mean=True)
    assert w[0, :3].tolist() == pytest.approx([-1.0, 0.0, 1.0], abs=1e-6)  # unbiased var of 1,2,3 is 1
    assert masked_whiten(x, m, shift_mean=False)[0, :3].tolist() == pytest.approx([1.0, 2.0, 3.0], abs=1e-6)
