"""PPOModule with a real Trainer: value head and policy move, TRL's PPO metric names, exact resume."""

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
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.config import PPOConfig
from lightning_tlt.rl.ppo import PPOModule


def digits(completions: list[str], **kwargs: object) -> list[float]:
    """Share of digits in a completion (varies between random completions)."""
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def trainer(tmp_path: Path, max_steps: int, callbacks: list[Callback] | None = None) -> pl.Trainer:
    return pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=callbacks or [],
    )


def read_csv(tmp_path: Path) -> list[dict[str, str]]:
    (path,) = sorted(tmp_path.glob("csv/version_*/metrics.csv"))[-1:]
    with open(path) as f:
        return list(csv.DictReader(f))


class Record(Callback):
    def __init__(self) -> None:
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.batches.append(batch.completion_ids.clone())
        self.losses.append(float(outputs["loss"]))

PPO_NAMES = [
    "objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward", "objective/scores",
    "policy/approxkl_avg", "policy/clipfrac_avg", "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg",
    "policy/entropy_avg", "val/ratio", "reward", "completions/mean_length", "rollout/tokens_per_s", "step_time",
]


def make(seed: int = 0, value_model: bool = False, **cfg: object) -> tuple[PPOModule, RolloutDataModule]:
    config = dict(num_ppo_epochs=2, num_mini_batches=2, response_length=10, learning_rate=3e-3,
                  lr_scheduler_type="constant", temperature=1.0)
    config.update(cfg)
    vm = build_model("qwen2", "tiny", seed=seed + 100) if value_model else None
    module = PPOModule(build_model("qwen2", "tiny", seed=seed), PPOConfig(**config), value_model=vm, seed=seed)
    data = RolloutDataModule("arithmetic", [digits], prompts_per_step=4, task_size=32, seed=seed)
    return module, data


def test_trainer_changes_policy_and_value_and_logs_ppo_metrics(tmp_path: Path) -> None:
    module, data = make(kl_estimator="k3", missing_eos_penalty=1.0)
    before = {k: v.clone() for k, v in module.state_dict().items() if not k.startswith("ref_model")}
    t = trainer(tmp_path, 8, [RolloutMetricsCallback(), RolloutProgressCallback()])
    t.fit(module, datamodule=data)
    assert module.global_step == 8  # 2 rollout batches x 2 epochs x 2 mini-batches
    after = module.state_dict()
    assert (after["value_head.weight"] - before["value_head.weight"]).abs().max() > 1e-4
    policy_keys = [k for k in before if k.startswith("policy.")]
    assert max((after[k] - before[k]).abs().max().item() for k in policy_keys) > 1e-4
    rows = [r for r in read_csv(tmp_path) if r.get("loss")]
    assert len(rows) == 2
    for name in PPO_NAMES:
        assert all(r[name] != "" for r in rows), name
    # k3 is never negative; after the first batch's updates the policy has left its reference
    assert float(rows[1]["objective/kl"]) > 0
    # almost every completion is truncated at 10 tokens: the penalty of 1 shows in the scores
    assert float(rows[0]["objective/scores"]) < float(rows[0]["reward"]) - 0.5
    assert data.num_generations == 1  # PPO samples one completion per prompt unless told otherwise


def test_separate_value_model(tmp_path: Path) -> None:
    module, data = make(value_model=True, num_ppo_epochs=2, num_mini_batches=1, kl_coef=0.0)
    assert module.ref_model is None
    before = {k: v.clone() for k, v in module.value_model.state_dict().items()}
    # the value head starts at zero, so the value model's trunk learns from the second step on
    trainer(tmp_path, 2).fit(module, datamodule=data)
    moved = max((v - before[k]).abs().max().item() for k, v in module.value_model.state_dict().items())
    assert moved > 0


def test_checkpoint_resume_equals_uninterrupted_run(tmp_path: Path) -> None:
    straight = Record()
    module, data = make(seed=2)
    trainer(tmp_path / "a", 12, [straight]).fit(module, datamodule=data)
    module, data = make(seed=2)
    t = trainer(tmp_path / "b", 8)
    t.fit(module, datamodule=data)
    t.save_checkpoint(tmp_path / "c.ckpt")
    checksums = torch.load(tmp_path / "c.ckpt", weights_only=False)["lightning_tlt_checksums"]["tensors"]
    assert "ppo_shuffle_generator" in checksums and "state_dict/value_head.weight" in checksums
    resumed = Record()
    module, data = make(seed=2)
    trainer(tmp_path / "c", 12, [resumed]).fit(module, datamodule=data, ckpt_path=tmp_path / "c.ckpt")
    torch.testing.assert_close(resumed.batches[0], straight.batches[2])
    assert resumed.losses[0] == pytest.approx(straight.losses[2], rel=1e-5, abs=1e-7)


def test_defaults_and_bad_configuration() -> None:
    cfg = PPOConfig()
    assert (cfg.num_ppo_epochs, cfg.num_mini_batches, cfg.kl_coef, cfg.kl_estimator) == (4, 1, 0.05, "k1")
    assert (cfg.cliprange, cfg.vf_coef, cfg.cliprange_value, cfg.gamma, cfg.lam) == (0.2, 0.1, 0.2, 1.0, 0.95)
    assert cfg.whiten_rewards is False
    with pytest.raises(ValueError, match="kl_estimator must be 'k1' or 'k3', got 'k2'"):
        PPOConfig(kl_estimator="k2")
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\], got 1.5"):
        PPOConfig(lam=1.5)
    with pytest.raises(ValueError, match="num_mini_batches must be >= 1, got 0"):
        PPOConfig(num_mini_batches=0)
