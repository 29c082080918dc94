"""The EAGLE drafter loss (hand-computed) and the feature replay buffer (alignment, bounds, windows)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_tlt.drafters.buffer import FeatureReplayBuffer
from lightning_tlt.drafters.loss import eagle_loss, expected_acceptance_length


def test_eagle_loss_by_hand() -> None:
    pred = torch.tensor([[[0.0, 2.0], [1.0, 1.0]]])  # (1, 2, 2)
    target = torch.tensor([[[0.5, 0.0], [1.0, 1.0]]])
    pred_logits = torch.tensor([[[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]]])
    target_logits = torch.tensor([[[0.0, math.log(3.0), 0.0], [5.0, 0.0, 0.0]]])
    mask = torch.tensor([[True, False]])  # only row 0 counts
    out = eagle_loss(pred, target, pred_logits, target_logits, mask, feature_weight=1.0, token_weight=0.1)
    # SmoothL1 (beta 1) on row 0: |0-0.5| -> 0.5*0.25 = 0.125; |2-0| -> 2 - 0.5 = 1.5; mean 0.8125
    assert out.stats["feature_loss"].item() == pytest.approx(0.8125)
    # soft CE: target probs (0.2, 0.6, 0.2), pred uniform -> log 3
    assert out.stats["token_loss"].item() == pytest.approx(math.log(3.0), rel=1e-6)
    assert out.loss.item() == pytest.approx(0.8125 + 0.1 * math.log(3.0), rel=1e-6)
    # accept rate sum(min(p, q)) = min(.2,1/3)+min(.6,1/3)+min(.2,1/3) = 0.2 + 1/3 + 0.2
    assert out.stats["accept_rate"].item() == pytest.approx(0.4 + 1 / 3, rel=1e-6)
    assert out.stats["top1_accuracy"].item() == 0.0  # argmax pred 0 (ties -> first) vs target 1
    assert out.stats["num_rows"].item() == 1
    assert out.loss.requires_grad is False  # inputs need no grad here; with grad inputs it has one
    pred.requires_grad_(True)
    out = eagle_loss(pred, target, pred_logits, target_logits, mask)
    out.loss.backward()
    assert pred.grad is not None and torch.all(pred.grad[0, 1] == 0)  # masked row gets no gradient
    assert all(not v.requires_grad for v in out.stats.values())


def test_eagle_loss_empty_mask_and_bad_weights() -> None:
    x = torch.randn(1, 3, 4, requires_grad=True)
    out = eagle_loss(
        x, x.detach(), torch.randn(1, 3, 5), torch.randn(1, 3, 5), torch.zeros(1, 3, dtype=torch.bool)
    )
    assert out.loss.item() == 0.0 and out.loss.requires_grad
    with pytest.raises(ValueError, match="loss weights must be >= 0"):
        eagle_loss(x, x, x, x, torch.ones(1, 3), token_weight=-1.0)


def test_expected_acceptance_length() -> None:
    assert expected_acceptance_length(0.0, 4) == 1.0
    assert expected_acceptance_length(1.0, 4) == 5.0
    assert expected_acceptance_length(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    with pytest.raises(ValueError, match="accept_rate must be in"):
        expected_acceptance_length(1.5, 2)


def _padded_batch() -> tuple[torch.Tensor, ...]:
    # row 0: 2 pad, prompt [5, 6], completion [7, 8, 9]; row 1: prompt [1, 2, 3, 4], completion [10], 2 pad
    ids = torch.tensor([[0, 0, 5, 6, 7, 8, 9], [1, 2, 3, 4, 10, 0, 0]])
    attn = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]])
    comp = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 0, 0]])
    feats = ids.float().unsqueeze(-1).expand(2, 7, 3).clone()  # feature = token id, to track alignment
    return feats, ids, attn, comp


def test_buffer_strips_padding_and_aligns() -> None:
    buf = FeatureReplayBuffer(capacity=8, heldout_fraction=0.0, max_len=16)
    feats, ids, attn, comp = _padded_batch()
    assert buf.add(feats, ids, attn, comp, step=3) == 2
    assert buf.summary()["tokens"] == 10 and buf.summary()["completion_tokens"] == 4
    batch = buf._collate(list(buf._train), None, crop=False)
    # row 0: sequence [5, 6, 7, 8, 9] -> rows t = 0..3: feature x_t, input x_{t+1}, target feature x_{t+1}
    assert batch.features[0, :4, 0].tolist() == [5, 6, 7, 8]
    assert batch.input_ids[0, :4].tolist() == [6, 7, 8, 9]
    assert batch.target_features[0, :4, 0].tolist() == [6, 7, 8, 9]
    assert batch.position_ids[0, :4].tolist() == [0, 1, 2, 3]
    assert batch.loss_mask[0].tolist() == [False, True, True, True]  # input token is a completion token
    # row 1: [1, 2, 3, 4, 10]: only the row whose input is 10 counts
    assert batch.input_ids[1].tolist() == [2, 3, 4, 10]
    assert batch.loss_mask[1].tolist() == [False, False, False, True]
    assert batch.attention_mask is not None and batch.attention_mask.all()


def test_buffer_capacity_heldout_and_state() -> None:
    buf = FeatureReplayBuffer(capacity=10, heldout_fraction=0.2, max_len=16, seed=1)
    feats, ids, attn, comp = _padded_batch()
    for step in range(20):
        buf.add(feats, ids, attn, comp, step=step)
    assert len(buf) == 10 and buf.num_heldout == 2 and buf.num_train == 8
    summary = buf.summary()
    assert summary["added"] == 40 and summary["max_step"] == 19 and summary["min_step"] >= 14
    heldout = buf.heldout()
    assert heldout is not None and heldout.features.shape[0] == 2
    sample = buf.sample(5)
    assert sample.features.shape[0] == 5
    state = buf.state_dict()
    other = FeatureReplayBuffer(capacity=10, heldout_fraction=0.2, max_len=16, seed=99)
    other.load_state_dict(state)
    assert torch.equal(other._generator.get_state(), buf._generator.get_state())
    with pytest.raises(ValueError, match="no training sequences"):
        FeatureReplayBuffer().sample(2)


def test_buffer_crops_long_sequences_with_true_positions() -> None:
    buf = FeatureReplayBuffer(capacity=4, heldout_fraction=0.0, max_len=6, seed=0)
    n = 40
    ids = torch.arange(n).unsqueeze(0)
    comp = (torch.arange(n) >= 10).long().unsqueeze(0)
    buf.add(ids.float().unsqueeze(-1), ids, torch.ones_like(ids), comp, step=0)
    for _ in range(10):
        b = buf.sample(1)
        start = int(b.position_ids[0, 0])
        assert b.features.shape[1] == 5  # window of 6 tokens -> 5 rows
        assert b.position_ids[0].tolist() == list(range(start, start + 5))  # positions stay absolute
        assert b.features[0, :, 0].tolist() == [float(p) for p in range(start, start + 5)]
        assert b.loss_mask.any()


def test_buffer_skips_rows_without_completion() -> None:
    buf = FeatureReplayBuffer(heldout_fraction=0.0)
    ids = torch.tensor([[1, 2, 3]])
    assert buf.add(torch.zeros(1, 3, 2), ids, torch.ones_like(ids), torch.zeros_like(ids), step=0) == 0
    with pytest.raises(ValueError, match="must agree"):
        buf.add(torch.zeros(1, 2, 2), ids, torch.ones_like(ids), torch.zeros_like(ids), step=0)
