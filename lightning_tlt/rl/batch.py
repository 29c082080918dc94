"""The contract between `RolloutDataModule` and the RL modules, as typed objects.

- `RolloutSettings`: what an RL module's config says about rollouts (num_generations, sampling,
  reward scaling and weights), which the datamodule inherits where the user left an option unset
  (`lightning_tlt.rl.common.RLModule.rollout_settings`);
- `RolloutBatch`: one RL step's scored completions, padded into tensors (TRL's layout), which is
  what ``training_step`` receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_tlt.core.types import SamplingConfig

__all__ = [
    "RolloutSettings",
    "RolloutSettingsSource",
    "RolloutBatch",
    "pad_left",
    "pad_right",
]


@dataclass
class RolloutSettings:
    """What the RL module's config says about rollouts (the datamodule inherits unset options from it)."""

    num_generations: int | None
    """Completions per prompt (TRL's ``num_generations``); ``None``: the datamodule's own choice."""
    sampling: SamplingConfig
    """Temperature, top-k, top-p and the completion length."""
    scale_rewards: str
    """TRL's ``scale_rewards`` ("group", "batch" or "none")."""
    reward_weights: list[float] | None = None
    """Weight of each reward function; ``None``: 1 each."""


@runtime_checkable
class RolloutSettingsSource(Protocol):
    """What a LightningModule implements to hand its rollout options to `RolloutDataModule` (the RL
    modules do: `lightning_tlt.rl.grpo.GRPOModule`, `lightning_tlt.rl.ppo.PPOModule`)."""

    def rollout_settings(self) -> RolloutSettings: ...


@dataclass
class RolloutBatch:
    """Scored completions of one RL step, as TRL's ``_generate_and_score_completions`` lays them out.

    ``B = prompts_per_step * num_generations`` rows; the ``num_generations`` completions of a prompt
    are consecutive rows. Prompts are left-padded and completions right-padded, so that
    ``cat([prompt_ids, completion_ids], 1)`` puts every completion's first token in one column.
    """

    prompt_ids: Tensor
    """``(B, P)`` long, left-padded with the pad token."""
    prompt_mask: Tensor
    """``(B, P)`` long, 1 on prompt tokens."""
    completion_ids: Tensor
    """``(B, C)`` long, right-padded; the stop token is included when one ended the completion."""
    completion_mask: Tensor
    """``(B, C)`` long, 1 on completion tokens."""
    sampling_logprobs: Tensor
    """``(B, C)`` float32, each token's log-probability under the distribution it was sampled from."""
    rewards: Tensor
    """``(B,)`` float32, weighted sum of the reward functions; NaN where none could score."""
    rewards_per_func: Tensor
    """``(B, F)`` float32, one column per reward function; NaN where a function returned None."""
    advantages: Tensor
    """``(B,)`` float32 group-relative advantages (``scale_rewards`` applied)."""
    is_truncated: Tensor
    """``(B,)`` bool, true where ``max_new_tokens`` ended the completion (no stop token)."""
    num_generations: int = 1
    """Completions per prompt (G)."""
    step: int = 0
    """The RL step (rollout index) this batch was generated at."""
    prompts: list[Any] = field(default_factory=list)
    """The ``B`` prompts as given to the reward functions (each repeated G times)."""
    completions: list[Any] = field(default_factory=list)
    """The ``B`` decoded completions (strings, or assistant messages for conversational prompts)."""
    reward_func_names: list[str] = field(default_factory=list)
    """Names of the reward functions, in the column order of ``rewards_per_func``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Rollout metrics under TRL's names (``reward``, ``completions/mean_length``, ...) and the kit's."""
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    """Per-completion columns reward functions added with TRL's ``log_extra`` hook."""

    def __post_init__(self) -> None:
        b = self.completion_ids.shape[0]
        shapes = {
            "prompt_ids": self.prompt_ids.shape[0],
            "prompt_mask": self.prompt_mask.shape[0],
            "completion_mask": self.completion_mask.shape[0],
            "sampling_logprobs": self.sampling_logprobs.shape[0],
            "rewards": self.rewards.shape[0],
            "advantages": self.advantages.shape[0],
            "is_truncated": self.is_truncated.shape[0],
        }
        bad = {k: v for k, v in shapes.items() if v != b}
        if bad:
            raise ValueError(f"every RolloutBatch field needs {b} rows (completion_ids), got {bad}")
        if self.num_generations < 1 or b % self.num_generations:
            raise ValueError(f"num_generations must be >= 1 and divide the {b} rows, got {self.num_generations!r}")

    def __len__(self) -> int:
        return int(self.completion_ids.shape[0])

    @property
    def input_ids(self) -> Tensor:
        """``(B, P + C)`` prompt and completion tokens."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """``(B, P + C)`` 1 on real tokens."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def position_ids(self) -> Tensor:
        """``(B, P + C)`` each token's position in its own sequence (left padding skipped), as the engine saw it."""
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    @property
    def num_items(self) -> Tensor:
        """Completion tokens in the batch (TRL's ``num_items_in_batch`` on one process)."""
        return self.completion_mask.sum()

    def select(self, rows: Tensor) -> RolloutBatch:
        """The sub-batch of the given row indices (for PPO's mini-batches)."""
        idx = rows.tolist()
        return RolloutBatch(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            completion_ids=self.completion_ids[rows],
            completion_mask=self.completion_mask[rows],
            sampling_logprobs=self.sampling_logprobs[rows],
            rewards=self.rewards[rows],
            rewards_per_func=self.rewards_per_func[rows],
            advantages=self.advantages[rows],
            is_truncated=self.is_truncated[rows],
            num_generations=1,
            step=self.step,
            prompts=[self.prompts[i] for i in idx] if self.prompts else [],
            completions=[self.completions[i] for i in idx] if self.completions else [],
            reward_func_names=list(self.reward_func_names),
            metrics=dict(self.metrics),
            extra_columns={k: [v[i] for i in idx] for k, v in self.extra_columns.items()},
        )


def pad_left(rows: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """Left-pad token rows into ``(ids, mask)``, each ``(N, max_len)`` long."""
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            mask[i, width - len(r) :] = 1
    return ids, mask


def pad_right(rows: list[list[Any]], pad: float | int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Right-pad rows into ``(values, mask)``, each ``(N, max_len)`` (mask long)."""
    width = max((len(r) for r in rows), default=0)
    values = torch.full((len(rows), width), pad, dtype=dtype)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            values[i, : len(r)] = torch.tensor(r, dtype=dtype)
            mask[i, : len(r)] = 1
    return values, mask
