"""GRPOModule with a real Trainer: weights move, TRL's metric names land in the CSV, exact resume."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_tlt.callbacks.rollout_metrics import RolloutMetricsCallback
from lightning_tlt.callbacks.rollout_progress import RolloutProgressCallback
from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.batch import RolloutBatch
from lightning_tlt.rl.common import PolicyFeatureSource
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule

TRL_NAMES = [
    "reward", "reward_std", "rewards/digits/mean", "completions/mean_length", "completions/clipped_ratio",
    "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "num_tokens",
    "rollout/tokens_per_s", "spec/fraction", "step_time", "loss", "learning_rate",
]


def digits(completions: list[str], **kwargs: object) -> list[float]:
    """Share of digits in a completion: varies between random completions, so advantages are non-zero."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def make(seed: int = 0, **cfg: object) -> tuple[GRPOModule, RolloutDataModule]:
    config = dict(num_generations=4, max_completion_length=12, learning_rate=3e-3, lr_scheduler_type="constant")
    config.update(cfg)
    module = GRPOModule(build_model("qwen2", "tiny", seed=seed), GRPOConfig(**config))
    data = RolloutDataModule("arithmetic", [digits], prompts_per_step=2, task_size=32, seed=seed)
    return module, data


def trainer(tmp_path: Path, max_steps: int, callbacks: list[Callback] | None = None, **kw: object) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks or [], **kw,
    )


def read_csv(tmp_path: Path) -> list[dict[str, str]]:
    (path,) = sorted(tmp_path.glob("csv/version_*/metrics.csv"))[-1:]
    with open(path) as f:
        return list(csv.DictReader(f))


class Grads(Callback):
    """The gradients of every parameter just before each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:  # noqa: ANN001
        self.steps.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


class Record(Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches.append(batch.completion_ids.clone())
        self.losses.append(float(outputs["loss"]))


def test_trainer_two_steps_changes_weights_and_logs_trl_metrics(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    module, data = make(beta=0.04)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    progress = RolloutProgressCallback(refresh_s=0.0)
    seen: list[str] = []
    data.add_listener(lambda e: seen.append(progress.last_text))
    trainer(tmp_path, 2, [RolloutMetricsCallback(), progress]).fit(module, datamodule=data)
    assert module.global_step == 2
    moved = max((before[k] - v).abs().max().item() for k, v in module.policy.state_dict().items())
    assert moved > 1e-4
    # the reference model of the KL term stayed where it was
    for name, p in module.ref_model.state_dict().items():
        torch.testing.assert_close(p, before[name])
    rows = [r for r in read_csv(tmp_path) if r.get("loss")]
    assert len(rows) == 2
    for name in TRL_NAMES:
        assert all(r[name] != "" for r in rows), name
    # step 2 trains after one update: KL against the reference is positive then
    assert float(rows[1]["kl"]) > 0
    assert float(rows[0]["completions/mean_length"]) > 0
    assert any(t.startswith("rollout: ") and "rows active" in t for t in seen)
    # the per-step lines are printed through the progress bar's console (above the bar), on stdout
    assert any(line.startswith("step ") and "reward" in line and "tok/s" in line
               for line in capsys.readouterr().out.splitlines())


def test_num_iterations_reuses_the_batch_with_clipping(tmp_path: Path) -> None:
    module, data = make(num_iterations=3, learning_rate=3e-2, epsilon=0.05)
    rec = Record()
    trainer(tmp_path, 3, [rec]).fit(module, datamodule=data)
    assert len(rec.batches) == 1  # three optimizer steps, one rollout batch
    assert module.global_step == 3
    row = [r for r in read_csv(tmp_path) if r.get("loss")][-1]
    assert float(row["clip_ratio/region_mean"]) > 0  # later passes are off-policy and get clipped


def test_harvest_features_for_drafter_cotraining(tmp_path: Path) -> None:
    import copy

    module, data = make()
    initial = copy.deepcopy(module.policy)
    assert isinstance(module, PolicyFeatureSource) and module.take_policy_features() is None
    module.request_policy_features(True)
    trainer(tmp_path, 1).fit(module, datamodule=data)
    feats = module.take_policy_features()
    assert feats is not None and module.take_policy_features() is None  # handed over once
    n, t = feats.input_ids.shape
    assert feats.hidden_states.shape == (n, t, module.policy.config.hidden_size)
    assert not feats.hidden_states.requires_grad and feats.step == 0
    assert feats.completion_mask.sum() > 0 and bool((feats.completion_mask <= feats.attention_mask).all())
    # they are the policy's final hidden states (HF hidden_states[-1]) of the batch, before its update
    positions = (feats.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = initial(input_ids=feats.input_ids, attention_mask=feats.attention_mask, position_ids=positions,
                      output_hidden_states=True).hidden_states[-1]
    real = feats.attention_mask.bool()
    torch.testing.assert_close(feats.hidden_states[real], ref[real], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_micro_batches_give_the_whole_batch_update(tmp_path: Path, loss_type: str) -> None:
    """Gradients accumulated over trimmed micro-batches (3 rows of 8) equal one whole-batch step."""
    runs = {}
    for micro in (None, 3, "tokens"):
        split = {"micro_batch_tokens": 1} if micro == "tokens" else {"micro_batch_size": micro}  # tokens: a row each
        module, data = make(seed=2, loss_type=loss_type, num_iterations=2, beta=0.04, **split)
        module.request_policy_features(True)
        rec, grads = Record(), Grads()
        trainer(tmp_path / str(micro), 2, [rec, grads]).fit(module, datamodule=data)
        assert len(rec.batches) == 1 and len(grads.steps) == 2  # two optimizer steps on one rollout batch
        runs[micro] = (module, rec, grads, [r for r in read_csv(tmp_path / str(micro)) if r.get("loss")])
    whole, rec_whole, grads_whole, rows_whole = runs[None]
    assert len(runs[3][0].micro_batches(_batch_of(8))) == 3  # 8 rows: chunks of 3, 3, 2
    assert len(runs["tokens"][0].micro_batches(_batch_of(8))) == 8  # a budget of 1 token: a row each
    a = whole.take_policy_features()
    for micro, rec_micro, grads_micro, rows_micro in (runs[3], runs["tokens"]):
        assert torch.equal(rec_whole.batches[0], rec_micro.batches[0])  # the same rollout
        # the gradients of the first step (on-policy) are the whole batch's; Adam turns float noise in
        # near-zero gradients into full-size steps, so the weights are not compared
        for name, value in grads_whole.steps[0].items():
            torch.testing.assert_close(grads_micro.steps[0][name], value, atol=1e-7, rtol=1e-4, msg=name)
        for key in ("loss", "kl", "entropy", "clip_ratio/region_mean"):
            assert float(rows_micro[-1][key]) == pytest.approx(float(rows_whole[-1][key]), rel=1e-4, abs=1e-6), key
        b = micro.take_policy_features()
        assert a is not None and b is not None
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.completion_mask, b.completion_mask)
        real = a.attention_mask.bool()
        torch.testing.assert_close(b.hidden_states[real], a.hidden_states[real], atol=1e-5, rtol=1e-4)


def _batch_of(data_rows: int) -> RolloutBatch:
    """A right-padded batch of ``data_rows`` rows whose completions have lengths ``data_rows, ..., 1``."""
    c = data_rows + 2
    completion_mask = (torch.arange(c)[None, :] < torch.arange(data_rows, 0, -1)[:, None]).long()
    ones = torch.ones(data_rows, 3, dtype=torch.long)
    zeros = torch.zeros(data_rows)
    return RolloutBatch(
        prompt_ids=ones, prompt_mask=ones, completion_ids=completion_mask * 5, completion_mask=completion_mask,
        sampling_logprobs=torch.zeros(data_rows, c), rewards=zeros, rewards_per_func=zeros[:, None],
        advantages=zeros, is_truncated=zeros.bool(), num_generations=2,
    )


def test_micro_batches_are_trimmed() -> None:
    module, _ = make(micro_batch_size=3)
    batch = _batch_of(8)
    pairs = module.micro_batches(batch)
    assert [rows.tolist() for rows, _ in pairs] == [[7, 6, 5], [4, 3, 2], [1, 0]]  # shortest completions first
    assert [c.completion_ids.shape[1] for _, c in pairs] == [3, 6, 8]  # each cut to its longest completion
    assert all(c.prompt_ids.shape[1] == 3 for _, c in pairs)
    for rows, chunk in pairs:
        assert torch.equal(chunk.completion_mask.sum(1), batch.completion_mask.sum(1)[rows])
    with pytest.raises(ValueError, match="micro_batch_size must be >= 1 or None, got 0"):
        GRPOConfig(micro_batch_size=0)


def test_micro_batches_packed_by_a_token_budget() -> None:
    batch = _batch_of(8)  # prompts of 3 tokens, completions of 8 .. 1 tokens
    module, _ = make(micro_batch_tokens=20)
    pairs = module.micro_batches(batch)
    # by hand, shortest first: 1 x 4, 2 x 5, 3 x 6 = 18 (a 4th: 4 x 7 = 28 > 20); 1 x 7, 2 x 8 = 16 (3 x 9 = 27);
    # 1 x 9, 2 x 10 = 20; 1 x 11
    assert [rows.tolist() for rows, _ in pairs] == [[7, 6, 5], [4, 3], [2, 1], [0]]
    assert [len(rows) * c.input_ids.shape[1] for rows, c in pairs] == [18, 16, 20, 11]  # the last: one row, over
    capped, _ = make(micro_batch_tokens=20, micro_batch_size=2)
    assert [rows.tolist() for rows, _ in capped.micro_batches(batch)] == [[7, 6], [5, 4], [3, 2], [1], [0]]
    whole, _ = make(micro_batch_tokens=10_000)
    [(rows, same)] = whole.micro_batches(batch)
    assert same is batch and rows.tolist() == list(range(8))
    with pytest.raises(ValueError, match="micro_batch_tokens must be >= 1 or None, got 0"):
        GRPOConfig(micro_batch_tokens=0)


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    straight = Record()
    module, data = make(seed=1)
    trainer(tmp_path / "a", 3, [straight]).fit(module, datamodule=data)

    first = Record()
    module, data = make(seed=1)
    t = trainer(tmp_path / "b", 2, [first])
    t.fit(module, datamodule=data)
    ckpt = tmp_path / "two.ckpt"
    t.save_checkpoint(ckpt)

    resumed = Record()
    module, data = make(seed=1)
    trainer(tmp_path / "c", 3, [resumed]).fit(module, datamodule=data, ckpt_path=ckpt)
    assert len(resumed.batches) == 1
    for a, b in zip(straight.batches[:2], first.batches):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(resumed.batches[0], straight.batches[2])
    assert resumed.losses[0] == pytest.approx(straight.losses[2], rel=1e-5, abs=1e-7)
    assert not torch.equal(straight.batches[2], straight.batches[1])


def test_accepts_a_real_trl_grpo_config() -> None:
    from trl import GRPOConfig as TRLGRPOConfig

    trl_cfg = TRLGRPOConfig(
        output_dir="/tmp/unused", use_cpu=True, bf16=False, num_generations=4, beta=0.1, epsilon_high=0.28,
        loss_type="grpo", scale_rewards="batch", max_completion_length=64, learning_rate=5e-6, report_to="none",
    )
    policy = build_model("qwen2", "tiny", seed=0)
    for module in (GRPOModule(policy, config=trl_cfg), GRPOModule.from_trl(policy, trl_cfg)):
        cfg = module.config
        assert (cfg.num_generations, cfg.beta, cfg.epsilon_high, cfg.loss_type) == (4, 0.1, 0.28, "grpo")
        assert (cfg.scale_rewards, cfg.max_completion_length, cfg.learning_rate) == ("batch", 64, 5e-6)
        assert cfg.lr_scheduler_type == "linear"
        assert module.ref_model is not None  # beta > 0 loads the reference


def test_gradient_checkpointing_from_trl_checkpoints_the_policy_not_the_reference() -> None:
    from trl import GRPOConfig as TRLGRPOConfig

    trl_cfg = TRLGRPOConfig(output_dir="/tmp/unused", use_cpu=True, bf16=False, beta=0.1, report_to="none")
    assert trl_cfg.gradient_checkpointing  # TRL's default; the kit's own is off
    module = GRPOModule(build_model("qwen2", "tiny", seed=0), config=trl_cfg)
    assert module.config.gradient_checkpointing and not GRPOConfig().gradient_checkpointing
    module.configure_model()  # no strategy: checkpointed, not sharded
    module.configure_model()  # again (validate after fit): nothing twice
    assert module.ref_model is not None
    from torch.distributed._composable import checkpoint

    flags = lambda model: [checkpoint.state(layer) is not None for layer in model.model.layers]  # noqa: E731
    assert flags(module.policy) == [True] * module.policy.config.num_hidden_layers
    assert not any(flags(module.ref_model))  # frozen: nothing to recompute for


def test_defaults_are_trls() -> None:
    cfg = GRPOConfig()
    assert (cfg.num_generations, cfg.beta, cfg.epsilon, cfg.epsilon_high, cfg.loss_type) == (8, 0.0, 0.2, None, "dapo")
    assert (cfg.scale_rewards, cfg.num_iterations, cfg.importance_sampling_level) == ("group", 1, "token")
    assert (cfg.max_completion_length, cfg.temperature, cfg.top_p, cfg.top_k) == (512, 1.0, 1.0, 0)
    assert (cfg.learning_rate, cfg.mask_truncated_completions) == (1e-6, False)
    assert GRPOModule(build_model("qwen2", "tiny", seed=0)).ref_model is None  # beta == 0: no reference


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_generations": 1}, r"num_generations must be >= 2 .* got 1"),
        ({"epsilon_high": 0.1}, r"epsilon_high must be >= epsilon \(0.2\) or None, got 0.1"),
        ({"loss_type": "ppo"}, r"loss_type must be one of \['bnpo', 'dapo', 'dr_grpo', 'grpo'\], got 'ppo'"),
        ({"scale_rewards": "std"}, r"scale_rewards must be one of .* got 'std'"),
        ({"importance_sampling_level": "batch"}, r"importance_sampling_level must be 'token' or 'sequence'"),
        ({"beta": -1.0}, r"beta must be >= 0"),
        ({"temperature": 0.0}, r"temperature must be > 0 for training"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
    ],
)
def test_bad_configuration_is_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**kwargs)


def test_datamodule_disagreeing_with_module_is_refused(tmp_path: Path) -> None:
    module, _ = make()
    data = RolloutDataModule("arithmetic", [digits], num_generations=3, prompts_per_step=2, task_size=8)
    with pytest.raises(ValueError, match=r"num_generations=3 disagrees with the RL module's config \(4\)"):
        trainer(tmp_path, 1).fit(module, datamodule=data)


def test_wandb_offline_and_tensorboard_loggers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    module, data = make()
    wandb_logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="lightning-tlt-test")
    tb_logger = TensorBoardLogger(str(tmp_path), name="tb")
    pl.Trainer(
        max_steps=1, accelerator="cpu", logger=[wandb_logger, tb_logger], log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, enable_progress_bar=False,
    ).fit(module, datamodule=data)
    wandb_logger.experiment.finish()
    run_dirs = list(tmp_path.glob("wandb/offline-run-*"))
    assert len(run_dirs) == 1 and list(run_dirs[0].glob("*.wandb"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = list(tmp_path.glob("tb/version_0/events.out.tfevents.*"))
    acc = EventAccumulator(str(events))
    acc.Reload()
    assert {"reward", "completions/mean_length", "entropy"} <= set(acc.Tags()["scalars"])


def test_resume_restores_the_engines_gate_and_tuner(tmp_path: Path) -> None:
    """The datamodule's checkpoint state holds the engine's adaptive state; a resumed engine starts from it."""
    from lightning_tlt.core.types import SpeculativeConfig

    def setup() -> tuple[GRPOModule, RolloutDataModule]:
        module = GRPOModule(build_model("qwen2", "tiny", seed=3),
                            GRPOConfig(num_generations=4, max_completion_length=16, learning_rate=1e-3))
        data = RolloutDataModule("arithmetic", [digits], prompts_per_step=2, task_size=32, seed=3,
                                 speculative=SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=1))
        return module, data

    module, data = setup()
    t = trainer(tmp_path / "a", 2)
    t.fit(module, datamodule=data)
    ckpt = tmp_path / "two.ckpt"
    t.save_checkpoint(ckpt)
    live = data.engine.adaptive_state_dict()
    saved = torch.load(ckpt, weights_only=False)["RolloutDataModule"]["engine_adaptive"]
    assert saved["gate"] == live["gate"] and saved["gate"]["switches"] > 0  # the gate has opened: state to keep
    assert saved["tuner"]["counts"] and saved["tuner"]["counts"] == live["tuner"]["counts"]

    module, data = setup()
    seen: list[dict] = []
    data.add_listener(lambda e: seen.append(data.engine.adaptive_state_dict()) if not seen else None)
    trainer(tmp_path / "b", 3).fit(module, datamodule=data, ckpt_path=ckpt)
    restored = seen[0]  # at the resumed run's first engine event, before its first decode step
    # a generate call starts with the gate closed (a new batch starts large), as the uninterrupted run's next
    # call does; what it learned (its switch count) carries over
    assert restored["gate"] == {**saved["gate"], "on": False, "streak": 0}
    assert restored["tuner"]["counts"] == saved["tuner"]["counts"]
    assert restored["tuner"]["rewards"] == saved["tuner"]["rewards"]
    assert torch.equal(restored["tuner"]["generator"], saved["tuner"]["generator"])


@pytest.mark.parametrize("cudnn", [False, True])
def test_the_training_forward_keeps_off_cudnn_attention_unless_asked(tmp_path: Path, cudnn: bool) -> None:
    """pytorch/pytorch#196678: cuDNN's SDPA backward returns NaN query gradients for masked batches of
    some lengths on H100/H200. The policy's training forward (and so its backward) runs with cuDNN's
    kernels switched off, the rollout engine's attention and everything outside untouched."""
    module, data = make(cudnn_attention=cudnn)
    seen: list[bool] = []
    attention = module.policy.model.layers[0].self_attn
    handle = attention.register_forward_pre_hook(lambda *_: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    trainer(tmp_path, 1).fit(module, datamodule=data)
    handle.remove()
    assert seen and set(seen) == {cudnn}  # every training forward (the engine runs its own attention)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored afterwards


def test_bf16_mixed_trains_float32_weights_and_rolls_out_in_bf16(tmp_path: Path) -> None:
    """Under a bf16-mixed Trainer the policy keeps float32 master weights (an AdamW step of the size RL
    takes is below half a bf16 unit of most weights: in bf16 they would not move) and the engine rolls
    out from its bf16 copy of them, refreshed every RL step."""
    module, data = make(learning_rate=1e-5)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer(tmp_path, 2, precision="bf16-mixed").fit(module, datamodule=data)
    engine = data.engine
    assert engine.dtype == torch.bfloat16 and engine.inference_copy is not None
    assert all(p.dtype == torch.float32 for p in module.policy.parameters())
    moved = [n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])]
    assert len(moved) == len(before)  # every tensor moved, the norms' weights too
    engine.generate([[5, 6]], SamplingConfig(max_new_tokens=2))  # the copy follows the trained weights
    for (name, copied), (_, master) in zip(engine.inference_copy.module.named_parameters(),
                                           module.policy.named_parameters()):
        assert copied.dtype == torch.bfloat16 and torch.equal(copied, master.detach().bfloat16()), name
    # a bf16 policy at the same learning rate: one step leaves the norms' weights where they were
    bf16 = before["model.layers.0.input_layernorm.weight"].bfloat16()
    stepped = bf16 - 1e-5 * torch.sign(torch.randn_like(bf16))  # an Adam step of size lr
    assert torch.equal(stepped, bf16)
