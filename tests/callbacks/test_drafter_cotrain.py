"""DrafterCoTrainCallback: learns in stalls only, keeps sampling exact, publishes, resumes, exports.

The policy is a tiny zoo Qwen2 whose LM head is sharpened (x 20): a random tiny model is nearly
uniform over its vocabulary, whereas a warm-started policy is peaked; sharpening gives that
low-entropy behaviour in no time (an SFT warm start takes minutes on two busy cores).
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

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
    cb: DrafterCoTrainCallback, policy: torch.nn.Module, seqs: torch.Tensor, prompt_len: int
) -> None:
    hidden = policy(seqs, output_hidden_states=True).hidden_states[-1]
    completion = torch.zeros_like(seqs)
    completion[:, prompt_len:] = 1
    cb.buffer.add(hidden, seqs, torch.ones_like(seqs), completion, step=0)


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
    cfg = DrafterCoTrainConfig(learning_rate=3e-3, warmup_steps=0, batch_size=8, heldout_fraction=0.0, seed=0)
    cb = DrafterCoTrainCallback(cfg)
    drafter = cb.setup_drafter(policy)
    cold = drafter.inference_copy()
    fill_buffer(cb, policy, rollouts(policy, PROMPT, 16, 24, seed=1), len(PROMPT))
    steps = cb._train_steps(budget_s=float("inf"), max_steps=80)
    assert steps == 80 and cb.skipped_nonfinite == 0
    return policy, cold, drafter.inference_copy(), rollouts(policy, PROMPT, 8, 16, seed=2)


def test_cotraining_raises_acceptance_length(cotrained) -> None:  # noqa: ANN001
    policy, cold, trained, heldout = cotrained
    k = 4
    before = acceptance_length(policy, cold, heldout, len(PROMPT), k, seed=3)
    after = acceptance_length(policy, trained, heldout, len(PROMPT), k, seed=3)
    # measured (seeded): 1.05 tokens per verify step cold, 2.95 after 80 drafter steps
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
    cfg = DrafterCoTrainConfig(
        stall_threshold=2, max_steps_per_event=1, time_budget_s=60.0, batch_size=2, max_overhead=None
    )
    engine = RolloutEngine(policy, max_seq_len=48, max_batch_size=8)
    cb = DrafterCoTrainCallback(cfg, engine=engine)
    cb.setup_drafter(policy)
    events: list[tuple[StepEvent, int]] = []

    def listener(event: StepEvent) -> None:
        before = cb.total_steps
        cb.on_step_event(event)
        events.append((event, cb.total_steps - before))

    engine.add_listener(listener)
    # an empty buffer: nothing to train on, even in stalls
    engine.generate([PROMPT], SamplingConfig(max_new_tokens=4, stop_token_ids=[]), num_samples=2,
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    assert cb.total_steps == 0
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
    assert cb.total_steps == len(stall)
    assert [entry[1] for entry in cb.step_log] == [e.active_rows for e in stall]


def test_stall_training_is_bounded_by_max_overhead() -> None:
    """Each stall step earns max_overhead x its time; training never spends more than was earned
    (plus the one step that measures the cost), so decoding slows by at most about that share."""
    policy = build_model("qwen2", "tiny", seed=0)
    cfg = DrafterCoTrainConfig(stall_threshold=4, max_steps_per_event=4, time_budget_s=1.0, batch_size=2,
                               max_overhead=0.25)
    cb = DrafterCoTrainCallback(cfg)
    cb.setup_drafter(policy)
    fill_buffer(cb, policy, rollouts(policy, PROMPT, 4, 8, seed=1), len(PROMPT))
    step_time = 0.004  # a synthetic decode step of 4 ms at 2 active rows
    for i in range(200):
        cb.on_step_event(StepEvent(i, "decode", 2, 0, 8, step_time, new_tokens=2))
    available, used = cb._window.stall_available_s, cb._window.stall_used_s
    assert available == pytest.approx(200 * step_time)
    per_step = used / cb.total_steps
    assert cb.total_steps >= 2  # it did train in the stalls ...
    assert used <= 0.25 * available + 2 * per_step  # ... within the earned share
    assert cb.total_steps < 200  # not after every stall step, as with max_overhead=None
    # outside stalls nothing is earned and nothing trained
    before = cb.total_steps
    for i in range(50):
        cb.on_step_event(StepEvent(i, "decode", 6, 0, 8, step_time, new_tokens=6))
    assert cb.total_steps == before


def test_max_overhead_is_validated() -> None:
    with pytest.raises(ValueError, match="max_overhead"):
        DrafterCoTrainConfig(max_overhead=1.5)


def test_nonfinite_loss_is_skipped_and_counted() -> None:
    policy = build_model("qwen2", "tiny", seed=0)
    cb = DrafterCoTrainCallback(DrafterCoTrainConfig(heldout_fraction=0.0, batch_size=2))
    drafter = cb.setup_drafter(policy)
    seqs = torch.tensor([PROMPT + [1, 2, 3, 4]])
    hidden = torch.full((1, seqs.shape[1], 128), float("nan"))
    completion = torch.zeros_like(seqs)
    completion[:, len(PROMPT) :] = 1
    cb.buffer.add(hidden, seqs, torch.ones_like(seqs), completion, step=0)
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    assert cb._train_steps(budget_s=60.0, max_steps=3) == 3
    assert cb.skipped_nonfinite == 3 and cb.total_steps == 3
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, before[name]), name
    # the fused AdamW skipped on the device: no step counted, moments untouched
    assert cb.optimizer is not None
    for state in cb.optimizer.state_dict()["state"].values():
        assert float(state["step"]) == 0.0
        assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()
    # then a finite batch trains again
    cb.buffer.clear()
    fill_buffer(cb, policy, seqs, len(PROMPT))
    assert cb._train_steps(budget_s=60.0, max_steps=2) == 2 and cb.skipped_nonfinite == 3
    assert any(not torch.equal(v, before[k]) for k, v in drafter.state_dict().items())


def test_publish_copies_in_place_with_version() -> None:
    policy = build_model("qwen2", "tiny", seed=0)

    class Engine:
        drafter = None
        drafter_version = -1

    engine = Engine()
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


def make(seed: int = 0, speculative: SpeculativeConfig | None = None) -> tuple[GRPOModule, RolloutDataModule]:
    config = GRPOConfig(
        num_generations=4, max_completion_length=12, learning_rate=1e-3, lr_scheduler_type="constant"
    )
    module = GRPOModule(build_model("qwen2", "tiny", seed=seed), config)
    data = RolloutDataModule(
        "arithmetic", [digits], prompts_per_step=2, task_size=32, seed=seed, speculative=speculative
    )
    return module, data


def callback() -> DrafterCoTrainCallback:
    # 8 rows decode together: a threshold of 8 makes every decode step a stall (selectivity is tested above)
    cfg = DrafterCoTrainConfig(
        stall_threshold=8, max_steps_per_event=1, time_budget_s=60.0, batch_size=4, learning_rate=1e-3, max_overhead=None,
        heldout_fraction=0.25, seed=0,
    )  # fmt: skip
    return DrafterCoTrainCallback(cfg)


def trainer(tmp_path: Path, max_steps: int, callbacks: list, **kw: object) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
        enable_model_summary=False, enable_progress_bar=False, callbacks=callbacks, **kw,
    )  # fmt: skip


def test_trainer_harvests_trains_in_stalls_publishes_and_logs(tmp_path: Path) -> None:
    module, data = make()
    cb = callback()
    embed = module.policy.model.embed_tokens.weight
    trainer(tmp_path, 3, [cb], enable_checkpointing=False).fit(module, datamodule=data)
    # step 1's rollout came before any harvest: no training then; steps 2 and 3 trained in their stalls
    reasons = {reason for reason, _, _ in cb.step_log}
    assert reasons == {"stall"} and all(0 < rows <= 8 for _, rows, _ in cb.step_log)
    assert cb.total_steps == sum(steps for _, _, steps in cb.step_log) > 0
    assert cb.buffer.summary()["max_step"] == 2 and cb.buffer.summary()["added"] > 0
    # published after each of the 3 RL steps; the engine drafts with a frozen copy of that version
    engine = data.engine
    assert cb.version == 3 and engine.drafter_version == 3 and engine.drafter is cb.published
    for name, value in cb.drafter.state_dict().items():
        assert torch.equal(engine.drafter.state_dict()[name], value), name
    assert engine.drafter.embed_weight.data_ptr() == module.policy.model.embed_tokens.weight.data_ptr()
    assert module.policy.model.embed_tokens.weight is embed
    assert module.harvest_features is False  # handed back at teardown
    (path,) = sorted(tmp_path.glob("csv/version_*/metrics.csv"))
    with open(path) as f:
        rows = [r for r in csv.DictReader(f) if r.get("drafter/version")]
    assert [float(r["drafter/version"]) for r in rows] == [1.0, 2.0, 3.0]
    trained_rows = [r for r in rows if r.get("drafter/loss")]
    assert trained_rows and all(float(r["drafter/stall_time_used_s"]) > 0 for r in trained_rows)
    assert all(0.0 <= float(r["drafter/top1_accuracy"]) <= 1.0 for r in trained_rows)
    assert any(r.get("drafter/heldout_accept_rate") for r in rows)


@pytest.mark.parametrize("margin", [-100.0, 100.0])
def test_suffix_drafter_speculates_until_the_eagle_drafter_beats_it(tmp_path: Path, margin: float) -> None:
    """TLT's cold start: the model-free drafter speculates first; the EAGLE drafter takes over only
    once its held-out expected acceptance length beats the engine's measured one (plus the margin)."""
    spec = SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=1, plain_arm=False)  # always speculate
    module, data = make(speculative=spec)
    cb = callback()
    cb.config.handoff_margin = margin
    trainer(tmp_path, 3, [cb], enable_checkpointing=False).fit(module, datamodule=data)
    engine = data.engine
    assert "spec/acceptance_length" in engine.last_stats  # the suffix drafter did speculate
    if margin < 0:  # any held-out estimate beats the suffix drafter's by -100: handed off at the first boundary
        assert isinstance(engine.drafter, EagleDrafter) and engine.drafter is cb.published
        assert cb.version == 3
    else:  # never good enough: the suffix drafter stays, nothing is published
        assert isinstance(engine.drafter, SuffixDrafter) and cb.published is None
        assert cb.version == 0 and cb.total_steps > 0  # it still trained in the stalls


def test_checkpoint_resume_and_export(tmp_path: Path) -> None:
    # the engine speculates with the published drafter, and its draft-length tuner is checkpointed too
    spec = SpeculativeConfig(method="eagle", threshold=8, hysteresis_steps=1, tuner_epsilon=0.5)
    module, data = make(speculative=spec)
    cb = callback()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer(tmp_path, 2, [cb, ckpt]).fit(module, datamodule=data)
    saved_optimizer = cb.optimizer.state_dict()
    assert cb.total_steps > 0 and saved_optimizer["state"]
    saved_tuner = cb.state_dict()["tuner"]
    assert saved_tuner is not None and saved_tuner["counts"]  # the engine speculated and measured
    last = tmp_path / "ckpt" / "last.ckpt"

    # "kill" and resume into fresh objects: max_steps reached, so only the restore runs
    module2, data2 = make(speculative=spec)
    cb2 = callback()
    ckpt2 = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, every_n_train_steps=1)
    trainer(tmp_path, 2, [cb2, ckpt2]).fit(module2, datamodule=data2, ckpt_path=last)
    assert cb2.version == cb.version == 2 and cb2.total_steps == cb.total_steps
    for name, value in cb.drafter.state_dict().items():
        assert torch.equal(cb2.drafter.state_dict()[name], value), name
        assert torch.equal(cb2.published.state_dict()[name], cb.published.state_dict()[name]), name
    restored = cb2.optimizer.state_dict()
    assert restored["state"].keys() == saved_optimizer["state"].keys()
    for idx, entry in saved_optimizer["state"].items():
        for key, value in entry.items():
            assert torch.equal(restored["state"][idx][key], value), (idx, key)
    assert cb2.buffer._added == cb.buffer._added
    assert data2.engine.drafter_version == 2
    assert (
        cb2.state_dict()["tuner"]["rewards"] == saved_tuner["rewards"]
    )  # kept until the engine's tuner exists

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


def test_config_overrides_and_validation() -> None:
    cb = DrafterCoTrainCallback(DrafterCoTrainConfig(batch_size=3), stall_threshold=16)
    assert (cb.config.stall_threshold, cb.config.batch_size) == (16, 3)
    with pytest.raises(ValueError, match=r"unknown DrafterCoTrainConfig fields \['stall'\]"):
        DrafterCoTrainCallback(stall=1)
    with pytest.raises(ValueError, match="stall_threshold must be >= 1, got 0"):
        DrafterCoTrainCallback(stall_threshold=0)
    with pytest.raises(ValueError, match="heldout_fraction must be in"):
        DrafterCoTrainConfig(heldout_fraction=1.0)


def test_heldout_accept_rate_is_the_same_in_chunks() -> None:
    policy = sharpened_policy()
    seqs = rollouts(policy, PROMPT, 6, 10, seed=7)
    rates = []
    for batch_size in (1, 4, 64):
        cb = DrafterCoTrainCallback(DrafterCoTrainConfig(batch_size=batch_size, heldout_fraction=0.0))
        drafter = cb.setup_drafter(policy)
        fill_buffer(cb, policy, seqs, len(PROMPT))
        batch = cb.buffer._collate(list(cb.buffer._train), None, crop=False)
        assert len(batch) == 6 and len(batch.select(4, 8)) == 2
        with torch.no_grad():
            rates.append(float(cb._accept_rate(drafter, batch)))
    # row-weighted means over chunks equal the one-batch mean
    assert rates[0] == pytest.approx(rates[2], rel=1e-5) and rates[1] == pytest.approx(rates[2], rel=1e-5)
    assert 0.0 < rates[2] < 1.0


def test_bf16_policy_trains_float32_master_and_publishes_bf16() -> None:
    policy = sharpened_policy().to(torch.bfloat16)
    cb = DrafterCoTrainCallback(DrafterCoTrainConfig(learning_rate=3e-3, warmup_steps=0, heldout_fraction=0.0))
    drafter = cb.setup_drafter(policy)
    assert drafter.fc.weight.dtype == torch.float32  # master weights: updates of ~lr survive
    seqs = rollouts(sharpened_policy(), PROMPT, 8, 12, seed=1)
    fill_buffer(cb, policy, seqs, len(PROMPT))
    batch = cb.buffer._collate(list(cb.buffer._train), None, crop=False)
    with torch.no_grad():
        before = float(cb._loss(drafter, batch).loss)
    cb._train_steps(budget_s=float("inf"), max_steps=20)
    with torch.no_grad():
        after = float(cb._loss(drafter, batch).loss)
    assert after < before and cb.skipped_nonfinite == 0

    class Engine:
        drafter = None
        drafter_version = 0

    published = publish_drafter(Engine(), drafter, 1)
    assert published.fc.weight.dtype == torch.bfloat16  # the engine drafts in the policy's dtype
    torch.testing.assert_close(published.fc.weight.float(), drafter.fc.weight, atol=1e-2, rtol=1e-2)


def test_eagle3_drafters_are_refused_for_cotraining() -> None:
    policy = build_model("qwen2", "tiny", seed=0)
    with pytest.raises(ValueError, match="last hidden state only"):
        DrafterCoTrainCallback(feature_layers=(0, 1, 2)).setup_drafter(policy)
