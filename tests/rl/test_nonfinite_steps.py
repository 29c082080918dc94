"""A gradient that is not finite never reaches the policy: the step is skipped, counted, warned about,
and too many in a row stop training with a clear error (GRPO and PPO, in a real Trainer)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.common import RLModule, gradient_norm
from lightning_tlt.rl.config import GRPOConfig, PPOConfig
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.rl.ppo import PPOModule


class PoisonGradients(Callback):
    """Makes the first decoder layer's gradient NaN in the given rollout batches (a tensor hook on
    the backward), and keeps each batch's weights before and after it and the logged metrics."""

    def __init__(self, batches: set[int]) -> None:
        self.batches = batches
        self.handle: Any = None
        self.before: dict[int, dict[str, torch.Tensor]] = {}
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        self.metrics: dict[int, dict[str, float]] = {}

    @staticmethod
    def weights(module: pl.LightningModule) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in module.policy.named_parameters()}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.before[batch_idx] = self.weights(pl_module)
        if batch_idx in self.batches:
            param = next(p for n, p in pl_module.policy.named_parameters() if "layers.0." in n)
            self.handle = param.register_hook(lambda g: torch.full_like(g, math.nan))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        batch_idx = args[-1]
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self.after[batch_idx] = self.weights(pl_module)
        self.metrics[batch_idx] = {k: float(v) for k, v in trainer.callback_metrics.items()}


def distinct_characters(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float]:
    """A reward that differs between the samples of a random policy (so its gradient is not zero)."""
    return [float(len(set(str(c)))) for c in completions]


def fit(module: pl.LightningModule, steps: int, poison: PoisonGradients, tmp_path: Path) -> pl.Trainer:
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[poison],
        default_root_dir=tmp_path,
    )
    data = RolloutDataModule("arithmetic", [distinct_characters], prompts_per_step=2, task_size=16, seed=0)
    trainer.fit(module, datamodule=data)
    return trainer


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_a_nonfinite_gradient_is_skipped_counted_and_the_weights_stay(algorithm: str, tmp_path: Path) -> None:
    policy = build_model("qwen2", "tiny", seed=0)
    module: RLModule
    if algorithm == "grpo":
        module = GRPOModule(policy, GRPOConfig(num_generations=2, max_completion_length=6, learning_rate=1e-3))
    else:
        module = PPOModule(policy, PPOConfig(response_length=6, learning_rate=1e-3, num_ppo_epochs=1,
                                             num_mini_batches=1, max_grad_norm=1.0))  # fmt: skip
    poison = PoisonGradients({1})
    with pytest.warns(UserWarning, match=r"gradient norm is nan \(not finite\); the step was skipped and the weights "
                                         r"are unchanged \(1 in a row, 1 in all\)") as warned:  # fmt: skip
        trainer = fit(module, 3, poison, tmp_path)
    if algorithm == "grpo":  # the loss was finite: the gradient went wrong in the backward (here, the hook)
        assert any(str(w.message).endswith("; micro-batch losses not finite: [] of 1") for w in warned)
    assert trainer.global_step == 3  # the skipped step still counts: the schedule and max_steps stay aligned
    assert same(poison.before[1], poison.after[1])  # one optimizer step a batch: the poisoned one changes nothing
    # the healthy steps apply their (finite, nonzero) gradients
    assert all(0 < poison.metrics[i]["grad_norm"] < math.inf for i in (0, 2))
    assert not same(poison.before[0], poison.after[0]) and not same(poison.before[2], poison.after[2])
    assert all(torch.isfinite(v).all() for v in poison.after[2].values())
    assert [poison.metrics[i]["train/nonfinite_grad_steps"] for i in range(3)] == [0.0, 1.0, 1.0]
    assert math.isnan(poison.metrics[1]["grad_norm"])


def test_too_many_nonfinite_steps_in_a_row_stop_training_with_a_clear_error(tmp_path: Path) -> None:
    config = GRPOConfig(num_generations=2, max_completion_length=6, max_consecutive_nonfinite_steps=1)
    module = GRPOModule(build_model("qwen2", "tiny", seed=0), config)
    with pytest.warns(UserWarning, match="1 in a row"), pytest.raises(
        FloatingPointError, match=r"optimizer step 1: .*2 in a row, 2 in all\); micro-batch losses not finite: \[\] of 1: "
                                  r"more than max_consecutive_nonfinite_steps=1"
    ):
        fit(module, 4, PoisonGradients({0, 1, 2}), tmp_path)


def test_the_logged_gradient_norm_is_the_norm_before_clipping() -> None:
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    assert gradient_norm(optimizer) is None  # no gradient yet
    layer.weight.grad = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.bfloat16).float()
    layer.bias.grad = torch.tensor([4.0, 0.0])
    norm = gradient_norm(optimizer)
    assert norm is not None and norm.dtype == torch.float32 and float(norm) == 5.0  # sqrt(3^2 + 4^2)


def test_bad_limit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_consecutive_nonfinite_steps must be >= 0 \(0 stops at the first\), got -1"):
        GRPOConfig(max_consecutive_nonfinite_steps=-1)
