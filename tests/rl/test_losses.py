"""GRPO and PPO losses: hand-computed values, and parity with TRL 1.16's own `_compute_loss`."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from lightning_tlt.rl.losses import (
    LOSS_AGGREGATIONS,
    entropy_from_logits,
    grpo_loss,
    ppo_policy_loss,
    ppo_value_loss,
)

# Two completions of three tokens; the second one is two tokens long.
LOGPS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, -3.0]])
LOG_RATIO = torch.tensor([[0.3, -0.5, 0.0], [-0.5, 0.4, 0.0]])
OLD = LOGPS - LOG_RATIO
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
ADV = torch.tensor([1.0, -2.0])

# Per token, by hand, with epsilon 0.2: -min(r * A, clip(r, 0.8, 1.2) * A)
ROW0 = [-1.2, -math.exp(-0.5), -1.0]  # r = e^.3 clipped to 1.2; r = e^-.5 unclipped (min); r = 1
ROW1 = [1.6, 2 * math.exp(0.4)]  # A = -2: r = e^-.5 -> clip .8 gives -1.6; r = e^.4 -> r * A is smaller
TOKEN_SUM = sum(ROW0) + sum(ROW1)

HAND = {
    "dapo": TOKEN_SUM / 5,
    "bnpo": TOKEN_SUM / 5,
    "grpo": (sum(ROW0) / 3 + sum(ROW1) / 2) / 2,
    "dr_grpo": TOKEN_SUM / (2 * 4),
}


@pytest.mark.parametrize("loss_type", sorted(HAND))
def test_grpo_loss_matches_hand_computed_values(loss_type: str) -> None:
    out = grpo_loss(LOGPS, OLD, ADV, MASK, loss_type=loss_type, max_completion_length=4)
    assert out.loss.item() == pytest.approx(HAND[loss_type], rel=1e-6)
    # one token of five is low-clipped (row 1 token 0), one high-clipped (row 0 token 0)
    assert out.stats["clip_ratio/low_mean"].item() == pytest.approx(0.2)
    assert out.stats["clip_ratio/high_mean"].item() == pytest.approx(0.2)
    assert out.stats["clip_ratio/region_mean"].item() == pytest.approx(0.4)
    assert "kl" not in out.stats


def test_registry_holds_trl_loss_types() -> None:
    assert {"grpo", "bnpo", "dr_grpo", "dapo"} <= set(LOSS_AGGREGATIONS)
    with pytest.raises(ValueError, match="loss_type must be one of .* got 'nope'"):
        grpo_loss(LOGPS, OLD, ADV, MASK, loss_type="nope")


def test_asymmetric_clip_and_k3_kl_by_hand() -> None:
    ref = LOGPS + torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, 5.0]])
    out = grpo_loss(
        LOGPS, OLD, ADV, MASK, loss_type="bnpo", epsilon_high=0.28, beta=0.5, ref_logps=ref,
        use_bias_correction_kl=False,
    )
    # epsilon_high .28: row 0 token 0 (r = e^.3 = 1.3499) is clipped at 1.28 now
    row0 = [-1.28, -math.exp(-0.5), -1.0]
    k3 = [[math.exp(d) - d - 1 for d in row] for row in ([0.1, -0.2, 0.0], [0.3, 0.0])]
    per_token = [a + 0.5 * b for a, b in zip(row0, k3[0])] + [a + 0.5 * b for a, b in zip(ROW1, k3[1])]
    assert out.loss.item() == pytest.approx(sum(per_token) / 5, rel=1e-6)
    assert out.stats["kl"].item() == pytest.approx(sum(sum(r) for r in k3) / 5, rel=1e-6)


def test_sequence_level_ratio_by_hand() -> None:
    out = grpo_loss(LOGPS, OLD, ADV, MASK, loss_type="grpo", importance_sampling_level="sequence")
    s0, s1 = math.exp((0.3 - 0.5 + 0.0) / 3), math.exp((-0.5 + 0.4) / 2)
    l0 = -min(s0 * 1.0, min(max(s0, 0.8), 1.2) * 1.0)
    l1 = -min(s1 * -2.0, min(max(s1, 0.8), 1.2) * -2.0)
    assert out.loss.item() == pytest.approx((l0 + l1) / 2, rel=1e-6)


# ---- parity with TRL's real GRPOTrainer._compute_loss on the same inputs ----


class _OneProcess:
    num_processes = 1

    @staticmethod
    def reduce(t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return t

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather


def _trl_loss(logps: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, ref, **cfg):
    """Run TRL 1.16's ``GRPOTrainer._compute_loss`` with our log-probabilities in place of a model forward."""
    from trl import GRPOTrainer

    args = SimpleNamespace(
        use_bias_correction_kl=cfg.get("use_bias_correction_kl", True), delta=None, steps_per_generation=1
    )
    metrics: dict = {"train": defaultdict(list)}
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=cfg.get("importance_sampling_level", "token"),
        beta=cfg.get("beta", 0.0),
        args=args,
        loss_type=cfg["loss_type"],
        epsilon_low=cfg.get("epsilon_low", 0.2),
        epsilon_high=cfg.get("epsilon_high", 0.2),
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=cfg.get("max_completion_length", 512),
        accelerator=_OneProcess(),
        _entropy_bonus_enabled=False,
        _metrics=metrics,
    )
    inputs = {
        "prompt_ids": torch.zeros(logps.shape[0], 1, dtype=torch.long),
        "prompt_mask": torch.ones(logps.shape[0], 1, dtype=torch.long),
        "completion_ids": torch.zeros(logps.shape, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
    }
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(fake, None, inputs)
    return loss, metrics["train"]


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_grpo_loss_matches_trl_compute_loss(loss_type: str, level: str, beta: float) -> None:
    g = torch.Generator().manual_seed(3)
    b, t = 6, 7
    logps = -torch.rand(b, t, generator=g) * 3
    old = logps + 0.4 * torch.randn(b, t, generator=g)
    ref = logps + 0.3 * torch.randn(b, t, generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7])
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    adv = torch.randn(b, generator=g)
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, beta=beta, epsilon_low=0.2,
               epsilon_high=0.28, max_completion_length=9)
    trl_loss, trl_metrics = _trl_loss(logps, old, adv, mask, ref if beta else None, **cfg)
    ours = grpo_loss(
        logps, old, adv, mask, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        importance_sampling_level=level, beta=beta, ref_logps=ref if beta else None, max_completion_length=9,
    )
    assert ours.loss.item() == pytest.approx(trl_loss.item(), rel=1e-5, abs=1e-7)
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert ours.stats[name].item() == pytest.approx(trl_metrics[name][0], abs=1e-6), name
    if beta:
        assert ours.stats["kl"].item() == pytest.approx(trl_metrics["kl"][0], rel=1e-5)
    if level == "token":  # the clip statistics are not trivially zero on these inputs
        assert ours.stats["clip_ratio/region_mean"].item() > 0


def test_grpo_loss_gradient_is_the_policy_gradient_at_ratio_one() -> None:
    # at old == logps (first pass), d loss / d logp_t = -A / normaliser on every unmasked token
    logps = LOGPS.clone().requires_grad_(True)
    grpo_loss(logps, LOGPS.clone(), ADV, MASK, loss_type="dapo").loss.backward()
    expected = -ADV.unsqueeze(1) * MASK / MASK.sum()
    torch.testing.assert_close(logps.grad, expected)


def test_ppo_policy_loss_by_hand() -> None:
    adv = torch.tensor([[1.0, -1.0], [2.0, 0.5]])
    logr = torch.tensor([[0.5, 0.5], [-0.5, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = ppo_policy_loss(logr, torch.zeros(2, 2), adv, mask, cliprange=0.2)
    r = [math.exp(0.5), math.exp(0.5), math.exp(-0.5)]
    clipped = [1.2, 1.2, 0.8]
    a = [1.0, -1.0, 2.0]
    per = [max(-ai * ri, -ai * ci) for ai, ri, ci in zip(a, r, clipped)]
    assert out.loss.item() == pytest.approx(sum(per) / 3, rel=1e-6)
    # token 0: -A*clip = -1.2 > -1.65 -> clipped; token 1: 1.2 < 1.65; token 2: -1.6 > -1.21? no
    assert out.stats["policy/clipfrac"].item() == pytest.approx(1 / 3)
    assert out.stats["policy/approxkl"].item() == pytest.approx(0.5 * (0.25 + 0.25 + 0.25) / 3)


def test_ppo_value_loss_by_hand() -> None:
    v = torch.tensor([[1.0, 0.0]])
    old = torch.tensor([[0.5, 0.1]])
    ret = torch.tensor([[2.0, 0.0]])
    out = ppo_value_loss(v, old, ret, torch.ones(1, 2), cliprange_value=0.2)
    # token 0: (1-2)^2 = 1 vs clip(1, .3, .7) = .7 -> 1.69: max 1.69; token 1: 0 vs clip(0,-.1,.3)=0 -> 0
    assert out.loss.item() == pytest.approx(0.5 * (1.69 + 0.0) / 2)
    assert out.stats["val/clipfrac"].item() == pytest.approx(0.5)


def test_entropy_from_logits() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [1.0, 1e-12, 1e-12]]))
    ent = entropy_from_logits(logits)
    assert ent[0].item() == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)), rel=1e-6)
    assert ent[1].item() == pytest.approx(0.0, abs=1e-9)
