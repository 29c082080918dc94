"""DrafterTrainer (the static-shape step), StallPacer (the slowdown cap) and offline training, on the CPU.

What a CUDA graph needs of the step is checked here without a GPU: no host read inside the step
(a dispatch mode fails on any op that reads a value back), static inputs refilled in place, and
the same results whether the steps run at once or are queued and run later ("deferred", what a
side stream does).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_tlt.drafters.buffer import FeatureReplayBuffer
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.offline import add_policy_features, train_drafter
from lightning_tlt.drafters.pacing import StallPacer
from lightning_tlt.drafters.side_streams import GreenContexts
from lightning_tlt.drafters.trainer import DrafterTrainConfig, DrafterTrainer
from lightning_tlt.models.zoo import build_model

SYNCS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "is_nonzero", "equal", "unique", "_unique2"}


class NoHostSync(TorchDispatchMode):
    """Fails on any op that reads a tensor's value back to the host (what a CUDA graph capture forbids)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        if name in SYNCS:
            raise AssertionError(f"host sync inside the drafter step: aten.{name}")
        return func(*args, **(kwargs or {}))


def policy_and_sequences(n: int = 16, seed: int = 1) -> tuple[torch.nn.Module, list[list[int]], list[int]]:
    policy = build_model("qwen2", "tiny", seed=0)
    with torch.no_grad():
        policy.lm_head.weight.mul_(20.0)  # a peaked policy, as a warm-started one is
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, 128, (int(torch.randint(12, 30, (), generator=gen)),), generator=gen).tolist()
            for _ in range(n)]  # fmt: skip
    return policy, seqs, [5] * n


def make_trainer(execution: str = "eager", policy: torch.nn.Module | None = None, **overrides: object) -> DrafterTrainer:
    built, seqs, prompts = policy_and_sequences()
    policy = built if policy is None else policy
    buf = FeatureReplayBuffer(2048, heldout_fraction=0.0, seed=0)
    add_policy_features(buf, policy, seqs, prompts)
    drafter = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0))
    config = DrafterTrainConfig(batch_size=3, max_len=16, pack_segments=4, learning_rate=3e-3, warmup_steps=4,
                                execution=execution, **overrides)  # type: ignore[arg-type]  # fmt: skip
    return DrafterTrainer(drafter, buf, config)


def weights(trainer: DrafterTrainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.drafter.state_dict().items()}


def test_step_reads_nothing_back_and_keeps_static_inputs() -> None:
    trainer = make_trainer()
    trainer.enqueue(1)  # optimizer state exists: the step below is what a replay runs
    plan_ptr = trainer.plan.data_ptr()
    grads = [p.grad.data_ptr() for p in trainer.trained_parameters if p.grad is not None]
    trainer.plan.copy_(trainer.buffer.plan(3, 16, 4))
    before = weights(trainer)
    with NoHostSync(), torch.enable_grad():
        trainer.step()
    assert trainer.plan.data_ptr() == plan_ptr  # refilled in place
    assert len(grads) == len(trainer.trained_parameters)
    assert any(not torch.equal(v, before[k]) for k, v in trainer.drafter.state_dict().items())
    stats = trainer.take_stats()
    assert stats["applied"] == 2 and stats["skipped"] == 0 and 0 < stats["accept_rate"] <= 1


def test_deferred_steps_equal_eager_steps_bit_for_bit() -> None:
    eager, deferred = make_trainer("eager"), make_trainer("deferred")
    assert eager.enqueue(6) == 6 and deferred.enqueue(6) == 6
    assert deferred.in_flight() == 6 and eager.in_flight() == 0
    untouched = make_trainer("eager").drafter.state_dict()
    for name, value in deferred.drafter.state_dict().items():  # nothing ran yet
        assert torch.equal(value, untouched[name]), name
    deferred.wait()
    assert deferred.in_flight() == 0
    for name, value in eager.drafter.state_dict().items():
        assert torch.equal(deferred.drafter.state_dict()[name], value), name
    assert eager.take_stats() == pytest.approx({**deferred.take_stats(), "train_time_s": pytest.approx(0, abs=10)})


def test_warmup_schedule_and_validation() -> None:
    trainer = make_trainer()
    assert trainer.learning_rate == pytest.approx(3e-3 / 4)  # the first step: 1/4 of the peak
    trainer.enqueue(2)
    assert trainer.learning_rate == pytest.approx(3e-3 * 3 / 4)
    trainer.enqueue(5)
    assert trainer.learning_rate == pytest.approx(3e-3)
    with pytest.raises(ValueError, match="execution must be one of"):
        DrafterTrainConfig(execution="async")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs a CUDA drafter"):
        make_trainer("graph")
    for bad in (0, "half", True):
        with pytest.raises(ValueError, match=r"side_stream_sms must be 'auto', None \(every SM\) or a count >= 1, got "):
            DrafterTrainConfig(side_stream_sms=bad)  # type: ignore[arg-type]
    assert DrafterTrainConfig().side_stream_sms == "auto"
    # a GPU setting in a config run on the CPU: no side stream there, so nothing to partition
    for sms in (16, "auto"):
        eager = make_trainer(side_stream_sms=sms)
        assert eager.execution == "eager" and eager.side_stream is None and eager.side_stream_sms is None
        assert eager.enqueue(1) == 1


def test_auto_side_stream_sms_is_a_quarter_of_the_device_in_steps_of_8(monkeypatch: pytest.MonkeyPatch) -> None:
    """``"auto"``: 32 of an H100's or H200's 132 SMs (the count measured best), every SM on a small device or a
    torch without green contexts (the device's SM count and the flag are stood in: no CUDA here)."""
    from types import SimpleNamespace

    from torch.cuda import green_contexts

    from lightning_tlt.drafters.side_streams import auto_sms

    assert [auto_sms(n) for n in (132, 108, 80, 32, 16)] == [32, 24, 16, 8, None]
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132))
    cuda0 = torch.device("cuda", 0)
    monkeypatch.setattr(green_contexts, "SUPPORTED", True)
    assert [GreenContexts.resolve(cuda0, s) for s in ("auto", 48, None)] == [32, 48, None]
    monkeypatch.setattr(green_contexts, "SUPPORTED", False)
    assert GreenContexts.resolve(cuda0, "auto") is None  # no green contexts: every SM, no error
    assert GreenContexts.resolve(cuda0, 48) == 48  # an explicit count is kept (and refused by `stream`)
    # a torch with green contexts on a driver that cannot make one: "auto" falls back to every SM with a warning,
    # an explicit count is an error
    from lightning_tlt.drafters import side_streams

    monkeypatch.setattr(green_contexts, "SUPPORTED", True)

    def refuse(**kw: object) -> None:
        raise RuntimeError("CUDA error: operation not supported")

    monkeypatch.setattr(green_contexts.GreenContext, "create", staticmethod(refuse))
    every = object()
    monkeypatch.setattr(side_streams.EXCLUSIVE_STREAMS, "acquire", lambda *a, **k: every)
    contexts = GreenContexts()
    with pytest.warns(UserWarning, match=r"side_stream_sms='auto': no green context of 32 SMs could be made .*every SM"):
        assert contexts.side_stream(cuda0, "auto") == (every, None)
    assert contexts.side_stream(cuda0, None) == (every, None)
    with pytest.raises(RuntimeError, match="operation not supported"):
        contexts.side_stream(cuda0, 32)


def test_side_stream_sms_checks_the_count_and_keeps_one_green_context_per_device_and_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The green-context path's own logic (this machine has no CUDA: the device's SM count and the
    context factory are stood in; the H200 run is in docs/benchmarks.md)."""
    from types import SimpleNamespace

    from torch.cuda import green_contexts

    created: list[tuple[int, int]] = []

    class FakeContext:
        def __init__(self, num_sms: int, device_id: int) -> None:
            created.append((device_id, num_sms))

        def Stream(self) -> object:  # noqa: N802 (torch's name)
            return self  # stands in for a stream: it says which context made it

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(green_contexts, "SUPPORTED", True)
    monkeypatch.setattr(green_contexts.GreenContext, "create", staticmethod(lambda **kw: FakeContext(**kw)))
    contexts = GreenContexts()  # the process's registry (GREEN_CONTEXTS) is left alone
    cuda0 = torch.device("cuda", 0)
    first, second = contexts.stream(cuda0, 32), contexts.stream(cuda0, 32)  # two trainers' side streams
    assert created == [(0, 32)] and first is second  # one context, outliving either trainer
    contexts.stream(cuda0, 64)
    assert created == [(0, 32), (0, 64)]
    with pytest.raises(ValueError, match="side_stream_sms must be at most the device's 132 SMs, got 200"):
        contexts.stream(cuda0, 200)
    monkeypatch.setattr(green_contexts, "SUPPORTED", False)
    with pytest.raises(RuntimeError, match=r"side_stream_sms=16 needs CUDA green contexts, which this torch"):
        contexts.stream(cuda0, 16)


def test_nonfinite_loss_is_skipped_on_the_device() -> None:
    policy = build_model("qwen2", "tiny", seed=0)
    buf = FeatureReplayBuffer(256, heldout_fraction=0.0)
    ids = torch.tensor([[3, 17, 25, 9, 1, 2, 3, 4]])
    completion = (torch.arange(8) >= 4).long()[None]
    buf.add(torch.full((1, 8, 128), float("nan")), ids, torch.ones_like(ids), completion, step=0)
    drafter = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0))
    trainer = DrafterTrainer(drafter, buf, DrafterTrainConfig(batch_size=2, max_len=8))
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    assert trainer.enqueue(3) == 3
    stats = trainer.take_stats()
    assert (stats["applied"], stats["skipped"], stats["skipped_total"]) == (0, 3, 3)
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, before[name]), name
    for state in trainer.optimizer.state_dict()["state"].values():  # no step counted, moments untouched
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    buf.clear()
    buf.add(policy(ids, output_hidden_states=True).hidden_states[-1].detach(), ids, torch.ones_like(ids),
            completion, step=1)  # fmt: skip
    trainer.enqueue(2)
    assert trainer.skipped_nonfinite == 3 and trainer.take_stats()["applied"] == 2
    assert any(not torch.equal(v, before[k]) for k, v in drafter.state_dict().items())


def test_state_round_trip_continues_identically() -> None:
    a = make_trainer()
    a.enqueue(3)
    state = a.state_dict()
    saved_weights = weights(a)
    saved_buffer = a.buffer.state_dict()
    b = make_trainer()
    b.drafter.load_state_dict(saved_weights)
    b.buffer.load_state_dict(saved_buffer)
    b.load_state_dict(state)
    a.enqueue(4)
    b.enqueue(4)
    for name, value in a.drafter.state_dict().items():
        assert torch.equal(b.drafter.state_dict()[name], value), name
    assert b.steps_enqueued == a.steps_enqueued == 7


def test_average_keeps_parameter_storage() -> None:
    trainer = make_trainer()
    ptrs = [p.data_ptr() for p in trainer.trained_parameters]
    trainer.average_(lambda flat: flat * 0.5)  # stands in for the rank mean
    assert [p.data_ptr() for p in trainer.trained_parameters] == ptrs  # a captured graph would keep working
    fresh = make_trainer().drafter.state_dict()
    for name, value in trainer.drafter.state_dict().items():
        if name in dict(trainer.drafter.named_parameters()):
            assert torch.equal(value, fresh[name] * 0.5), name


def test_offline_training_raises_heldout_acceptance() -> None:
    policy, seqs, prompts = policy_and_sequences(n=24)
    config = DrafterTrainConfig(batch_size=4, max_len=32, learning_rate=3e-3, warmup_steps=0)
    result = train_drafter(policy, seqs, prompts, steps=60, config=config, heldout_fraction=0.25, seed=0)
    assert result.steps == 60 and result.sequences == 24
    assert result.heldout_before is not None and result.heldout_after is not None
    # measured (seeded): 0.08 -> 0.16 on held-out random-token sequences of a sharpened tiny policy
    assert result.heldout_after > result.heldout_before + 0.04, (result.heldout_before, result.heldout_after)


# ----------------------------------------------------------------------------- the pacer
def simulate(pacer: StallPacer, events: int, base_s: float, step_cost: float) -> tuple[float, list[float]]:
    """Decode steps that take ``base_s``, plus ``step_cost`` x base per drafter step that overlaps them;
    drafter steps finish within the next decode step. Returns the mean slowdown and the rates."""
    in_flight, slowed, rates = 0, [], []
    for _ in range(events):
        time_s = base_s * (1 + step_cost * in_flight)
        slowed.append(time_s / base_s - 1)
        in_flight = pacer.plan("decode", 3, time_s, 0)
        rates.append(pacer.rate)
    return sum(slowed[events // 2 :]) / (events - events // 2), rates


def test_pacer_holds_the_measured_slowdown_near_the_cap() -> None:
    for cost in (0.02, 0.2, 1.0):  # a drafter step slows an overlapping decode step by 2 %, 20 %, 100 %
        pacer = StallPacer(max_per_event=4, max_slowdown=0.05)
        mean, rates = simulate(pacer, 2000, 0.002, cost)
        # measured: 0.050 each, at 2.5, 0.25 and 0.05 drafter steps per stall event
        assert mean == pytest.approx(0.05, abs=0.005), (cost, mean)
        assert rates[-1] == pytest.approx(0.05 / cost, rel=0.3), (cost, rates[-1])
    cheap = StallPacer(max_per_event=4, max_slowdown=0.05)
    simulate(cheap, 500, 0.002, 0.001)
    assert cheap.rate == 4.0  # nearly free: as many as allowed


@pytest.mark.parametrize("outlasts", [1, 2, 6])  # decode steps one drafter step runs beside
def test_pacer_holds_its_cap_when_one_loaded_step_costs_more_than_its_floor_allows(outlasts: int) -> None:
    """On the H100 a decode step beside a drafter step took about 5.5x a clean one: one such observation asks
    the rate to fall by e^-4.45, below the floor, and the floor used to drop what it could not take: the
    mean came out at 5.7 %, 11.2 % and 32 % here (6.3 % and 10.5 % in the e2e) against a cap of 5 %. What the
    floor holds back is owed now, so the cap holds whatever a loaded step costs."""
    rng = random.Random(0)
    pacer, left, slowed, steps = StallPacer(max_per_event=4, max_slowdown=0.05), 0.0, [], 0
    for _ in range(100_000):
        time_s = 0.001 * (5.5 if left > 0 else 1.0) * rng.uniform(0.97, 1.03)
        slowed.append(4.5 if left > 0 else 0.0)
        left = max(0.0, left - time_s)  # the drafter's work goes on beside the decode step
        n = pacer.plan("decode", 4, time_s, int(left > 0))
        steps += n
        left += n * 0.0055 * outlasts - 0.0001  # one drafter step lasts `outlasts` loaded decode steps
        pacer.queued(n, int(left > 0))
    assert sum(slowed) / len(slowed) == pytest.approx(0.05, abs=0.003)
    assert pacer.take_window()["slowdown"] == pytest.approx(0.05, abs=0.003)
    assert steps == pytest.approx(100_000 * 0.0111 / outlasts, rel=0.1)  # 1.1 % of steps loaded, as the cap allows
    state = pacer.state_dict()
    assert set(state) == {"rate", "credit", "debt"}
    old = StallPacer(4, 0.05)
    old.load_state_dict({"rate": 0.5, "credit": 0.25})  # a checkpoint from before the debt: none owed
    assert (old.rate, old.state_dict()["debt"]) == (0.5, 0.0)


def test_pacer_slows_down_when_decode_gets_slower() -> None:
    pacer = StallPacer(max_per_event=4, max_slowdown=0.05)
    simulate(pacer, 300, 0.002, 0.01)
    fast_rate = pacer.rate
    simulate(pacer, 300, 0.002, 0.5)  # the same work now costs decode much more
    assert pacer.rate < fast_rate / 4, (fast_rate, pacer.rate)
    assert StallPacer(3, None).plan("decode", 1, 1.0, 0) == 3  # uncapped: the fixed count
    with pytest.raises(ValueError, match="max_slowdown must be > 0"):
        StallPacer(3, 0.0)


def test_pacer_compares_speculative_steps_of_one_draft_length() -> None:
    """The tuner switches k between steps, and a k = 8 step costs 1.6x a k = 2 one: told each step's k,
    the pacer measures the drafter's own cost (0.1 % a step in flight) and trains at its most; comparing
    across k (the bucket before StepEvent.draft_tokens) measures the k mix instead, by several times the cap."""

    def run(tell_k: bool) -> StallPacer:
        pacer, in_flight = StallPacer(max_per_event=4, max_slowdown=0.05), 0
        for i in range(600):
            k = (2, 8, 8, 2, 4)[i % 5]
            time_s = 0.004 * (1 + k / 8) * (1 + 0.001 * in_flight)
            in_flight = pacer.plan("speculative", 3, time_s, in_flight, draft_tokens=k if tell_k else 0)
        return pacer

    told, blind = run(True), run(False)
    assert told.rate == 4.0 and 0 <= told.slowdown < 0.01, (told.rate, told.slowdown)
    assert abs(blind.slowdown) > 0.03, blind.slowdown  # measured: -0.063, a k mix read as a speed-up


def test_one_unflagged_pause_costs_the_pacer_a_factor_not_its_rate() -> None:
    """A decode step held up 2 s by something the engine does not flag (a host pause, the drafter's own
    first capture in the listener) is one observation of a 40,000 % slowdown: it may lower the rate by
    e^-1 at most, not throw it to the floor for the next ~170 stall steps (the uncapped controller's
    reading, kept here as the counterfactual: max_penalty=inf)."""

    def run(pacer: StallPacer) -> list[float]:
        in_flight, rates = 0, []
        for i in range(600):
            time_s = 0.005 * (1 + 0.001 * in_flight) + (2.0 if i == 100 else 0.0)
            in_flight = pacer.plan("decode", 3, time_s, in_flight)
            rates.append(pacer.rate)
        return rates

    capped, uncapped = run(StallPacer(4, 0.05)), run(StallPacer(4, 0.05, max_penalty=float("inf")))
    assert capped[99] == uncapped[99] == 4.0
    assert capped[100] == pytest.approx(4.0 * math.exp(-0.05 * 20), rel=1e-6) and capped[130] == 4.0
    assert uncapped[100] == 1e-3 and uncapped[200] < 0.2  # measured: 0.15, a hundred steps later
    with pytest.raises(ValueError, match="max_penalty must be > 0"):
        StallPacer(4, 0.05, max_penalty=0.0)


def test_pacer_probes_a_clean_baseline_first() -> None:
    pacer = StallPacer(max_per_event=2, max_slowdown=0.05, probe_every=8)
    assert pacer.plan("decode", 5, 0.002, 0) == 0  # no clean step of bucket 8 measured yet: measure one
    assert pacer.plan("decode", 6, 0.002, 0) == 1  # measured clean: now it trains
    counts = [pacer.plan("decode", 6, 0.002, 1) for _ in range(12)]
    assert 0 in counts  # every probe_every loaded steps it holds back once to re-measure


@pytest.mark.parametrize("at", [0, 1, 5])  # the first clean step, the first loaded one, a later one
def test_pacer_survives_one_step_slowed_by_a_graph_capture(at: int) -> None:
    # decode steps of 5 ms, each drafter step in flight costs 10 %; step `at` also captures a graph (200 ms)
    pacer, in_flight, slowed = StallPacer(max_per_event=4, max_slowdown=0.05), 0, []
    for i in range(600):
        time_s = 0.005 * (1 + 0.10 * in_flight) + (0.2 if i == at else 0.0)
        in_flight = pacer.plan("decode", 8, time_s, in_flight, captured=i == at)  # the engine's StepEvent.captured
        slowed.append(time_s / 0.005 - 1)
    assert sum(slowed[100:]) / 500 == pytest.approx(0.05, abs=0.01)  # unflagged: 0.39 (a baseline stuck at 200 ms)


def test_pacer_counts_only_the_steps_the_learner_accepted() -> None:
    pacer = StallPacer(max_per_event=2, max_slowdown=0.05)
    pacer.plan("decode", 4, 0.002, 0)  # clean baseline
    assert pacer.plan("decode", 4, 0.002, 0) > 0
    pacer.queued(0, 0)  # the learner took none (empty buffer, full queue)
    assert not pacer.loaded  # so the next step is clean, not a loaded one


def test_the_captured_steps_inputs_are_tracked_by_address() -> None:
    # a CUDA graph replays fixed addresses: `prepare` captures again when any of these moved
    policy, seqs, prompts = policy_and_sequences()
    trainer = make_trainer(policy=policy)
    before = trainer.input_addresses()
    assert before == trainer.input_addresses() and len(before) == len(list(trainer.drafter.parameters())) + 5
    head = policy.lm_head  # the drafter's head is the policy's
    head.weight = torch.nn.Parameter(head.weight.detach().clone())  # a reloaded policy's head: new storage
    assert trainer.input_addresses() != before


def test_compute_dtype_runs_the_heads_of_a_float32_policy_in_bf16() -> None:
    # float32 master weights under bf16-mixed: the step's full-vocabulary head matmuls run in bf16
    seen: list[torch.dtype] = []

    class Recording(DrafterTrainer):
        def head_logits(self, drafter: EagleDrafter, features: torch.Tensor) -> torch.Tensor:
            out = super().head_logits(drafter, features)
            seen.append(out.dtype)
            return out

    policy, seqs, prompts = policy_and_sequences()
    buf = FeatureReplayBuffer(2048, heldout_fraction=0.0, seed=0)
    add_policy_features(buf, policy, seqs, prompts)
    config = DrafterTrainConfig(batch_size=3, max_len=16, pack_segments=4, execution="eager")
    drafter = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0))
    default = Recording(drafter, buf, config)
    assert default.compute_dtype == torch.float32  # the policy's
    default.enqueue(1)
    assert seen == [torch.float32, torch.float32]
    seen.clear()
    half = Recording(drafter, buf, config, compute_dtype=torch.bfloat16)
    half.enqueue(2)
    assert seen == [torch.bfloat16] * 4 and half.skipped_nonfinite == 0
    assert drafter.fc.weight.dtype == torch.float32  # master weights stay float32
    seen.clear()
    default.set_compute_dtype(torch.bfloat16)
    default.enqueue(1)
    assert seen == [torch.bfloat16] * 2


def test_a_draft_vocabulary_loss_is_the_loss_of_a_drafter_with_only_those_head_rows() -> None:
    policy, seqs, prompts = policy_and_sequences()
    buf = FeatureReplayBuffer(2048, heldout_fraction=0.0, seed=0)
    add_policy_features(buf, policy, seqs, prompts)
    drafter = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0))
    config = DrafterTrainConfig(batch_size=3, max_len=16, pack_segments=4, execution="eager")
    trainer = DrafterTrainer(drafter, buf, config)
    ids = torch.tensor(sorted(torch.randperm(128, generator=torch.Generator().manual_seed(3))[:40].tolist()))
    head = torch.nn.Linear(policy.config.hidden_size, 40, bias=False)
    with torch.no_grad():
        head.weight.copy_(policy.lm_head.weight[ids])
    # the same drafter layer over a policy whose head is only those 40 rows
    narrow = EagleDrafter(drafter.config, policy.model.embed_tokens, head, drafter.inv_freq, drafter.rope_scaling,
                          drafter.feature_layers)  # fmt: skip
    narrow.load_state_dict(drafter.state_dict())
    batch = buf.sample(3, 16)
    with torch.no_grad():
        whole = trainer.loss(drafter, batch)
        expected = trainer.loss(narrow, batch)  # every row of the narrow head
        trainer.set_vocabulary(ids)
        restricted = trainer.loss(drafter, batch)
    assert trainer.vocabulary is not None and torch.equal(trainer.vocabulary, ids)
    torch.testing.assert_close(restricted.loss, expected.loss)
    torch.testing.assert_close(restricted.stats["accept_rate"], expected.stats["accept_rate"])
    assert not torch.allclose(restricted.loss, whole.loss)  # the other 88 rows did count before
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    trainer.enqueue(2)
    assert trainer.skipped_nonfinite == 0 and any(not torch.equal(before[k], v) for k, v in drafter.state_dict().items())
    state = trainer.state_dict()
    trainer.set_vocabulary(None)
    assert trainer.vocabulary is None
    trainer.load_state_dict(state)
    assert torch.equal(trainer.vocabulary, ids)
    with pytest.raises(ValueError, match=r"token ids in \[0, 128\)"):
        trainer.set_vocabulary(torch.tensor([0, 128]))


def test_the_cap_holds_for_drafter_work_that_slows_decode_several_fold() -> None:
    """Drafter work that slows every decode step beside it 6x (a float32 drafter step at 0.5 B on the
    H200). With a fixed outlier limit of 105 % each such step counted as 105 %, the controller settled
    near one loaded stall step in 21 and the mean slowdown was about 5 x 1/21 = 24 % (measured in
    this simulation: 0.245); judged against the usual loaded observation, they count in full and the
    mean slowdown settles at the cap. `take_window` reports it as measured, nothing limited."""
    pacer, loaded = StallPacer(max_per_event=4, max_slowdown=0.05), False
    for _ in range(4000):
        loaded = pacer.plan("decode", 3, 0.004 * (6.0 if loaded else 1.0), 0) > 0
    window = pacer.take_window()
    assert window["loaded_slowdown"] == pytest.approx(5.0)
    assert window["slowdown"] == pytest.approx(5.0 * window["loaded_share"], rel=1e-6)
    assert 0.03 <= window["slowdown"] <= 0.08, window  # measured: 0.065, the first loaded steps included (cap 0.05)
    assert pacer.take_window() == {"slowdown": 0.0, "loaded_share": 0.0, "loaded_slowdown": pytest.approx(math.nan, nan_ok=True)}
