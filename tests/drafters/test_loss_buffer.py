"""The EAGLE drafter loss (hand-computed) and the feature replay buffer (alignment, packing, ring, state)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

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


def _one_window_plan(*windows: tuple[int, int, int], segments: int = 4) -> torch.Tensor:
    """A one-row plan of the given (first slot, first position, draft rows) windows."""
    row = list(windows) + [(-1, 0, 0)] * (segments - len(windows))
    return torch.tensor([row], dtype=torch.long)


def test_buffer_strips_padding_and_aligns() -> None:
    buf = FeatureReplayBuffer(capacity_tokens=64, heldout_fraction=0.0)
    feats, ids, attn, comp = _padded_batch()
    assert buf.add(feats, ids, attn, comp, step=3) == 2
    assert buf.summary()["tokens"] == 10 and buf.num_train == 2
    assert buf.tokens is not None and buf.tokens.dtype == torch.int32  # compact storage
    assert buf.tokens[:10].tolist() == [5, 6, 7, 8, 9, 1, 2, 3, 4, 10]  # padding stripped, one after the other
    # both sequences packed into one row of 8 draft rows: [5..9] (4 rows) then [1, 2, 3, 4, 10] (4 rows)
    batch = buf.gather(_one_window_plan((0, 0, 4), (5, 0, 4)), 8)
    # row t of a window: feature x_t, input x_{t+1}, target feature x_{t+1}, position t
    assert batch.features[0, :, 0].tolist() == [5, 6, 7, 8, 1, 2, 3, 4]
    assert batch.input_ids[0].tolist() == [6, 7, 8, 9, 2, 3, 4, 10]
    assert batch.target_features[0, :, 0].tolist() == [6, 7, 8, 9, 2, 3, 4, 10]
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    # a row counts where its input token is a completion token
    assert batch.loss_mask[0].tolist() == [False, True, True, True, False, False, False, True]
    keep = batch.attention_mask
    assert keep is not None and keep.shape == (1, 8, 8)
    assert keep[0, 3].tolist() == [True] * 4 + [False] * 4  # causal inside the first window
    assert keep[0, 5].tolist() == [False] * 4 + [True, True, False, False]  # never across windows


def test_gather_pads_unused_rows_and_masks_them() -> None:
    buf = FeatureReplayBuffer(capacity_tokens=64, heldout_fraction=0.0)
    buf.add(*_padded_batch(), step=0)
    batch = buf.gather(_one_window_plan((5, 0, 4)), 6)  # 4 real rows, 2 padding rows
    assert batch.loss_mask[0].tolist() == [False, False, False, True, False, False]
    keep = batch.attention_mask
    assert keep is not None and not keep[0, :, 4:].any()  # padding is never attended to


def test_ring_evicts_the_oldest_and_keeps_contents() -> None:
    buf = FeatureReplayBuffer(capacity_tokens=24, heldout_fraction=0.0)
    for step in range(6):  # 6 x 10 tokens through a ring of 24: at most two sequences live
        ids = torch.arange(10).unsqueeze(0) + 100 * step
        comp = (torch.arange(10) >= 3).long().unsqueeze(0)
        buf.add(ids.float().unsqueeze(-1), ids, torch.ones_like(ids), comp, step=step)
        assert buf.num_tokens <= 24
    assert [s.step for s in buf.sequences] == [4, 5] and buf.summary()["added"] == 6
    for seq in buf.sequences:  # each live sequence is intact where its metadata says
        assert buf.features is not None and buf.tokens is not None
        stored = buf.tokens[seq.offset : seq.offset + seq.length].tolist()
        assert stored == list(range(100 * seq.step, 100 * seq.step + 10))
        assert buf.features[seq.offset : seq.offset + seq.length, 0].tolist() == [float(t) for t in stored]


class _UniqueIndexPut(TorchDispatchMode):
    """Fails on an ``index_put_`` with a repeated index (undefined on CUDA: the writes race)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN204
        if func.overloadpacket.__name__ in ("index_put_", "index_put"):
            index = args[1][0]
            assert index.unique().numel() == index.numel(), f"{index.numel()} writes to {index.unique().numel()} slots"
        return func(*args, **(kwargs or {}))


def test_one_harvest_larger_than_the_ring_writes_each_slot_once() -> None:
    buf = FeatureReplayBuffer(capacity_tokens=64, heldout_fraction=0.0)
    ids = torch.arange(200).view(10, 20)  # 200 tokens into a ring of 64: the harvest laps it
    completion = (torch.arange(20) >= 5).long().expand(10, 20)
    with _UniqueIndexPut():
        added = buf.add(ids.float().unsqueeze(-1), ids, torch.ones_like(ids), completion, step=0)
    assert added == len(buf.sequences) == 3 and buf.num_tokens <= 64  # only the sequences still held count
    assert buf.tokens is not None and buf.features is not None
    for seq in buf.sequences:  # each is its own row's tokens and features, written once
        stored = buf.tokens[seq.offset : seq.offset + seq.length].tolist()
        assert stored == list(range(stored[0], stored[0] + 20)) and stored[0] % 20 == 0
        assert buf.features[seq.offset : seq.offset + seq.length, 0].tolist() == [float(t) for t in stored]


def test_plan_fills_rows_with_windows_that_hold_targets() -> None:
    buf = FeatureReplayBuffer(capacity_tokens=256, heldout_fraction=0.0, seed=0)
    n = 40
    ids = torch.arange(n).unsqueeze(0)
    comp = (torch.arange(n) >= 10).long().unsqueeze(0)
    buf.add(ids.float().unsqueeze(-1), ids, torch.ones_like(ids), comp, step=0)
    for _ in range(10):
        plan = buf.plan(rows=2, length=5, segments=4)
        assert plan.shape == (2, 4, 3) and plan[:, :, 2].sum(1).tolist() == [5, 5]  # every row full
        b = buf.gather(plan, 5)
        start = int(b.position_ids[0, 0])
        assert b.position_ids[0].tolist() == list(range(start, start + 5))  # positions stay absolute
        assert b.features[0, :, 0].tolist() == [float(p) for p in range(start, start + 5)]
        assert b.loss_mask[0].any()  # a cropped window always holds completion targets
    short = FeatureReplayBuffer(capacity_tokens=64, heldout_fraction=0.0, seed=0)
    short.add(*_padded_batch(), step=0)
    plan = short.plan(rows=1, length=9, segments=2)  # two whole sequences (4 rows each), then segments run out
    assert plan[0, :, 2].tolist() == [4, 4]
    with pytest.raises(ValueError, match="no training sequences"):
        FeatureReplayBuffer().plan(2, 4, 2)


def test_heldout_plans_cover_every_row_once() -> None:
    buf = FeatureReplayBuffer(capacity_tokens=512, heldout_fraction=0.5, seed=3)
    gen = torch.Generator().manual_seed(0)
    for step in range(8):
        ids = torch.randint(1, 100, (2, 30), generator=gen)
        comp = (torch.arange(30) >= 5).long().expand(2, 30)
        buf.add(ids.float().unsqueeze(-1), ids, torch.ones_like(ids), comp, step=step)
    heldout = [s for s in buf.sequences if s.heldout]
    assert 0 < len(heldout) < len(buf)
    plans = buf.heldout_plans(rows=2, length=16, segments=3)
    rows = torch.stack(plans)[..., 2].sum().item()
    assert rows == sum(s.length - 1 for s in heldout)  # every draft row of every held-out sequence once
    assert sum(bool(b.loss_mask.any()) for b in (buf.gather(p, 16) for p in plans)) == len(plans)
    assert len(buf.heldout_plans(2, 16, 3, max_sequences=1)) == 1


def test_state_dict_round_trip_is_exact_and_compact() -> None:
    buf = FeatureReplayBuffer(capacity_tokens=40, heldout_fraction=0.2, seed=1, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        ids = torch.randint(1, 100, (2, 12), generator=gen)
        comp = (torch.arange(12) >= 4).long().expand(2, 12)
        buf.add(torch.randn(2, 12, 8, generator=gen), ids, torch.ones_like(ids), comp, step=step)
    state = buf.state_dict()
    assert state["features"].dtype == torch.bfloat16 and state["tokens"].dtype == torch.int32
    assert state["features"].shape[0] == buf.num_tokens <= 40  # bounded by tokens, live sequences only
    other = FeatureReplayBuffer(capacity_tokens=40, heldout_fraction=0.2, seed=99, dtype=torch.bfloat16)
    other.load_state_dict(state)
    assert [(s.offset, s.step, s.heldout) for s in other.sequences] == [(s.offset, s.step, s.heldout) for s in buf.sequences]
    for _ in range(3):  # the same draws from the same data
        plan = buf.plan(2, 6, 3)
        assert torch.equal(plan, other.plan(2, 6, 3))
        a, b = buf.gather(plan, 6), other.gather(plan, 6)
        assert torch.equal(a.features[a.loss_mask], b.features[b.loss_mask])
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
    ids = torch.randint(1, 100, (1, 12), generator=gen)  # and it evicts the same way afterwards
    for target in (buf, other):
        target.add(torch.zeros(1, 12, 8), ids, torch.ones_like(ids), (torch.arange(12) >= 4).long()[None], step=9)
    assert [s.step for s in other.sequences] == [s.step for s in buf.sequences]
    with pytest.raises(ValueError, match="resume with the same buffer_tokens"):
        FeatureReplayBuffer(capacity_tokens=41).load_state_dict(state)


def test_buffer_skips_rows_without_completion() -> None:
    buf = FeatureReplayBuffer(heldout_fraction=0.0)
    ids = torch.tensor([[1, 2, 3]])
    assert buf.add(torch.zeros(1, 3, 2), ids, torch.ones_like(ids), torch.zeros_like(ids), step=0) == 0
    # a completion at the first token only has no draft row to predict it
    assert buf.add(torch.zeros(1, 3, 2), ids, torch.ones_like(ids), torch.tensor([[1, 0, 0]]), step=0) == 0
    with pytest.raises(ValueError, match="must agree"):
        buf.add(torch.zeros(1, 2, 2), ids, torch.ones_like(ids), torch.zeros_like(ids), step=0)
