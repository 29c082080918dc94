"""`GRPOModule`: Group Relative Policy Optimization as a LightningModule, with TRL's options.

Each training batch is a `RolloutBatch` from `RolloutDataModule` (completions of the current
policy with group-relative advantages). The module runs ``num_iterations`` passes over it, one
optimizer step each (manual optimization, GRPO's mu; Shao et al. 2024, arXiv 2402.03300, Alg. 1),
with the clipped objective of `lightning_tlt.rl.losses.grpo_loss` and the metric names of TRL's
``GRPOTrainer``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_tlt.rl.advantages import masked_mean
from lightning_tlt.rl.batch import RolloutBatch, RolloutSettings
from lightning_tlt.rl.common import (
    PolicySpec,
    RLModule,
    check_completion_length,
    completion_forward,
    frozen_copy,
)
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.losses import grpo_loss


def as_grpo_config(config: Any) -> GRPOConfig:
    """A `GRPOConfig` from one, from ``None`` (TRL's defaults), a dict, or a ``trl.GRPOConfig``."""
    if config is None:
        return GRPOConfig()
    if isinstance(config, GRPOConfig):
        return config
    if isinstance(config, dict):
        return GRPOConfig(**config)
    if type(config).__name__ == "GRPOConfig" and type(config).__module__.startswith("trl"):
        return GRPOConfig.from_trl(config)
    raise ValueError(
        f"config must be a lightning_tlt GRPOConfig, a trl.GRPOConfig, a dict or None, got {type(config)!r}"
    )


class GRPOModule(RLModule):
    """GRPO over a Hugging Face causal LM.

    Args:
        policy: the model to train (an HF causal LM), or a `PolicySpec` that builds it.
        config: a `GRPOConfig`, a ``trl.GRPOConfig`` (converted by name) or ``None`` for TRL's defaults.
        ref_model: the reference of the KL term; ``None`` copies the initial policy, only when ``beta > 0``.

    Example::

        module = GRPOModule(build_model("qwen2", "tiny"), GRPOConfig(num_generations=4, learning_rate=1e-5))
        data = RolloutDataModule("arithmetic", prompts_per_step=8)
        Trainer(max_steps=100).fit(module, datamodule=data)
    """

    config: GRPOConfig

    def __init__(
        self,
        policy: nn.Module | PolicySpec,
        config: GRPOConfig | None = None,
        *,
        ref_model: nn.Module | None = None,
    ) -> None:
        cfg = as_grpo_config(config)
        check_completion_length(policy, cfg.max_completion_length, "max_completion_length")
        super().__init__(policy)
        self.config = cfg
        self.ref_model: nn.Module | None = None
        if self.config.beta > 0:
            self.ref_model = frozen_copy(ref_model if ref_model is not None else self.policy)

    @classmethod
    def from_trl(cls, policy: nn.Module | PolicySpec, trl_config: Any, **kwargs: Any) -> GRPOModule:
        """Build from a ``trl.GRPOConfig`` (its names are this module's names)."""
        return cls(policy, GRPOConfig.from_trl(trl_config), **kwargs)

    def rollout_settings(self) -> RolloutSettings:
        """What the `RolloutDataModule` takes from this config unless told otherwise."""
        cfg = self.config
        return RolloutSettings(cfg.num_generations, cfg.sampling, cfg.scale_rewards, cfg.reward_weights)

    @override
    def optimizer_steps_per_batch(self) -> int:
        return self.config.num_iterations

    def loss_mask(self, batch: RolloutBatch) -> Tensor:
        """``(B, C)`` tokens that count: completion tokens, less truncated completions if so configured."""
        mask = batch.completion_mask.float()
        if self.config.mask_truncated_completions:
            mask = mask * (~batch.is_truncated).float().unsqueeze(1)
        return mask

    def compute_loss(
        self, batch: RolloutBatch, old_logps: Tensor | None, ref_logps: Tensor | None, harvest: bool = False
    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """One pass: forward, GRPO loss. Returns the loss, its stats and the detached log-probs."""
        cfg = self.config
        fwd = completion_forward(self.policy, batch, temperature=cfg.temperature, output_hidden_states=harvest)
        if harvest:
            self._store_features(batch, fwd.hidden_states)
        mask = self.loss_mask(batch)
        out = grpo_loss(
            fwd.logps,
            fwd.logps.detach() if old_logps is None else old_logps,
            batch.advantages,
            mask,
            loss_type=cfg.loss_type,
            epsilon_low=cfg.epsilon_low,
            epsilon_high=cfg.effective_epsilon_high,
            importance_sampling_level=cfg.importance_sampling_level,
            beta=cfg.beta,
            ref_logps=ref_logps,
            use_bias_correction_kl=cfg.use_bias_correction_kl,
            max_completion_length=cfg.max_completion_length,
            num_items=mask.sum(),
        )
        out.stats["entropy"] = masked_mean(fwd.entropies, mask)
        return out.loss, out.stats, fwd.logps.detach()

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        ref_logps = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logps = completion_forward(self.ref_model, batch, temperature=self.config.temperature).logps
        old_logps: Tensor | None = None  # the first pass is on-policy: its own detached log-probs
        totals: dict[str, Tensor] = {}
        losses = []
        passes = self.optimizer_steps_left(self.config.num_iterations)  # never past max_steps
        for it in range(passes):
            harvest = it == 0 and self.policy_features_requested
            loss, stats, logps = self.compute_loss(batch, old_logps, ref_logps, harvest=harvest)
            if old_logps is None:
                old_logps = logps
            self._step(loss)
            losses.append(loss.detach())
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v / passes
        mean_loss = torch.stack(losses).mean()
        metrics: dict[str, float | Tensor] = dict(batch.metrics)
        metrics.update(totals)
        metrics["loss"] = mean_loss
        metrics["learning_rate"] = self._learning_rate()
        self._log_metrics(metrics, len(batch))
        return mean_loss
