"""`PPOModule`: PPO with a value head (or value model), GAE and a KL-shaped reward, TRL's options.

The per-token reward is ``-kl_coef * KL(policy || reference)`` at every completion token plus the
sequence's score (its summed reward functions) at the last one (Ziegler et al. 2019, arXiv
1909.08593); advantages come from GAE over a learned value (Schulman et al. 2016, arXiv
1506.02438) and are whitened; each rollout batch is trained on for ``num_ppo_epochs`` passes of
``num_mini_batches`` shuffled mini-batches with the clipped policy and value losses (Schulman et
al. 2017, arXiv 1707.06347). Names and defaults are ``trl.experimental.ppo.PPOConfig``'s, and the
logged metrics are TRL's PPO names (``objective/kl``, ``policy/clipfrac_avg``, ``loss/value_avg``, ...).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_tlt.rl.advantages import gae, masked_mean, masked_whiten, ppo_token_rewards
from lightning_tlt.rl.attention import training_attention
from lightning_tlt.rl.batch import RolloutBatch, RolloutSettings
from lightning_tlt.rl.common import (
    PolicySpec,
    RLModule,
    check_completion_length,
    completion_forward,
    frozen_copy,
)
from lightning_tlt.rl.config import PPOConfig
from lightning_tlt.rl.losses import ppo_policy_loss, ppo_value_loss


def as_ppo_config(config: Any) -> PPOConfig:
    """A `PPOConfig` from one, ``None`` (TRL's defaults), a dict or any object with TRL's attribute names."""
    if config is None:
        return PPOConfig()
    if isinstance(config, PPOConfig):
        return config
    if isinstance(config, dict):
        return PPOConfig(**config)
    import dataclasses

    names = {f.name for f in dataclasses.fields(PPOConfig)}
    values = {n: getattr(config, n) for n in names if hasattr(config, n)}
    if not values:
        raise ValueError(f"config must be a PPOConfig, a dict, a trl PPOConfig or None, got {type(config)!r}")
    if "lr_scheduler_type" in values:
        values["lr_scheduler_type"] = getattr(values["lr_scheduler_type"], "value", values["lr_scheduler_type"])
    return PPOConfig(**values)


class PPOModule(RLModule):
    """PPO over a Hugging Face causal LM.

    Args:
        policy: the model to train, or a `PolicySpec`.
        config: a `PPOConfig` (TRL's names), a dict, or ``None`` for TRL's defaults.
        value_model: an HF model whose final hidden states feed the value head; ``None`` puts the
            value head on the policy's own final hidden states (shared trunk).
        ref_model: the reference of the KL penalty; ``None`` copies the initial policy (when ``kl_coef > 0``).
        seed: seeds the mini-batch shuffling (its generator is saved in checkpoints).
    """

    config: PPOConfig

    def __init__(
        self,
        policy: nn.Module | PolicySpec,
        config: PPOConfig | None = None,
        *,
        value_model: nn.Module | None = None,
        ref_model: nn.Module | None = None,
        seed: int = 0,
    ) -> None:
        cfg = as_ppo_config(config)
        check_completion_length(policy, cfg.response_length, "response_length")
        super().__init__(policy)
        self.config = cfg
        self.value_model = value_model
        trunk: Any = value_model if value_model is not None else self.policy  # an HF model (has .config)
        hidden = int(trunk.config.hidden_size)
        dtype = next(trunk.parameters()).dtype
        self.value_head = nn.Linear(hidden, 1, dtype=dtype)
        nn.init.zeros_(self.value_head.weight)  # values start at 0: the first advantages are the returns
        nn.init.zeros_(self.value_head.bias)
        self.ref_model: nn.Module | None = None
        if self.config.kl_coef > 0:
            self.ref_model = frozen_copy(ref_model if ref_model is not None else self.policy)
        self.seed = seed
        self._shuffle = torch.Generator().manual_seed(seed)

    def rollout_settings(self) -> RolloutSettings:
        return RolloutSettings(None, self.config.sampling, "none", None)

    @override
    def optimizer_steps_per_batch(self) -> int:
        return self.config.num_ppo_epochs * self.config.num_mini_batches

    @override
    def trainable_parameters(self) -> list[nn.Parameter]:
        params = [p for p in self.policy.parameters() if p.requires_grad] + list(self.value_head.parameters())
        if self.value_model is not None:
            params += [p for p in self.value_model.parameters() if p.requires_grad]
        return params

    @override
    def models_to_shard(self) -> list[nn.Module]:
        extra = [self.value_head] + ([self.value_model] if self.value_model is not None else [])
        return super().models_to_shard() + extra

    @override
    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.value_model is not None:
            self.value_model.train()

    def forward_with_values(self, batch: RolloutBatch, harvest: bool = False) -> tuple[Tensor, Tensor, Tensor]:
        """``(logps, values, entropies)``, each ``(B, C)``: the value of token t is read before it (TRL's slice)."""
        c = batch.completion_ids.shape[1]
        shared = self.value_model is None
        fwd = completion_forward(
            self.policy, batch, temperature=self.config.temperature, output_hidden_states=shared or harvest,
            cudnn_attention=self.config.cudnn_attention, logprob_chunk_tokens=self.config.logprob_chunk_tokens,
        )
        if harvest:
            self._store_features(batch, fwd.hidden_states)
        if shared:
            hidden = fwd.hidden_states
        else:
            assert self.value_model is not None
            with training_attention(self.config.cudnn_attention):
                hidden = self.value_model(
                    input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids,
                    output_hidden_states=True, use_cache=False, logits_to_keep=1,
                ).hidden_states[-1]
        assert hidden is not None
        values = self.value_head(hidden[:, -(c + 1) : -1, :]).squeeze(-1).float()  # (B, C)
        return fwd.logps, values, fwd.entropies

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        cfg = self.config
        mask = batch.completion_mask.bool()
        scorable = ~torch.isnan(batch.rewards)  # a completion no reward function could score trains nothing
        mask = mask & scorable.unsqueeze(1)
        with torch.no_grad():
            old_logps, old_values, entropies = self.forward_with_values(batch, harvest=self.policy_features_requested)
            ref_logps = old_logps
            if self.ref_model is not None:
                ref_logps = completion_forward(
                    self.ref_model, batch, temperature=cfg.temperature, cudnn_attention=cfg.cudnn_attention,
                    logprob_chunk_tokens=cfg.logprob_chunk_tokens,
                ).logps
            scores = torch.nan_to_num(batch.rewards.float(), nan=0.0)
            if cfg.missing_eos_penalty is not None:
                scores = scores - cfg.missing_eos_penalty * batch.is_truncated.float()
            rewards, kl_stats = ppo_token_rewards(
                scores, old_logps, ref_logps, mask, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator,
                whiten_rewards=cfg.whiten_rewards,
            )
            advantages, returns = gae(rewards, old_values, mask, gamma=cfg.gamma, lam=cfg.lam)
            if mask.sum() > 1:
                advantages = masked_whiten(advantages, mask).masked_fill(~mask, 0.0)

        n = len(batch)
        totals: dict[str, Tensor] = {}
        count = 0
        budget = self.optimizer_steps_left(self.optimizer_steps_per_batch())  # never past max_steps
        for _ in range(cfg.num_ppo_epochs):
            if count == budget:
                break
            order = torch.randperm(n, generator=self._shuffle).to(batch.completion_ids.device)
            for rows in order.chunk(cfg.num_mini_batches):
                if count == budget:
                    break
                sub = batch.select(rows)
                logps, values, ent = self.forward_with_values(sub)
                m = mask[rows]
                pg = ppo_policy_loss(logps, old_logps[rows], advantages[rows], m, cliprange=cfg.cliprange)
                vf = ppo_value_loss(values, old_values[rows], returns[rows], m, cliprange_value=cfg.cliprange_value)
                self._step(pg.loss + cfg.vf_coef * vf.loss)
                stats = {**pg.stats, **vf.stats, "policy/entropy": masked_mean(ent, m)}
                stats["val/ratio"] = masked_mean(torch.exp(logps.detach() - old_logps[rows]), m)
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                count += 1

        kl_seq = kl_stats["kl"].sum(1)  # (B,)
        metrics: dict[str, float | Tensor] = dict(batch.metrics)
        metrics.update({
            "objective/kl": kl_seq.mean(),
            "objective/entropy": (entropies * mask).sum(1).mean(),
            "objective/non_score_reward": kl_stats["non_score_reward"].mean(),
            "objective/rlhf_reward": (scores + kl_stats["non_score_reward"]).mean(),
            "objective/scores": scores.mean(),
            "policy/approxkl_avg": totals["policy/approxkl"] / count,
            "policy/clipfrac_avg": totals["policy/clipfrac"] / count,
            "loss/policy_avg": totals["loss/policy"] / count,
            "loss/value_avg": totals["loss/value"] / count,
            "val/clipfrac_avg": totals["val/clipfrac"] / count,
            "policy/entropy_avg": totals["policy/entropy"] / count,
            "val/ratio": totals["val/ratio"] / count,
            "learning_rate": self._learning_rate(),
            **self._step_metrics(),
        })
        loss = (totals["loss/policy"] + cfg.vf_coef * totals["loss/value"]) / count
        metrics["loss"] = loss
        self._log_metrics(metrics, n)
        return loss

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ppo_shuffle_generator"] = self._shuffle.get_state()
        super().on_save_checkpoint(checkpoint)  # last: it checksums every tensor, this generator's state too

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        if "ppo_shuffle_generator" in checkpoint:
            self._shuffle.set_state(checkpoint["ppo_shuffle_generator"])
