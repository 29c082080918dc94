"""DrafterCoTrainCallback: learns in stalls only, keeps sampling exact, publishes, resumes, exports.

The policy is a tiny zoo Qwen2 whose LM head is sharpened (x 20): a random tiny model is nearly
uniform over its vocabulary, whereas a warm-started policy is peaked; sharpening gives that
low-entropy behaviour in no time (an SFT warm start takes minutes on two busy cores).
"""

from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_tlt.callbacks.drafter_cotrain import (
    DrafterCoTrainCallback,
    DrafterCoTrainConfig,
    publish_drafter,
)
from lightning_tlt.core.sampling import processed_probs
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig, StepEvent
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.export import export_drafter
from lightning_tlt.drafters.suffix import SuffixDrafter
from lightning_tlt.drafters.trainer import DrafterTrainer
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.rollout.engine import RolloutEngine
from lightning_tlt.rollout.verify import verify_chain

ALPHA = 1e-3
SHARPEN = 20.0


def sharpened_policy(seed: int = 0) -> torch.nn.Module:
    model = build_model("qwen2", "tiny", seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    return model


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value of ``counts`` against ``probs`` (as in tests/rollout/test_verify.py)."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a sequence of probability 0"
    assert support.sum() >= 2
    expected = counts.sum() * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(support.sum().item() - 1), dtype=torch.float64)
    return float(1.0 - torch.special.gammainc(dof / 2, stat / 2))


@torch.no_grad()
def rollouts(policy: torch.nn.Module, prompt: list[int], n: int, length: int, seed: int) -> torch.Tensor:
    """``n`` completions of ``length`` tokens of one prompt from the real engine: ``(n, P + length)``."""
    engine = RolloutEngine(policy, max_seq_len=len(prompt) + length + 1, max_batch_size=n)
    out = engine.generate(
        [prompt], SamplingConfig(temperature=1.0, max_new_tokens=length, stop_token_ids=[]), num_samples=n,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    return torch.tensor([prompt + c for c in out.completion_ids])


@torch.no_grad()
def fill_buffer(
    cb: DrafterCoTrainCallback, policy: torch.nn.Module, seqs: torch.Tensor, prompt_len: int,
    heldout: bool | None = None,
) -> None:
    hidden = policy(seqs, output_hidden_states=True).hidden_states[-1]
    completion = torch.zeros_like(seqs)
    completion[:, prompt_len:] = 1
    cb.buffer.add(hidden, seqs, torch.ones_like(seqs), completion, step=0, heldout=heldout)


@torch.no_grad()
def acceptance_length(
    policy: torch.nn.Module, drafter: EagleDrafter, seqs: torch.Tensor, prompt_len: int, k: int, seed: int
) -> float:
    """Mean tokens per verify step of chain speculation (drafter.draft + verify_chain) along real rollouts."""
    gen = torch.Generator().manual_seed(seed)
    hidden = policy(seqs, output_hidden_states=True).hidden_states[-1]  # (B, L, H)
    emitted = []
    for t in range(prompt_len, seqs.shape[1] - 1):  # x_t: the newest sampled token
        drafts, q = drafter.draft(hidden[:, :t], seqs[:, : t + 1], k, temperature=1.0, generator=gen)
        p = processed_probs(policy(torch.cat([seqs[:, : t + 1], drafts], 1)).logits[:, t:], 1.0)
        emitted.append(verify_chain(drafts, q, p, None, gen).num_emitted.float())
    return float(torch.cat(emitted).mean())


PROMPT = [3, 17, 25, 9, 40, 11]


@pytest.fixture(scope="module")
def cotrained() -> tuple[torch.nn.Module, EagleDrafter, EagleDrafter, torch.Tensor]:
    """(policy, cold drafter, co-trained drafter, held-out rollouts)."""
    policy = sharpened_policy()
    cfg = DrafterCoTrainConfig(learning_rate=3e-3, warmup_steps=0, batch_size=4, max_len=64, heldout_fraction=0.0,
                               seed=0)  # fmt: skip
    cb = DrafterCoTrainCallback(cfg)
    drafter = cb.setup_drafter(policy)
    cold = drafter.inference_copy()
    fill_buffer(cb, policy, rollouts(policy, PROMPT, 16, 24, seed=1), len(PROMPT))
    assert cb.learner is not None and cb.learner.enqueue(80) == 80
    assert cb.learner.skipped_nonfinite == 0
    return policy, cold, drafter.inference_copy(), rollouts(policy, PROMPT, 8, 16, seed=2)


def test_cotraining_raises_acceptance_length(cotrained) -> None:  # noqa: ANN001
    policy, cold, trained, heldout = cotrained
    k = 4
    before = acceptance_length(policy, cold, heldout, len(PROMPT), k, seed=3)
    after = acceptance_length(policy, trained, heldout, len(PROMPT), k, seed=3)
    # measured (seeded): 1.05 tokens per verify step cold, 2.92 after 80 drafter steps
    assert after > before + 1.0, (before, after)
    assert after > 2.5


@torch.no_grad()
def _two_token_counts(
    policy: torch.nn.Module, drafter: EagleDrafter, n: int, k: int, top_k: int, seed: int
) -> torch.Tensor:
    """Counts of the first two tokens after PROMPT sampled by speculation (one or two verify steps)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = policy.config.vocab_size
    ctx = torch.tensor([PROMPT]).expand(n, -1)
    t = len(PROMPT) - 1
    hidden = policy(ctx[:1], output_hidden_states=True).hidden_states[-1].expand(n, -1, -1)

    def step(context: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        drafts, q = drafter.draft(feats, context, k, temperature=1.0, top_k=top_k, generator=gen)
        width = context.shape[1]
        p = processed_probs(policy(torch.cat([context, drafts], 1)).logits[:, width - 1 :], 1.0, top_k)
        out = verify_chain(drafts, q, p, None, gen, pad_token_id=-1)
        return out.tokens

    # the prompt's last token is x_t; the drafter reads h_0..h_{t-1} with tokens x_0..x_t
    first = step(ctx, hidden[:, :t])
    x1, x2 = first[:, 0], first[:, 1]
    need = x2 < 0
    if need.any():
        ctx2 = torch.cat([ctx[need], x1[need, None]], 1)
        feats2 = policy(ctx2, output_hidden_states=True).hidden_states[-1][:, : t + 1]
        x2 = x2.clone()
        x2[need] = step(ctx2, feats2)[:, 0]
    return torch.bincount(x1 * vocab + x2, minlength=vocab * vocab)


@torch.no_grad()
def _two_token_probs(policy: torch.nn.Module, top_k: int) -> torch.Tensor:
    vocab = policy.config.vocab_size
    ctx = torch.tensor([PROMPT])
    p1 = processed_probs(policy(ctx).logits[0, -1], 1.0, top_k)
    joint = torch.zeros(vocab, vocab)
    for x1 in p1.nonzero().flatten().tolist():
        p2 = processed_probs(policy(torch.cat([ctx, torch.tensor([[x1]])], 1)).logits[0, -1], 1.0, top_k)
        joint[x1] = p1[x1] * p2
    return joint.flatten()


@pytest.mark.parametrize("which", ["cold", "cotrained"])
def test_sampled_distribution_is_the_policys(cotrained, which: str) -> None:  # noqa: ANN001
    policy, cold, trained, _ = cotrained
    drafter = cold if which == "cold" else trained
    top_k = 4  # both distributions truncated identically; 16 two-token sequences
    counts = _two_token_counts(policy, drafter, 3000, k=3, top_k=top_k, seed=5)
    assert chi_square_pvalue(counts, _two_token_probs(policy, top_k)) > ALPHA


def test_trains_only_inside_stall_events() -> None:
    policy = build_model("qwen2", "tiny", seed=0)
    cfg = DrafterCoTrainConfig(stall_threshold=2, max_steps_per_event=1, max_decode_slowdown=None, batch_size=2,
                               max_len=16)  # fmt: skip
    engine = RolloutEngine(policy, max_seq_len=48, max_batch_size=8)
    cb = DrafterCoTrainCallback(cfg, engine=engine)
    cb.setup_drafter(policy)
    assert cb.learner is not None
    events: list[tuple[StepEvent, int]] = []

    def listener(event: StepEvent) -> None:
        before = cb.learner.steps_enqueued
        cb.on_step_event(event)
        events.append((event, cb.learner.steps_enqueued - before))

    engine.add_listener(listener)
    # an empty buffer: nothing to train on, even in stalls
    engine.generate([PROMPT], SamplingConfig(max_new_tokens=4, stop_token_ids=[]), num_samples=2,
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert cb.learner.steps_enqueued == 0
    fill_buffer(cb, policy, rollouts(policy, PROMPT, 4, 8, seed=1), len(PROMPT))
    events.clear()
    # many stop tokens: the 8 rows finish at different steps, so the batch shrinks through the threshold
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=30, stop_token_ids=list(range(10, 18)))
    engine.generate(
        [PROMPT, PROMPT[::-1]], sampling, num_samples=4, generator=torch.Generator().manual_seed(4)
    )
    stall = [e for e, _ in events if e.phase == "decode" and 0 < e.active_rows <= 2]
    not_stall = [e for e, _ in events if not (e.phase == "decode" and 0 < e.active_rows <= 2)]
    assert stall and any(e.phase == "decode" and e.active_rows > 2 for e in not_stall)
    for event, steps in events:
        expected = 1 if event in stall else 0
        assert steps == expected, (event, steps)
    assert cb.learner.steps_enqueued == len(stall)
    assert [entry[1] for entry in cb.step_log] == [e.active_rows for e in stall]


def test_stall_steps_adapt_to_the_measured_decode_slowdown() -> None:
    """With a cap, the steps per stall event follow what the decode steps beside them measure:
    synthetic stall steps of 4 ms that take 8 ms whenever drafter work ran beside them (a step
    doubles a decode step) settle near one drafter step per 20 events (5 %)."""
    policy = build_model("qwen2", "tiny", seed=0)
    cfg = DrafterCoTrainConfig(stall_threshold=4, max_steps_per_event=4, batch_size=2, max_len=16,
                               max_decode_slowdown=0.05)  # fmt: skip
    cb = DrafterCoTrainCallback(cfg)
    cb.setup_drafter(policy)
    assert cb.learner is not None
    fill_buffer(cb, policy, rollouts(policy, PROMPT, 4, 8, seed=1), len(PROMPT))
    step_time, loaded = 0.004, False
    for i in range(600):
        before = cb.learner.steps_enqueued
        cb.on_step_event(StepEvent(i, "decode", 2, 0, 8, step_time * (2 if loaded else 1), new_tokens=2))
        loaded = cb.learner.steps_enqueued > before  # on the CPU a step runs at once, before the next decode step
    assert cb.stalls.window.stall_events == 600
    assert 600 * 0.03 <= cb.learner.steps_enqueued <= 600 * 0.08  # measured: 33 (5.5 %)
    assert cb.pacer.slowdown < 0.2
    # outside stalls nothing is queued
    before = cb.learner.steps_enqueued
    for i in range(50):
        cb.on_step_event(StepEvent(i, "decode", 6, 0, 8, step_time, new_tokens=6))
    assert cb.learner.steps_enqueued == before


def test_max_decode_slowdown_is_validated() -> None:
    with pytest.raises(ValueError, match="max_decode_slowdown must be in"):
        DrafterCoTrainConfig(max_decode_slowdown=1.5)


def test_publish_copies_in_place_with_version() -> None:
    policy = build_model("qwen2", "tiny", seed=0)

    engine = RolloutEngine(policy, max_seq_len=32, max_batch_size=2, speculative=SpeculativeConfig(method="suffix"))
    trained = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0))
    first = publish_drafter(engine, trained, 1)
    assert engine.drafter is first and first is not trained and engine.drafter_version == 1
    assert not any(p.requires_grad for p in first.parameters())
    fc = first.fc.weight
    with torch.no_grad():
        trained.fc.weight.add_(1.0)
    assert publish_drafter(engine, trained, 2) is first  # same object, same tensors: graphs stay valid
    assert first.fc.weight is fc and torch.equal(fc, trained.fc.weight) and engine.drafter_version == 2


# ----------------------------------------------------------------------------- with a real Trainer
def digits(completions: list[str], **kwargs: object) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def make(
    seed: int = 0, speculative: SpeculativeConfig | None = None, sharpen: bool = False
) -> tuple[GRPOModule, RolloutDataModule]:
    config = GRPOConfig(
        num_generations=4, max_completion_length=12, learning_rate=1e-3, lr_scheduler_type="constant"
    )
    policy = sharpened_policy(seed) if sharpen else build_model("qwen2", "tiny", seed=seed)
    module = GRPOModule(policy, config)
    data = RolloutDataModule(
        "arithmetic", [digits], prompts_per_step=2, task_size=32, seed=seed, speculative=speculative
    )
    return module, data


def callback(**overrides: object) -> DrafterCoTrainCallback:
    # 8 rows decode together: a threshold of 8 makes every decode step a stall (selectivity is tested above)
    cfg = DrafterCoTrainConfig(
        stall_threshold=8, max_steps_per_event=1, max_decode_slowdown=None, batch_size=4, max_len=24,
        learning_rate=1e-3, heldout_fraction=0.25, eval_every_n_steps=1, buffer_tokens=2048, seed=0,
    )  # fmt: skip
    return DrafterCoTrainCallback(cfg, **overrides)


def trainer(tmp_path: Path, max_steps: int, callbacks: list, **kw: object) -> pl.Trainer:
    kw.setdefault("logger", CSVLogger(tmp_path, name="csv"))
    return pl.Trainer(
        max_steps=max_steps, accelerator="cpu", log_every_n_steps=1, enable_model_summary=False,
        enable_progress_bar=False, callbacks=callbacks, **kw,
    )  # fmt: skip


EAGLE = SpeculativeConfig(method="eagle", threshold=8, hysteresis_steps=1, num_draft_tokens=3)


def test_trainer_harvests_trains_in_stalls_publishes_and_logs(tmp_path: Path) -> None:
    module, data = make()
    cb = callback()
    embed = module.policy.model.embed_tokens.weight
    trainer(tmp_path, 3, [cb], enable_checkpointing=False).fit(module, datamodule=data)
    # step 1's rollout came before any harvest: no training then; steps 2 and 3 trained in their stalls
    reasons = {reason for reason, _, _ in cb.step_log}
    assert reasons == {"stall"} and all(0 < rows <= 8 for _, rows, _ in cb.step_log)
    assert cb.learner is not None and cb.learner.steps_enqueued == sum(n for _, _, n in cb.step_log) > 0
    assert cb.buffer.summary()["max_step"] == 2 and cb.buffer.summary()["added"] == 3 * 8
    # version 0 (cold) at fit start; step 1 trained nothing: not published again; then versions 1 and 2
    engine = data.engine
    assert cb.version == 2 and engine.drafter_version == 2 and engine.drafter is cb.published
    for name, value in cb.drafter.state_dict().items():
        assert torch.equal(engine.drafter.state_dict()[name], value), name
    assert engine.drafter.embed_weight.data_ptr() == module.policy.model.embed_tokens.weight.data_ptr()
    assert module.policy.model.embed_tokens.weight is embed
    assert not module.policy_features_requested  # handed back at teardown
    (path,) = sorted(tmp_path.glob("csv/version_*/metrics.csv"))
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("drafter/version")]
    assert [float(r["drafter/version"]) for r in rows] == [0.0, 1.0, 2.0]
    assert [float(r["drafter/published"]) for r in rows] == [0.0, 1.0, 1.0]
    trained_rows = [r for r in rows if r.get("drafter/loss")]
    assert len(trained_rows) == 2 and all(float(r["drafter/train_time_s"]) > 0 for r in trained_rows)
    assert all(0.0 <= float(r["drafter/top1_accuracy"]) <= 1.0 for r in trained_rows)
    # evaluations are queued at a boundary and read at the next one: logged from step 2 on
    assert [bool(r.get("drafter/heldout_accept_rate")) for r in rows] == [False, True, True]
    assert [e[0] for e in cb.evaluations] == [1, 2, 3]  # the last one read at the end of fit
    # where the last boundary's host time went, part by part and in order (the e2e keeps it per step)
    assert list(cb.last_boundary) == ["harvest", "evaluation_read", "publish", "stats", "vocabulary", "prepare",
                                      "evaluation_queued", "log"]
    assert all(v >= 0.0 for v in cb.last_boundary.values()) and sum(cb.last_boundary.values()) < 60.0


def test_a_drafter_whose_every_update_was_skipped_publishes_no_new_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dataclasses

    module, data = make()
    take = module.take_policy_features

    def poisoned() -> object:  # NaN features: every drafter update is non-finite and skipped
        features = take()
        return None if features is None else dataclasses.replace(
            features, hidden_states=torch.full_like(features.hidden_states, float("nan")))

    monkeypatch.setattr(module, "take_policy_features", poisoned)
    cb = callback()
    trainer(tmp_path, 3, [cb], enable_checkpointing=False, logger=False).fit(module, datamodule=data)
    assert cb.learner is not None and cb.learner.steps_enqueued > 0
    assert cb.learner.skipped_nonfinite == cb.learner.steps_enqueued and cb.learner.applied_updates == 0
    assert cb.version == 0 and data.engine.drafter_version == 0  # the cold drafter, never republished
    assert cb.publications == 0


def test_drafter_learns_over_20_rl_steps_from_cold(tmp_path: Path) -> None:
    module, data = make(sharpen=True)
    cb = callback(max_steps_per_event=2, learning_rate=3e-3, warmup_steps=0, eval_every_n_steps=19)
    trainer(tmp_path, 20, [cb], enable_checkpointing=False, logger=False).fit(module, datamodule=data)
    assert cb.learner is not None and cb.rl_steps == 20
    per_step = cb.learner.steps_enqueued / 19  # the first rollout had nothing to train on
    (first, cold, _), (last, trained, _) = cb.evaluations[0], cb.evaluations[-1]
    assert (first, last) == (1, 19)
    # measured (seeded): 22 drafter steps per RL step; held-out acceptance rate 0.04 cold, 1.00 at step 19
    # (the sharpened policy itself grows more peaked under GRPO; with its updates off: 0.04 -> 0.78)
    assert per_step >= 16, per_step
    assert trained > cold + 0.5, (cold, trained)


@pytest.mark.parametrize("margin", [-100.0, 100.0])
def test_suffix_drafter_speculates_until_the_eagle_drafter_beats_it(tmp_path: Path, margin: float) -> None:
    """TLT's cold start: the model-free drafter speculates first; the EAGLE drafter takes over only
    once its held-out expected acceptance length beats the engine's measured one (plus the margin)."""
    spec = SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=1, plain_arm=False)  # always speculate
    module, data = make(speculative=spec)
    cb = callback(handoff_margin=margin)
    trainer(tmp_path, 3, [cb], enable_checkpointing=False).fit(module, datamodule=data)
    engine = data.engine
    assert "spec/acceptance_length" in engine.last_stats  # the suffix drafter did speculate
    if margin < 0:  # the first evaluation (queued at step 1, read at step 2) beats it by -100: handed off then
        assert isinstance(engine.drafter, EagleDrafter) and engine.drafter is cb.published
        assert cb.version == 2 and engine.staged_drafter is None  # the copy staged at fit start took over
    else:  # never good enough: the suffix drafter stays, nothing is published
        assert isinstance(engine.drafter, SuffixDrafter) and cb.published is None
        assert engine.staged_drafter is not None  # staged at fit start, ready for a hand-over
        assert cb.version == 0 and cb.learner is not None and cb.learner.steps_enqueued > 0


class HeadWatch(Callback):
    """Records the policy's LM head before each RL step's update, and the head each drafter train step read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.before_update: list[torch.Tensor] = []
        self.read: list[tuple[int, torch.Tensor]] = []
        original = DrafterTrainer.head_logits

        def head_logits(learner: DrafterTrainer, drafter: EagleDrafter, features: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():  # a train step (evaluations run without grad)
                self.read.append((len(self.before_update), drafter.lm_head_weight.clone()))
            return original(learner, drafter, features)

        monkeypatch.setattr(DrafterTrainer, "head_logits", head_logits)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object,
                             batch_idx: int) -> None:  # fmt: skip
        self.before_update.append(pl_module.policy.lm_head.weight.detach().clone())


@pytest.mark.parametrize("wait_before_update", [True, False])
def test_queued_drafter_steps_read_the_head_before_the_rl_update(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wait_before_update: bool
) -> None:
    """Drafter steps queued during a rollout ("deferred": they run when the side stream is waited
    for, as on a GPU) must run before the policy's optimizer step overwrites the shared head.
    ``wait_before_update=False`` drops the wait in ``on_before_optimizer_step`` (the wait at the step
    boundary remains): the same steps then read the updated head, which is what the test catches."""
    if not wait_before_update:
        monkeypatch.setattr(DrafterCoTrainCallback, "on_before_optimizer_step", Callback.on_before_optimizer_step)
    watch = HeadWatch(monkeypatch)
    module, data = make()
    cb = callback(execution="deferred")
    trainer(tmp_path, 3, [cb, watch], enable_checkpointing=False, logger=False).fit(module, datamodule=data)
    # two head reads per step (the predicted and the target features' logits); none in step 1's rollout
    assert len(watch.read) == 2 * cb.learner.steps_enqueued > 0 and {i for i, _ in watch.read} == {2, 3}
    saw_pre_update = [torch.equal(head, watch.before_update[i - 1]) for i, head in watch.read]
    assert all(saw_pre_update) if wait_before_update else not any(saw_pre_update)


def test_deferred_and_eager_runs_are_identical(tmp_path: Path) -> None:
    """Queued-and-waited drafter steps (a side stream's semantics) make the same updates as steps run at once."""
    results = []
    for execution in ("eager", "deferred"):
        module, data = make()
        cb = callback(execution=execution)
        trainer(tmp_path, 3, [cb], enable_checkpointing=False, logger=False).fit(module, datamodule=data)
        results.append((cb.drafter.state_dict(), module.policy.state_dict()))
    for a, b in zip(*results):
        for name, value in a.items():
            assert torch.equal(b[name], value), name


def _weights_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("draft_vocab", [None, 48], ids=["whole_head", "draft_vocab_48"])
def test_kill_and_resume_equals_the_uninterrupted_run(tmp_path: Path, draft_vocab: int | None) -> None:
    """Checkpoint every RL step; a run killed after step 2 and resumed makes the same drafter updates
    (the replay buffer's contents are in the checkpoint) and, drafting with the same published
    drafter, the same rollouts: policy and drafter weights bit-equal at the end. With a draft
    vocabulary (48 of the 128 ids) the loss's head rows are in the checkpoint too."""
    spec = EAGLE if draft_vocab is None else dataclasses.replace(EAGLE, draft_vocab_size=draft_vocab)

    def run(max_steps: int, ckpt_dir: Path, ckpt_path: Path | None = None) -> tuple[GRPOModule, DrafterCoTrainCallback]:
        module, data = make(speculative=spec)
        cb = callback()
        ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=-1)
        trainer(tmp_path, max_steps, [cb, ckpt], logger=False).fit(module, datamodule=data, ckpt_path=ckpt_path)
        return module, cb

    full_module, full_cb = run(4, tmp_path / "full")
    run(2, tmp_path / "killed")  # "killed" after step 2
    resumed_module, resumed_cb = run(4, tmp_path / "resumed", ckpt_path=tmp_path / "killed" / "last.ckpt")
    assert resumed_cb.learner is not None and full_cb.learner is not None
    assert resumed_cb.learner.steps_enqueued == full_cb.learner.steps_enqueued > 0
    assert resumed_cb.version == full_cb.version == 3
    for name, value in _weights_of(full_module.policy).items():
        assert torch.equal(resumed_module.policy.state_dict()[name], value), name
    for mine, theirs in ((resumed_cb.drafter, full_cb.drafter), (resumed_cb.published, full_cb.published)):
        for name, value in _weights_of(theirs).items():
            assert torch.equal(mine.state_dict()[name], value), name
    assert resumed_cb.evaluations[-1] == full_cb.evaluations[-1]
    if draft_vocab is not None:  # the loss compared the rows the engine drafts from
        vocab = full_cb.learner.vocabulary
        assert vocab is not None and vocab.numel() == draft_vocab
        assert torch.equal(resumed_cb.learner.vocabulary, vocab)
        assert torch.equal(full_cb.engine().draft_vocab_ids(), vocab)


def test_checkpoint_restore_and_export(tmp_path: Path) -> None:
    module, data = make(speculative=EAGLE)
    cb = callback()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer(tmp_path, 2, [cb, ckpt]).fit(module, datamodule=data)
    assert cb.learner is not None
    saved_optimizer = cb.learner.optimizer.state_dict()
    assert cb.learner.steps_enqueued > 0 and saved_optimizer["state"]
    last = tmp_path / "ckpt" / "last.ckpt"
    state = torch.load(last, map_location="cpu", weights_only=False)["callbacks"]
    (buffer_state,) = [v["buffer"] for v in state.values() if "drafter_config" in v]
    assert buffer_state["tokens"].dtype == torch.int32 and buffer_state["features"].shape[0] == cb.buffer.num_tokens

    # "kill" and resume into fresh objects: max_steps reached, so only the restore runs
    module2, data2 = make(speculative=EAGLE)
    cb2 = callback()
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer(tmp_path, 2, [cb2, ckpt2]).fit(module2, datamodule=data2, ckpt_path=last)
    assert cb2.learner is not None
    assert cb2.version == cb.version == 1 and cb2.learner.steps_enqueued == cb.learner.steps_enqueued
    for name, value in cb.drafter.state_dict().items():
        assert torch.equal(cb2.drafter.state_dict()[name], value), name
        assert torch.equal(cb2.published.state_dict()[name], cb.published.state_dict()[name]), name
    restored = cb2.learner.optimizer.state_dict()
    assert restored["state"].keys() == saved_optimizer["state"].keys()
    for idx, entry in saved_optimizer["state"].items():
        for key, value in entry.items():
            assert torch.equal(restored["state"][idx][key], value), (idx, key)
    assert cb2.buffer.summary() == cb.buffer.summary()
    assert data2.engine.drafter_version == 1

    # export round trip: loaded back, it proposes the same tokens as the published drafter
    out = export_drafter(last, tmp_path / "eagle")
    # the same through the command line (`lightning-tlt export-drafter`)
    from lightning_tlt.cli import main as cli_main

    assert (
        cli_main(["export-drafter", "--checkpoint_path", str(last), "--out_dir", str(tmp_path / "cli")]) == 0
    )
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "cli" / name).read_bytes() == (out / name).read_bytes()
    loaded = EagleDrafter.from_pretrained(out, module.policy)
    tokens = torch.tensor([PROMPT + [5, 6]])
    feats = module.policy(tokens[:, :-1], output_hidden_states=True).hidden_states[-1].detach()
    for drafter in (cb.published, loaded):
        drafter.eval()
    a = cb.published.draft(feats, tokens, 4, temperature=1.0, generator=torch.Generator().manual_seed(1))
    b = loaded.draft(feats, tokens, 4, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


class _RestoresAfterSetup(SingleDeviceStrategy):
    """Lightning's order under ModelParallelStrategy (FSDP2): callbacks restored after on_fit_start."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True


def test_a_checkpoint_restored_after_on_fit_start_hands_the_engine_the_published_drafter(tmp_path: Path) -> None:
    module, data = make(speculative=EAGLE)
    cb = callback()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer(tmp_path, 2, [cb, ckpt]).fit(module, datamodule=data)
    assert cb.version == 1 and cb.published is not None
    module2, data2 = make(speculative=EAGLE)
    cb2 = callback()
    after_setup = trainer(tmp_path, 2, [cb2], strategy=_RestoresAfterSetup(torch.device("cpu")))
    after_setup.fit(module2, datamodule=data2, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    engine_drafter = data2.engine.drafter
    assert data2.engine.drafter_version == 1 and isinstance(engine_drafter, EagleDrafter)
    for name, value in cb.published.state_dict().items():  # not the cold drafter on_fit_start handed over
        assert torch.equal(engine_drafter.state_dict()[name], value), name


def test_warm_start_from_the_first_rollouts_beats_a_cold_drafter(tmp_path: Path) -> None:
    """warm_start="rollouts": at the first boundary the drafter trains warm_start_steps on that
    step's rollouts before it is published; its held-out acceptance is above the cold drafter's."""
    module, data = make(sharpen=True, speculative=EAGLE)
    cb = callback(warm_start="rollouts", warm_start_steps=40, learning_rate=3e-3, warmup_steps=0)
    cold = module.policy  # the cold drafter is what the engine builds itself for method="eagle"
    trainer(tmp_path, 1, [cb], enable_checkpointing=False, logger=False).fit(module, datamodule=data)
    assert cb.learner is not None and cb.learner.steps_enqueued >= 40
    assert cb.version == 1 and data.engine.drafter is cb.published  # published right after the warm start
    (_, warm, _), = cb.evaluations
    cold_cb = callback()
    cold_cb.setup_drafter(cold)
    cold_cb.buffer.load_state_dict(cb.buffer.state_dict())  # the same held-out sequences
    cold_cb.learner.evaluate(None, cold_cb.heldout_plans())
    cold_rate = cold_cb.learner.take_evaluation()
    assert cold_rate is not None
    # measured (seeded): held-out acceptance rate 0.07 cold, 0.52 after 40 warm-start steps
    assert warm > cold_rate[0] + 0.3, (cold_rate[0], warm)


@pytest.mark.parametrize("spec", ["eagle", "suffix"])
def test_a_frozen_drafter_trains_in_its_warm_start_only_and_is_published_once(tmp_path: Path, spec: str) -> None:
    """freeze_after_warm_start (the frozen arm of a co-training run): the warm start's steps and no more, though
    the stalls came (counted, as in the co-trained arm, which trains in them); published once, at once on an
    EAGLE engine or at the hand-over from the suffix drafter, and never again; the engine drafts with it."""
    speculative = EAGLE if spec == "eagle" else SpeculativeConfig(
        method="suffix", threshold=8, hysteresis_steps=1, plain_arm=False)
    runs = {}
    for frozen in (True, False):
        module, data = make(sharpen=True, speculative=speculative)
        cb = callback(warm_start="rollouts", warm_start_steps=10, freeze_after_warm_start=frozen,
                      handoff_margin=-100.0 if spec == "suffix" else 0.0)
        trainer(tmp_path / str(frozen), 3, [cb], enable_checkpointing=False).fit(module, datamodule=data)
        runs[frozen] = (cb, data)
    cb, data = runs[True]
    assert cb.learner is not None and cb.learner.steps_enqueued == 10  # the warm start's, nothing in the stalls
    assert cb.last_metrics["drafter/stall_events"] > 0 and cb.last_metrics["drafter/steps_this_rl_step"] == 0
    assert cb.publications == 1 and data.engine.drafter is cb.published and isinstance(cb.published, EagleDrafter)
    assert cb.drafter is not None
    for name, value in cb.drafter.state_dict().items():  # what it drafts with is what the warm start made
        assert torch.equal(cb.published.state_dict()[name].to(value.dtype), value), name
    assert len(cb.evaluations) >= 2  # held-out acceptance is still measured
    trained, _ = runs[False]
    assert trained.learner is not None and trained.learner.steps_enqueued > 10 and trained.publications > 1


def test_sft_warm_start_trains_before_the_first_rollout(tmp_path: Path) -> None:
    module, data = make(speculative=EAGLE)
    cb = callback(warm_start="sft", warm_start_task="arithmetic", warm_start_sequences=8, warm_start_steps=5)
    events: list[int] = []
    data.add_listener(lambda e: events.append(cb.learner.steps_enqueued if cb.learner else -1))
    trainer(tmp_path, 1, [cb], enable_checkpointing=False, logger=False).fit(module, datamodule=data)
    assert events and events[0] == 5  # trained before the engine's first step
    assert cb.version >= 1 and cb.buffer.summary()["min_step"] == -1  # worked solutions are tagged step -1
    with pytest.raises(ValueError, match="needs warm_start_task"):
        DrafterCoTrainConfig(warm_start="sft")


def test_config_overrides_and_validation() -> None:
    cb = DrafterCoTrainCallback(DrafterCoTrainConfig(batch_size=3), stall_threshold=16)
    assert (cb.config.stall_threshold, cb.config.batch_size) == (16, 3)
    with pytest.raises(ValueError, match=r"unknown DrafterCoTrainConfig fields \['stall'\]"):
        DrafterCoTrainCallback(stall=1)
    with pytest.raises(ValueError, match="stall_threshold must be >= 1, got 0"):
        DrafterCoTrainCallback(stall_threshold=0)
    with pytest.raises(ValueError, match="heldout_fraction must be in"):
        DrafterCoTrainConfig(heldout_fraction=1.0)
    with pytest.raises(ValueError, match="buffer_tokens must be >= max_len \\+ 1 = 513, got 100"):
        DrafterCoTrainConfig(buffer_tokens=100)
    with pytest.raises(TypeError, match="PolicyFeatureSource"):
        callback().on_fit_start(pl.Trainer(accelerator="cpu", logger=False), pl.LightningModule())


def test_heldout_accept_rate_is_the_same_in_any_batch_shape() -> None:
    policy = sharpened_policy()
    seqs = rollouts(policy, PROMPT, 6, 10, seed=7)
    rates = []
    for batch_size in (1, 2, 6):
        cb = DrafterCoTrainCallback(DrafterCoTrainConfig(batch_size=batch_size, max_len=16, heldout_fraction=0.0))
        cb.setup_drafter(policy)
        fill_buffer(cb, policy, seqs, len(PROMPT), heldout=True)
        assert cb.learner is not None
        cb.learner.evaluate(None, cb.heldout_plans())
        rate = cb.learner.take_evaluation()
        assert rate is not None
        rates.append(rate[0])
    # row-weighted means over packed batches of 1, 2 or 6 rows are the same
    assert rates[0] == pytest.approx(rates[2], rel=1e-5) and rates[1] == pytest.approx(rates[2], rel=1e-5)
    assert 0.0 < rates[2] < 1.0


def test_bf16_policy_trains_float32_master_and_publishes_bf16() -> None:
    policy = sharpened_policy().to(torch.bfloat16)
    cb = DrafterCoTrainCallback(DrafterCoTrainConfig(learning_rate=3e-3, warmup_steps=0, heldout_fraction=0.0,
                                                     batch_size=4, max_len=32))  # fmt: skip
    drafter = cb.setup_drafter(policy)
    assert drafter.fc.weight.dtype == torch.float32  # master weights: updates of ~lr survive
    seqs = rollouts(sharpened_policy(), PROMPT, 8, 12, seed=1)
    fill_buffer(cb, policy, seqs, len(PROMPT))
    assert cb.buffer.features is not None and cb.buffer.features.dtype == torch.bfloat16  # stored compactly
    assert cb.learner is not None
    batch = cb.buffer.sample(4, 32)
    with torch.no_grad():
        before = float(cb.learner.loss(drafter, batch).loss)
    cb.learner.enqueue(20)
    with torch.no_grad():
        after = float(cb.learner.loss(drafter, batch).loss)
    assert after < before and cb.learner.skipped_nonfinite == 0

    engine = RolloutEngine(policy, max_seq_len=32, max_batch_size=2, speculative=SpeculativeConfig(method="suffix"))
    published = publish_drafter(engine, drafter, 1)
    assert published.fc.weight.dtype == torch.bfloat16  # the engine drafts in the policy's dtype
    torch.testing.assert_close(published.fc.weight.float(), drafter.fc.weight, atol=1e-2, rtol=1e-2)


def test_eagle3_drafters_are_refused_for_cotraining() -> None:
    policy = build_model("qwen2", "tiny", seed=0)
    with pytest.raises(ValueError, match="last hidden state only"):
        DrafterCoTrainCallback(feature_layers=(0, 1, 2)).setup_drafter(policy)


def test_a_checkpoint_of_another_format_is_refused_before_any_state_is_touched() -> None:
    """A state of another format (the first callback wrote none; format 2 had no published_updates) is
    refused with a clear error, the callback untouched."""
    policy = build_model("qwen2", "tiny", seed=0)
    old = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(3))
    state = {"drafter": old.state_dict(), "version": 3, "publications": 3, "total_steps": 12}
    cb = callback()
    with pytest.raises(ValueError, match=r"format None, this version reads format 3 only"):
        cb.load_state_dict(state)
    with pytest.raises(ValueError, match=r"format 2, this version reads format 3"):
        cb.load_state_dict({**state, "format": 2})
    assert not cb.resume_pending and cb.version == 0
    buffer = cb.buffer
    with pytest.raises(ValueError, match=r"FeatureReplayBuffer: a state of format None"):
        buffer.load_state_dict({"generator": torch.Generator().get_state(), "added": 40})
    assert buffer.summary()["added"] == 0


def test_the_callback_publishes_only_to_a_drafter_host(tmp_path: Path) -> None:
    from lightning_tlt.core.types import DrafterHost

    policy = build_model("qwen2", "tiny", seed=0)
    native = RolloutEngine(policy, max_seq_len=32, max_batch_size=2, speculative=SpeculativeConfig(method="suffix"))
    assert isinstance(native, DrafterHost) and DrafterCoTrainCallback(engine=native).engine() is native
    with pytest.raises(TypeError, match="publishes to a DrafterHost .* object is not one"):
        DrafterCoTrainCallback(engine=object()).engine()  # type: ignore[arg-type]

    class Plain(pl.LightningDataModule):
        pass

    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_checkpointing=False)
    trainer.datamodule = Plain()  # type: ignore[misc]
    with pytest.raises(ValueError, match="fit with a RolloutDataModule, got datamodule Plain"):
        DrafterCoTrainCallback().engine(trainer)


def test_bf16_mixed_trainer_cotrains_in_bf16(tmp_path: Path) -> None:
    # float32 master weights under bf16-mixed: the drafter's step computes in bf16, as the policy's update
    module, data = make()
    cb = callback()
    trainer(tmp_path, 2, [cb], enable_checkpointing=False, logger=False, precision="bf16-mixed").fit(
        module, datamodule=data
    )
    assert cb.learner is not None and cb.learner.compute_dtype == torch.bfloat16
    assert cb.learner.steps_enqueued > 0 and cb.learner.skipped_nonfinite == 0
    assert cb.buffer.features is not None and cb.buffer.features.dtype == torch.bfloat16
    assert module.policy.model.embed_tokens.weight.dtype == torch.float32
    assert cb.drafter is not None and cb.drafter.fc.weight.dtype == torch.float32


def _tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, by its path in the nested dicts and lists."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def test_deterministic_runs_give_bit_identical_checkpoints(tmp_path: Path) -> None:
    """Deterministic mode: the draft-length tuner on (scored on a cost model) and the stall pacing on (a fixed
    drafter step cost): two same-seed fits write the same checkpoints, every tensor bit for bit (policy,
    optimizer, drafter, its optimizer, replay buffer), at every step."""
    spec = SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=1, num_draft_tokens=None,
                             draft_candidates=(2, 4), deterministic=True, tuner_draft_cost=0.05)
    runs = []
    for run in range(2):
        module, data = make(speculative=spec)
        cb = callback(max_decode_slowdown=0.05, drafter_step_cost=0.1, max_steps_per_event=2, deterministic=True)
        ckpt = ModelCheckpoint(dirpath=tmp_path / f"run{run}", every_n_train_steps=1, save_top_k=-1)
        trainer(tmp_path, 4, [cb, ckpt], logger=False).fit(module, datamodule=data)
        assert cb.learner is not None and cb.learner.steps_enqueued > 0
        tuner = data.engine.tuner
        assert tuner is not None and len({k for _, k in tuner.state_dict()["counts"]}) > 1  # it chose among arms
        runs.append((cb.learner.steps_enqueued, tuner.state_dict()["rewards"]))
    assert runs[0] == runs[1]
    files = sorted(p.name for p in (tmp_path / "run0").glob("*.ckpt"))
    assert len(files) == 4 and files == sorted(p.name for p in (tmp_path / "run1").glob("*.ckpt"))
    for name in files:
        a, b = (_tensors(torch.load(tmp_path / f"run{r}" / name, weights_only=False)) for r in range(2))
        assert a.keys() == b.keys() and len(a) > 50
        assert any("buffer" in key for key in a) and any("drafter" in key for key in a)
        for key, value in a.items():
            assert torch.equal(value, b[key]), (name, key)


def test_deterministic_pacing_counts_stall_events_never_the_clock() -> None:
    from lightning_tlt.drafters.pacing import StallPacer

    pacer = StallPacer(max_per_event=2, max_slowdown=0.05, step_cost=0.1)  # half a drafter step per stall event
    assert pacer.rate == 0.5
    times = [1e-3, 5.0, 1e-4, 0.3, 2.0, 1e-3]  # wildly varying step times change nothing
    assert [pacer.plan("decode", 4, t, in_flight=0) for t in times] == [0, 1, 0, 1, 0, 1]
    assert StallPacer(max_per_event=2, max_slowdown=0.5, step_cost=0.1).rate == 2.0  # capped per event
    resumed = StallPacer(max_per_event=2, max_slowdown=0.05, step_cost=0.1)
    pacer.plan("decode", 4, 1.0, in_flight=0)
    resumed.load_state_dict(pacer.state_dict())
    assert [resumed.plan("decode", 4, 1.0, 0) for _ in range(3)] == [pacer.plan("decode", 4, 9.0, 0) for _ in range(3)]
    with pytest.raises(ValueError, match="step_cost"):
        StallPacer(max_per_event=2, step_cost=0.0)
    with pytest.raises(ValueError, match="drafter_step_cost"):
        DrafterCoTrainConfig(drafter_step_cost=-1.0)
    with pytest.raises(ValueError, match="tuner_draft_cost"):
        SpeculativeConfig(method="suffix", tuner_draft_cost=-0.1)
    engine = RolloutEngine(build_model("qwen2", "tiny", seed=0), max_seq_len=16, max_batch_size=2,
                           speculative=SpeculativeConfig(method="suffix", deterministic=True, tuner_draft_cost=0.2))
    assert engine.tuner is not None and engine.tuner.cost_model is not None
    assert engine.tuner.cost_model(0, 3) == 1.0 and engine.tuner.cost_model(4, 3) == pytest.approx(1.8)


def test_deterministic_kill_and_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    """Deterministic mode with the tuner and the pacing on: a run killed after step 2 and resumed ends with the
    uninterrupted run's policy and drafter, bit for bit (the pacer's credit and the tuner's counts resume)."""
    spec = SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=1, num_draft_tokens=None,
                             draft_candidates=(2, 4), deterministic=True)

    def run(max_steps: int, ckpt_dir: Path, ckpt_path: Path | None = None) -> tuple[GRPOModule, DrafterCoTrainCallback]:
        module, data = make(speculative=spec)
        cb = callback(max_decode_slowdown=0.05, drafter_step_cost=0.15, max_steps_per_event=2, deterministic=True)
        ckpt = ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1, save_top_k=-1)
        trainer(tmp_path, max_steps, [cb, ckpt], logger=False).fit(module, datamodule=data, ckpt_path=ckpt_path)
        return module, cb

    full_module, full_cb = run(4, tmp_path / "full")
    run(2, tmp_path / "killed")
    resumed_module, resumed_cb = run(4, tmp_path / "resumed", ckpt_path=tmp_path / "killed" / "last.ckpt")
    assert resumed_cb.learner is not None and full_cb.learner is not None
    assert resumed_cb.learner.steps_enqueued == full_cb.learner.steps_enqueued > 0
    assert resumed_cb.pacer.state_dict() == full_cb.pacer.state_dict()
    for name, value in _weights_of(full_module.policy).items():
        assert torch.equal(resumed_module.policy.state_dict()[name], value), name
    for name, value in _weights_of(full_cb.drafter).items():
        assert torch.equal(resumed_cb.drafter.state_dict()[name], value), name
