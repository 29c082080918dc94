"""One meaning of a step: the optimizer step (``global_step``) in max_steps, the CSV, the bar, the printed line, checkpoints."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger

from lightning_tlt.callbacks.rollout_metrics import RolloutMetricsCallback
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.config import GRPOConfig, PPOConfig
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.rl.ppo import PPOModule
from lightning_tlt.rl.progress_bar import OptimizerStepRichProgressBar, OptimizerStepTQDMProgressBar


def fit(
    tmp_path: Path, module: pl.LightningModule, max_steps: int, callbacks: list[Callback], validate: bool = False
) -> pl.Trainer:
    data = RolloutDataModule("arithmetic", prompts_per_step=2, task_size=16, eval_size=2, seed=0)
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"), log_every_n_steps=1,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1.0 if validate else 0, callbacks=callbacks,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, datamodule=data)
    return trainer


def csv_rows(tmp_path: Path) -> list[dict[str, str]]:
    with open(next(tmp_path.glob("csv/version_0/metrics.csv"))) as f:
        return [r for r in csv.DictReader(f) if r.get("loss")]


def test_grpo_stops_at_max_steps_and_every_view_counts_optimizer_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = GRPOConfig(num_generations=2, max_completion_length=6, num_iterations=2, learning_rate=3e-3)
    module = GRPOModule(build_model("qwen2", "tiny", seed=0), config)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    with pytest.warns(UserWarning, match=r"max_steps=3 is not a multiple of the 2 "
                                                     r"optimizer steps .* last batch is trained on for 1 of them"):
        trainer = fit(tmp_path, module, 3, [RolloutMetricsCallback(), TQDMProgressBar(), checkpoints])
    assert trainer.global_step == 3  # two rollout batches: 2 + 1 optimizer steps, never 4
    rows = csv_rows(tmp_path)
    assert [r["step"] for r in rows] == ["2", "3"]  # the CSV's step is global_step after the batch
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]  # above the bar
    assert [line.split(" | ")[0] for line in printed] == ["step 2/3", "step 3/3"]
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["epoch=0-step=3.ckpt"]
    bar = trainer.progress_bar_callback
    assert type(bar) is OptimizerStepTQDMProgressBar  # Lightning's bar, counting optimizer steps
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)
    # the learning rate each batch's last update used (linear schedule over 3 steps: 2/3, then 1/3), not the next
    lrs = [float(r["learning_rate"]) for r in rows]
    assert lrs == pytest.approx([3e-3 * 2 / 3, 3e-3 * 1 / 3])


def test_every_epoch_is_one_pass_over_the_prompts(tmp_path: Path) -> None:
    # 16 prompts, 2 a step: 8 rollout batches a pass, 2 optimizer steps each; 40 steps = 2.5 passes
    config = GRPOConfig(num_generations=2, max_completion_length=4, num_iterations=2)
    module = GRPOModule(build_model("qwen2", "tiny", seed=0), config)
    epochs: list[tuple[int, int]] = []

    class Epochs(Callback):
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            epochs.append((trainer.current_epoch, trainer.global_step))

    checkpoints = ModelCheckpoint(dirpath=tmp_path / "ckpt")
    trainer = fit(tmp_path, module, 40, [Epochs(), checkpoints], validate=True)
    assert epochs == [(0, 16), (1, 32), (2, 40)]  # no empty epoch between passes
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["epoch=2-step=40.ckpt"]
    assert trainer.datamodule.state_dict()["epoch"] == 2
    with open(next(tmp_path.glob("csv/version_0/metrics.csv"))) as f:
        eval_steps = [r["step"] for r in csv.DictReader(f) if r.get("eval_reward")]
    assert eval_steps == ["16", "32"]  # evaluation (after each whole pass) on the optimizer-step axis too


def test_ppo_never_exceeds_max_steps_and_the_rich_bar_counts_steps(tmp_path: Path) -> None:
    config = PPOConfig(num_ppo_epochs=2, num_mini_batches=2, response_length=6, learning_rate=1e-3)
    module = PPOModule(build_model("qwen2", "tiny", seed=0), config)
    with pytest.warns(UserWarning, match="max_steps=2 is not a multiple of the 4 optimizer steps"):
        trainer = fit(tmp_path, module, 2, [RichProgressBar(leave=True)])
    assert trainer.global_step == 2
    (row,) = csv_rows(tmp_path)
    assert row["step"] == "2" and float(row["learning_rate"]) == pytest.approx(1e-3 / 2)  # never a 0.0 step
    bar = trainer.progress_bar_callback
    assert type(bar) is OptimizerStepRichProgressBar
    task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
    assert (task.completed, task.total) == (2, 2)
    assert task.description.strip() == "Epoch 0"  # not Lightning's "Epoch 0/-2" under max_steps


def test_a_users_own_progress_bar_is_left_alone(tmp_path: Path) -> None:
    class MyBar(TQDMProgressBar):
        pass

    module = GRPOModule(build_model("qwen2", "tiny", seed=0), GRPOConfig(num_generations=2, max_completion_length=4))
    trainer = fit(tmp_path, module, 1, [MyBar()])
    assert type(trainer.progress_bar_callback) is MyBar and trainer.global_step == 1
