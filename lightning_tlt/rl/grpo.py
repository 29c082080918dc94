"""`GRPOModule`: Group Relative Policy Optimization as a LightningModule, with TRL's options.

Each training batch is a `RolloutBatch` from `RolloutDataModule` (completions of the current
policy with group-relative advantages). The module runs ``num_iterations`` passes over it, one
optimizer step each (manual optimization, GRPO's mu; Shao et al. 2024, arXiv 2402.03300, Alg. 1),
with the clipped objective of `lightning_tlt.rl.losses.grpo_loss` and the metric names of TRL's
``GRPOTrainer``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn
from typing_extensions import override

from lightning_tlt.rl.advantages import masked_mean
from lightning_tlt.rl.batch import RolloutBatch, RolloutSettings
from lightning_tlt.rl.common import (
    PolicyFeatures,
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
        self,
        batch: RolloutBatch,
        old_logps: Tensor | None,
        ref_logps: Tensor | None,
        harvest: bool = False,
        *,
        num_sequences: int | None = None,
        num_items: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """One pass: forward, GRPO loss. Returns the loss, its stats and the detached log-probs.

        On a micro-batch, ``num_sequences`` and ``num_items`` are the whole batch's (rows, and
        tokens that count), so the micro-batches' losses add up to the whole batch's.
        """
        cfg = self.config
        fwd = completion_forward(self.policy, batch, temperature=cfg.temperature, output_hidden_states=harvest,
                                 cudnn_attention=cfg.cudnn_attention, logprob_chunk_tokens=cfg.logprob_chunk_tokens)
        if harvest:
            self._store_features(batch, fwd.hidden_states)
        mask = self.loss_mask(batch)
        total = mask.sum() if num_items is None else num_items
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
            num_sequences=num_sequences,
            num_items=total,
        )
        loss = out.loss
        if cfg.loss_type == "bnpo" and num_items is not None:  # a token mean: weigh this chunk's by its tokens
            loss = loss * mask.sum() / num_items.clamp(min=1.0)
        out.stats["entropy"] = masked_mean(fwd.entropies, mask)
        return loss, out.stats, fwd.logps.detach()

    def micro_batches(self, batch: RolloutBatch) -> list[tuple[Tensor, RolloutBatch]]:
        """``(rows, micro-batch)`` pairs: ``batch``'s rows by completion length, cut into
        `GRPOConfig.micro_batch_size` rows or packed up to `GRPOConfig.micro_batch_tokens` padded
        tokens, each trimmed to its own longest prompt and completion (so the long tail is padded
        with itself only). The whole batch when neither is set or it fits."""
        size, budget = self.config.micro_batch_size, self.config.micro_batch_tokens
        order = torch.argsort(batch.completion_mask.sum(1), stable=True)
        if budget is None:
            groups = list(order.split(size)) if size is not None and size < len(batch) else [order]
        else:
            runs = pack_rows(
                batch.prompt_mask.sum(1)[order].tolist(), batch.completion_mask.sum(1)[order].tolist(), budget, size
            )
            groups = [order[run] for run in runs]
        if len(groups) == 1:
            return [(torch.arange(len(batch)), batch)]
        return [(rows, trim_padding(batch.select(rows))) for rows in groups]

    @override
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> Tensor:
        pairs = self.micro_batches(batch)
        chunks = [chunk for _, chunk in pairs]
        whole = len(chunks) == 1
        num_items = None if whole else self.loss_mask(batch).sum()
        ref_logps: list[Tensor | None] = [None] * len(chunks)
        if self.ref_model is not None:
            with torch.no_grad():
                ref_logps = [
                    completion_forward(self.ref_model, c, temperature=self.config.temperature,
                                       cudnn_attention=self.config.cudnn_attention,
                                       logprob_chunk_tokens=self.config.logprob_chunk_tokens).logps
                    for c in chunks
                ]
        old_logps: list[Tensor | None] = [None] * len(chunks)  # the first pass is on-policy
        totals: dict[str, Tensor] = {}
        losses = []
        passes = self.optimizer_steps_left(self.config.num_iterations)  # never past max_steps
        for it in range(passes):
            harvest = it == 0 and self.policy_features_requested
            hidden: list[Tensor] = []
            self._optimizer().zero_grad(set_to_none=True)
            pass_loss = torch.zeros((), device=batch.completion_ids.device)
            for k, chunk in enumerate(chunks):
                loss, stats, logps = self.compute_loss(
                    chunk, old_logps[k], ref_logps[k], harvest=harvest,
                    num_sequences=None if whole else len(batch), num_items=num_items,
                )
                if harvest and not whole and self._policy_features is not None:
                    hidden.append(self._policy_features.hidden_states)
                if old_logps[k] is None:
                    old_logps[k] = logps
                self.manual_backward(loss)
                pass_loss = pass_loss + loss.detach()
                self._micro_losses.append(loss.detach().float())
                weight = 1.0 if whole else self.loss_mask(chunk).sum() / num_items.clamp(min=1.0)  # type: ignore[union-attr]
                for name, v in stats.items():  # token means of the chunks, weighed by their tokens
                    totals[name] = totals.get(name, 0.0) + v * weight / passes
            self._finish_step()
            losses.append(pass_loss)
            if hidden:
                self._policy_features = join_features(batch, pairs, hidden, int(self.global_step))
        mean_loss = torch.stack(losses).mean()
        metrics: dict[str, float | Tensor] = dict(batch.metrics)
        metrics.update(totals)
        metrics["loss"] = mean_loss
        metrics["learning_rate"] = self._learning_rate()
        metrics.update(self._step_metrics())
        self._log_metrics(metrics, len(batch))
        return mean_loss


def pack_rows(prompt_lens: list[int], completion_lens: list[int], budget: int, max_rows: int | None) -> list[slice]:
    """Consecutive runs of rows (in the given order) whose padded size, rows x (longest prompt +
    longest completion), stays within ``budget`` tokens and ``max_rows`` rows; a row larger than
    ``budget`` is a run of its own."""
    runs: list[slice] = []
    start, prompt, completion = 0, 0, 0
    for i, (p, c) in enumerate(zip(prompt_lens, completion_lens)):
        p, c = max(prompt, p), max(completion, c, 1)
        rows = i - start + 1
        if rows > 1 and (rows * (max(p, 1) + c) > budget or (max_rows is not None and rows > max_rows)):
            runs.append(slice(start, i))
            start, p, c = i, prompt_lens[i], max(completion_lens[i], 1)
        prompt, completion = p, c
    runs.append(slice(start, len(prompt_lens)))
    return runs


def trim_padding(batch: RolloutBatch) -> RolloutBatch:
    """``batch`` without the prompt columns that are padding in every row (left) and the completion
    columns past its longest completion (right)."""
    prompt_width = max(1, int(batch.prompt_mask.sum(1).max()))
    completion_width = max(1, int(batch.completion_mask.sum(1).max()))
    return dataclasses.replace(
        batch,
        prompt_ids=batch.prompt_ids[:, -prompt_width:],
        prompt_mask=batch.prompt_mask[:, -prompt_width:],
        completion_ids=batch.completion_ids[:, :completion_width],
        completion_mask=batch.completion_mask[:, :completion_width],
        sampling_logprobs=batch.sampling_logprobs[:, :completion_width],
    )


def join_features(
    batch: RolloutBatch, pairs: list[tuple[Tensor, RolloutBatch]], hidden: list[Tensor], step: int
) -> PolicyFeatures:
    """The final hidden states of trimmed micro-batches (`trim_padding`), put back in ``batch``'s layout."""
    p = batch.prompt_ids.shape[1]
    out = hidden[0].new_zeros(len(batch), batch.input_ids.shape[1], hidden[0].shape[-1])  # (B, P + C, H)
    for (rows, chunk), h in zip(pairs, hidden):
        pp, cc = chunk.prompt_ids.shape[1], chunk.completion_ids.shape[1]
        out[rows.to(out.device), p - pp : p + cc] = h
    completion_mask = torch.zeros_like(batch.attention_mask)
    completion_mask[:, p:] = batch.completion_mask
    return PolicyFeatures(
        hidden_states=out, input_ids=batch.input_ids, attention_mask=batch.attention_mask,
        completion_mask=completion_mask, step=step,
    )
