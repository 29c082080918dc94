"""AdaptiveGate hysteresis and DraftLengthTuner choice, convergence, timing and state."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from lightning_tlt.rollout.gate import AdaptiveGate
from lightning_tlt.rollout.spec_metrics import SpeculationMetrics
from lightning_tlt.rollout.tuner import DraftLengthTuner


def test_gate_turns_on_after_hysteresis_and_off_after_the_same_count() -> None:
    gate = AdaptiveGate(threshold=4, hysteresis_steps=3)
    rows = [8, 8, 4, 3, 5, 4, 4, 4, 3, 9, 9, 2, 9, 9, 9, 9]
    got = [gate.update(r) for r in rows]
    #        8      8      4      3      5 (streak reset) 4      4      4 -> on
    want = [False, False, False, False, False, False, False, True,
            # 3    9     9     2 (reset) 9     9     9 -> off  9
            True, True, True, True, True, True, False, False]  # fmt: skip
    assert got == want
    assert gate.switches == 2 and not gate.on


def test_gate_does_not_flap_around_the_threshold() -> None:
    gate = AdaptiveGate(threshold=32, hysteresis_steps=10)
    for _ in range(10):
        gate.update(32)
    assert gate.on
    # alternating just above and at the threshold never builds a streak of 10
    for i in range(100):
        assert gate.update(33 if i % 2 == 0 else 32)
    assert gate.switches == 1


def test_gate_hard_limit_reset_and_state() -> None:
    gate = AdaptiveGate(threshold=4, hysteresis_steps=2, hard_limit=8)
    assert [gate.update(r) for r in (2, 2, 6, 9)] == [False, True, True, False]  # 9 > hard_limit: off at once
    gate.update(1)
    state = gate.state_dict()
    assert state == {"on": False, "streak": 1, "switches": 2}
    other = AdaptiveGate(threshold=4, hysteresis_steps=2, hard_limit=8)
    other.load_state_dict(state)
    assert other.update(1) and gate.update(1)  # both complete the streak on the same step
    gate.reset()
    assert not gate.on and gate.update(1) is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"threshold": 0}, "threshold must be >= 1"),
        ({"hysteresis_steps": 0}, "hysteresis_steps must be >= 1"),
        ({"threshold": 8, "hard_limit": 4}, "hard_limit must be >= threshold"),
    ],
)
def test_gate_bad_config(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AdaptiveGate(**kwargs)


def test_tuner_static_table_and_buckets() -> None:
    tuner = DraftLengthTuner(candidates=(2, 4, 6, 8), epsilon=0.0, buckets=(1, 4, 20), min_samples=0)
    assert [tuner.bucket(r) for r in (1, 2, 4, 5, 20, 21, 500)] == [0, 1, 1, 2, 2, 3, 3]
    # before any measurement the table is the choice; TLT's shape: batch 1 -> longest drafts, larger -> shorter
    assert [tuner.choose(r) for r in (1, 3, 10, 64)] == [8, 6, 4, 2]
    custom = DraftLengthTuner(candidates=(1, 3), buckets=(2,), table=(3, 1), epsilon=0.0, min_samples=0)
    assert custom.choose(1) == 3 and custom.choose(7) == 1
    # with first tries to make, they go shortest first (plain, then 2, 4, ...), each min_samples times
    exploring = DraftLengthTuner(candidates=(0, 2, 4), epsilon=0.0, buckets=(1,), min_samples=2)
    order = []
    for _ in range(6):
        k = exploring.choose(1)
        order.append(k)
        exploring.record(1, k, 1 + k, 1e-3 * (1 + 0.1 * k))  # every draft accepted: no arm is ruled out
    assert order == [0, 0, 2, 2, 4, 4]


def _true_rate(bucket: int, k: int) -> float:
    # tokens/s peaks at a different k per bucket: 6 for small batches, 2 for large ones
    best = {0: 6, 1: 6, 2: 2, 3: 2}[bucket]
    return 1000.0 - 60.0 * abs(k - best)


def test_tuner_converges_to_the_best_arm_per_bucket() -> None:
    tuner = DraftLengthTuner(candidates=(2, 4, 6, 8), epsilon=0.2, buckets=(1, 4, 20), seed=3)
    noise = torch.Generator().manual_seed(4)
    choices: dict[int, list[int]] = {1: [], 30: []}
    for step in range(1200):
        rows = 1 if step % 2 == 0 else 30
        k = tuner.choose(rows)
        choices[rows].append(k)
        seconds = 0.01
        rate = _true_rate(tuner.bucket(rows), k) * (1 + 0.1 * float(torch.randn((), generator=noise)))
        tuner.record(rows, k, rate * seconds, seconds)
    assert tuner.best(1) == 6 and tuner.best(30) == 2
    # after convergence the best arm is chosen about 1 - epsilon + epsilon / 4 = 85 % of the time
    for rows, best in ((1, 6), (30, 2)):
        recent = choices[rows][-300:]
        assert recent.count(best) / len(recent) > 0.75
    # exploration did try every arm
    assert all(tuner.value(0, k) is not None for k in (2, 4, 6, 8))


def _simulate(tuner: DraftLengthTuner, acceptance: float, steps: int, rows_cycle: tuple[int, ...] = (1, 3, 10)
              ) -> tuple[dict[int, int], float]:  # fmt: skip
    """Chain drafting with per-position acceptance ``acceptance``; a step drafting k costs 1.03 + 0.27 k
    plain steps (the H200's measured EAGLE step at 0.5 B shapes). Returns steps per k and tokens/s."""
    counts: dict[int, int] = {}
    tokens = seconds = 0.0
    for i in range(steps):
        rows = rows_cycle[i % len(rows_cycle)]
        k = tuner.choose(rows)
        per_row = sum(acceptance**i for i in range(k + 1))  # 1 + a + ... + a^k
        step_s = 1e-3 * (1.0 if k == 0 else 1.03 + 0.27 * k)
        tuner.record(rows, k, rows * per_row, step_s)
        counts[k] = counts.get(k, 0) + 1
        tokens, seconds = tokens + rows * per_row, seconds + step_s
    return counts, tokens / seconds


def test_a_useless_drafter_is_explored_at_its_shortest_draft_only() -> None:
    arms = (0, 2, 4, 6, 8)
    bounded, bounded_rate = _simulate(DraftLengthTuner(arms, epsilon=0.1, seed=0), 0.0, 400)
    every, every_rate = _simulate(DraftLengthTuner(arms, epsilon=0.1, seed=0, prune_margin=None), 0.0, 400)
    plain_rate = (1 + 3 + 10) / 3 / 1e-3
    # k = 2 accepts nothing, so 4, 6 and 8 (which can add at most 2, 3, 4 times nothing) are never tried
    assert set(bounded) == {0, 2} and bounded[2] <= 3 * 2 + 0.1 * 400
    assert all(every[k] >= 3 * 2 for k in (4, 6, 8))  # without the bound: each tried twice per bucket and more
    assert bounded_rate / plain_rate > 0.95 > every_rate / plain_rate  # 0.97 vs 0.84 of plain here


def test_a_good_drafter_still_explores_every_arm_and_keeps_the_best() -> None:
    tuner = DraftLengthTuner((0, 2, 4, 6, 8), epsilon=0.1, seed=0)
    counts, _ = _simulate(tuner, 0.9, 400)
    assert all(counts[k] >= 3 * 2 for k in (0, 2, 4, 6, 8))
    # (1 - 0.9^(k+1)) / (1 - 0.9) / (1.03 + 0.27 k) peaks at k = 6
    assert [tuner.best(r) for r in (1, 3, 10)] == [6, 6, 6]


def test_a_drafter_that_improves_reopens_the_longer_arms() -> None:
    tuner = DraftLengthTuner((0, 2, 4, 6, 8), epsilon=0.1, seed=1)
    cold, _ = _simulate(tuner, 0.0, 300)
    assert set(cold) == {0, 2} and tuner.best(1) == 0
    # co-training made the drafter good: epsilon keeps sampling k = 2, whose acceptance lifts the bound
    warm, _ = _simulate(tuner, 0.9, 900)
    assert all(warm.get(k, 0) > 0 for k in (4, 6, 8))
    assert all(tuner.best(r) >= 4 for r in (1, 3, 10))


def test_a_ruled_out_arm_never_rules_out_a_longer_one() -> None:
    """Arm 4, ruled out by arm 2, is not measured again: its old figures must not keep 6 out for good."""
    tuner = DraftLengthTuner((0, 2, 4, 6), epsilon=0.0, buckets=(1,))
    tuner.record(1, 0, 1.0, 0.01)  # plain: 100 tok/s, the bar is 95
    tuner.record(1, 4, 1.2, 1.2 / 50)  # 4: 50 tok/s, 0.2 accepted a step (alone, it would rule 6 out)
    tuner.record(1, 2, 1.5, 1.5 / 65)  # 2: 65 tok/s, 0.5 accepted: 4 reaches at most 86.7, 6 at most 108.3
    assert tuner.may_win(0, 2) and not tuner.may_win(0, 4)
    assert tuner.may_win(0, 6)


def test_acceptance_counts_only_the_rows_that_emitted() -> None:
    """Rows the engine still counts but that had finished (flags read a step late) emit nothing."""
    tuner = DraftLengthTuner((0, 2), epsilon=0.0, buckets=(4,))
    timing = tuner.start(2, 3)
    tuner.stop(timing, torch.tensor([3, 0, 0]))  # one live row took 2 drafts; two finished rows
    assert tuner.accepted()[(0, 2)] == [2.0]
    timing = tuner.start(2, 2)
    tuner.stop(timing, 4)  # a plain count: every active row counts
    assert tuner.accepted()[(0, 2)] == [2.0, 1.0]


def test_the_bound_is_kept_in_the_state() -> None:
    a = DraftLengthTuner((0, 2, 4), epsilon=0.0, buckets=(1,))
    _simulate(a, 0.0, 8, rows_cycle=(1,))
    assert not a.may_win(0, 4)
    b = DraftLengthTuner((0, 2, 4), epsilon=0.0, buckets=(1,))
    b.load_state_dict(a.state_dict())
    assert not b.may_win(0, 4) and b.may_win(0, 2) and b.may_win(0, 0)
    legacy = {key: value for key, value in a.state_dict().items() if key != "accepted"}
    c = DraftLengthTuner((0, 2, 4), epsilon=0.0, buckets=(1,))
    c.load_state_dict(legacy)  # a checkpoint from before the bound: every arm may win again
    assert c.may_win(0, 4)


def test_tuner_state_round_trip_continues_identically() -> None:
    a = DraftLengthTuner(epsilon=0.5, seed=7)
    for _ in range(40):
        k = a.choose(3)
        a.record(3, k, _true_rate(1, k) * 0.01, 0.01)
    state = a.state_dict()
    b = DraftLengthTuner(epsilon=0.5, seed=123)  # different seed: the state must override it
    b.load_state_dict(state)
    assert b.summary() == a.summary()
    assert [a.choose(3) for _ in range(50)] == [b.choose(3) for _ in range(50)]
    with pytest.raises(ValueError, match="state was saved for candidates"):
        DraftLengthTuner(candidates=(1, 2)).load_state_dict(state)


def test_tuner_start_stop_times_on_cpu() -> None:
    tuner = DraftLengthTuner(candidates=(2, 4), epsilon=0.0, buckets=(1,))
    for k, pause in ((2, 0.002), (4, 0.02)):
        timing = tuner.start(k, 1)
        time.sleep(pause)
        tuner.stop(timing, torch.tensor([3, 2]))  # 5 tokens over the rows
    fast, slow = tuner.value(0, 2), tuner.value(0, 4)
    assert fast is not None and slow is not None
    assert 5 / 0.02 * 0.5 < slow < 5 / 0.02 * 1.01  # about 250 tok/s (sleep overshoots, never undershoots)
    assert fast > 2 * slow
    assert tuner.best(1) == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"candidates": ()}, "candidates must be non-empty"),
        ({"epsilon": 1.5}, "epsilon must be in"),
        ({"buckets": (4, 1)}, "buckets must be strictly increasing"),
        ({"table": (8, 8)}, "table must give one of the candidates"),
        ({"window": 0}, "window must be >= 1"),
        ({"prune_margin": 1.0}, "prune_margin must be in"),
    ],
)
def test_tuner_bad_config(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DraftLengthTuner(**kwargs)  # type: ignore[arg-type]


def test_tuner_bad_record() -> None:
    tuner = DraftLengthTuner()
    with pytest.raises(ValueError, match="k must be one of the candidates"):
        tuner.record(1, 3, 10, 0.1)
    with pytest.raises(ValueError, match="active_rows must be >= 1"):
        tuner.choose(0)


# ----------------------------------------------------------------------------- speculation metrics
def test_speculation_metrics_hand_computed() -> None:
    metrics = SpeculationMetrics(max_draft_tokens=4)
    # step 1: rows drafted (4, 4, 2) and accepted (4, 1, 2); step 2: drafts (3, 0), accepted (0, 0)
    metrics.update_verify(torch.tensor([4, 1, 2]), torch.tensor([4, 4, 2]))
    metrics.update_verify(torch.tensor([0, 0]), torch.tensor([3, 0]))
    metrics.update_step(True, "speculative", torch.tensor([5, 2, 3]), 0.5)
    metrics.update_step(True, "speculative", 2, 0.5)
    metrics.update_step(False, "decode", 4, 0.25)
    metrics.update_step(False, "decode", 4, 0.25)
    metrics.update_step(False, "prefill", 12, 0.1)  # not a decode step: not in the share
    stats = metrics.stats()
    # emitted per row-step: 5, 2, 3, 1, 1 -> 12 / 5
    assert stats["spec/acceptance_length"] == pytest.approx(12 / 5)
    # position 0 reached by rows with a draft there: (4,4,2 drafts) + (3 drafts) = 4 rows; accepted by 3
    assert stats["spec/acceptance_rate_pos0"] == pytest.approx(3 / 4)
    # position 1 reached by rows accepted >= 1 with lens > 1: rows (4,4) (4,1) (2,2) -> 3; accepted > 1: 2
    assert stats["spec/acceptance_rate_pos1"] == pytest.approx(2 / 3)
    # position 2: reached by (4,4) only (row (2,2) has no draft 2); accepted
    assert stats["spec/acceptance_rate_pos2"] == pytest.approx(1.0)
    assert stats["spec/acceptance_rate_pos3"] == pytest.approx(1.0)
    assert stats["spec/speculative_step_share"] == pytest.approx(0.5)
    assert stats["tokens_per_s/speculative"] == pytest.approx(12 / 1.0)
    assert stats["tokens_per_s/decode"] == pytest.approx(8 / 0.5)
    assert stats["tokens_per_s/prefill"] == pytest.approx(120.0)
    metrics.reset()
    assert metrics.stats() == {}
    with pytest.raises(ValueError, match="phase must be one of"):
        metrics.update_step(False, "done", 1, 0.1)


def test_speculation_metrics_are_rank_local_under_a_process_group(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    # torchmetrics gathers a metric's state across ranks in compute() once a process group exists; the
    # engine's CPU counters under NCCL then failed the one-GPU FSDP run ("No backend type associated with
    # device type cpu"). The engine's figures are its own rank's: no collective
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        def refuse(*args: object, **kwargs: object) -> None:
            raise AssertionError("a collective in the engine's metrics")

        monkeypatch.setattr(dist, "all_gather", refuse)
        monkeypatch.setattr(dist, "all_gather_object", refuse)
        metrics = SpeculationMetrics(max_draft_tokens=2)
        metrics.update_verify(torch.tensor([2, 0]), torch.tensor([2, 2]))
        metrics.update_step(True, "speculative", 4, 0.5)
        stats = metrics.stats()
        assert stats["spec/acceptance_length"] == pytest.approx(4 / 2)
        assert stats["tokens_per_s/speculative"] == pytest.approx(8.0)
    finally:
        dist.destroy_process_group()


def test_the_engine_config_carries_the_bound() -> None:
    from lightning_tlt.core.types import SpeculativeConfig

    with pytest.raises(ValueError, match=r"tuner_prune_margin must be in \[0, 1\) or None, got 1.5"):
        SpeculativeConfig(method="suffix", tuner_prune_margin=1.5)
    assert SpeculativeConfig(method="suffix").tuner_prune_margin == 0.05
    assert SpeculativeConfig(method="suffix", tuner_prune_margin=None).tuner_prune_margin is None
