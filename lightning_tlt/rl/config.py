"""Typed configurations of the RL modules, with TRL's names and defaults.

`GRPOConfig` mirrors the options of ``trl.GRPOConfig`` that change what GRPO learns; `PPOConfig`
mirrors ``trl.experimental.ppo.PPOConfig``. A real ``trl.GRPOConfig`` converts with
`GRPOConfig.from_trl` (trl is imported lazily, only to recognise the object).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.rl.advantages import normalize_scale_rewards
from lightning_tlt.rl.logprobs import check_chunk_tokens
from lightning_tlt.rl.losses import LOSS_AGGREGATIONS

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k3"]
SchedulerType = Literal["linear", "constant"]

DEFAULT_LOGPROB_CHUNK_TOKENS = 4096
"""Default `OptimConfig.logprob_chunk_tokens`: 4,096 rows of Qwen2's 151,936 logits are 2.5 GB in float32."""



def validate_adamw(config: Any) -> None:
    """Check the AdamW fields every config here shares: ``learning_rate``, ``weight_decay``, betas."""
    if not config.learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {config.learning_rate!r}")
    if config.weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {config.weight_decay!r}")
    for name in ("adam_beta1", "adam_beta2"):
        if not 0.0 <= getattr(config, name) < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {getattr(config, name)!r}")


@dataclass
class OptimConfig:
    """Optimizer options shared by the RL modules (``transformers.TrainingArguments``' names and defaults)."""

    learning_rate: float = 1e-6
    """AdamW learning rate (TRL GRPOConfig default 1e-6)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Gradient norm clipping per optimizer step; 0 disables it."""
    lr_scheduler_type: SchedulerType = "linear"
    """"linear" decays to 0 over the Trainer's ``max_steps`` (TRL's default) or "constant"."""
    warmup_steps: int = 0
    """Linear warm-up steps of the learning rate."""
    max_consecutive_nonfinite_steps: int = 3
    """Optimizer steps in a row whose gradient is not finite that are skipped (weights unchanged,
    counted in ``train/nonfinite_grad_steps``) before training stops with an error; 0 stops at the first."""
    cudnn_attention: bool = False
    """Let the training forward use cuDNN's SDPA kernels. Off by default: since torch 2.11 their
    backward returns NaN query gradients on H100/H200 when a mask is passed (every padded batch),
    the length is 64 past a multiple of 128 and a row's attention logits are all very negative
    (pytorch/pytorch#196678, met through Qwen2.5-0.5B's attention sinks; it is what TRL's DPO hit).
    The 0.5 B e2e run on the H200 had one such update in 40; FlashAttention, memory-efficient
    attention and the math kernel remain."""
    logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS
    """The kit's: tokens per chunk when the training forward applies the LM head itself
    (`lightning_tlt.rl.logprobs.chunked_token_logprobs`), so that no more than this many rows of
    ``(tokens, vocabulary)`` logits exist at once, forward or backward, instead of about four float32
    copies of the whole micro-batch's. Used for Qwen2/Qwen3/Llama/Mistral-style models whose logits are
    the output embedding of the last hidden state; other models take the full path. 0: always the full path."""

    gradient_checkpointing: bool = False
    """Activation checkpointing of the trained models' decoder layers (``transformers.TrainingArguments``'
    name and default; ``trl.GRPOConfig`` defaults it to True, and `GRPOConfig.from_trl` carries its value):
    the training forward keeps one hidden state per layer and the backward runs each layer again, for
    about a third more training compute (`lightning_tlt.rl.fsdp.checkpoint_layers`). Off here by default
    because ``micro_batch_tokens`` already bounds the activations of a long-tail batch; on for large
    policies and long micro-batches (``configs/grpo_gpu_0.5b_fsdp.yaml``). Rollouts are untouched, and the
    loss and gradients are the same as without (tested)."""

    def _validate_optim(self) -> None:
        validate_adamw(self)
        if not self.adam_epsilon > 0:
            raise ValueError(f"adam_epsilon must be > 0, got {self.adam_epsilon!r}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 disables clipping), got {self.max_grad_norm!r}")
        if self.lr_scheduler_type not in ("linear", "constant"):
            raise ValueError(f"lr_scheduler_type must be 'linear' or 'constant', got {self.lr_scheduler_type!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        check_chunk_tokens(self.logprob_chunk_tokens, "logprob_chunk_tokens", off_allowed=True)
        if self.max_consecutive_nonfinite_steps < 0:
            raise ValueError(
                f"max_consecutive_nonfinite_steps must be >= 0 (0 stops at the first), "
                f"got {self.max_consecutive_nonfinite_steps!r}"
            )


@dataclass
class GRPOConfig(OptimConfig):
    """GRPO options; every name and default is ``trl.GRPOConfig``'s (TRL 1.16).

    GRPO: Shao et al. 2024 (arXiv 2402.03300), eq. 3; DAPO's token-level aggregation and
    asymmetric clipping: Yu et al. 2025 (arXiv 2503.14476), eq. 8; Dr. GRPO: Liu et al. 2025
    (arXiv 2503.20783); GSPO's sequence-level ratio: Zheng et al. 2025 (arXiv 2507.18071).
    """

    num_generations: int = 8
    """Completions sampled per prompt (the group size G); at least 2, since advantages are relative."""
    max_completion_length: int = 512
    """Most tokens generated per completion; also the constant normaliser of ``loss_type="dr_grpo"``."""
    temperature: float = 1.0
    """Sampling temperature; the training forward divides the logits by it too, as TRL does."""
    top_p: float = 1.0
    """Nucleus sampling threshold, in (0, 1]."""
    top_k: int = 0
    """Top-k filter of sampling; 0 disables it."""
    beta: float = 0.0
    """Weight of the k3 KL penalty against a frozen reference model (loaded only when > 0)."""
    num_iterations: int = 1
    """Optimizer steps (passes) per rollout batch (GRPO's mu)."""
    epsilon: float = 0.2
    """Lower clipping range: ratios below ``1 - epsilon`` are clipped."""
    epsilon_high: float | None = None
    """Upper clipping range (DAPO's clip-higher); ``None`` means ``epsilon``."""
    importance_sampling_level: ImportanceSamplingLevel = "token"
    """"token": one ratio per token (GRPO); "sequence": the length-normalised sequence ratio (GSPO)."""
    scale_rewards: ScaleRewards = "group"
    """Divide the centred rewards by the group's std ("group"), the batch's std ("batch") or not ("none")."""
    loss_type: LossType = "dapo"
    """How per-token losses are aggregated; one of `lightning_tlt.rl.losses.LOSS_AGGREGATIONS`."""
    mask_truncated_completions: bool = False
    """Leave completions that hit ``max_completion_length`` out of the loss (DAPO's overlong filtering)."""
    use_bias_correction_kl: bool = True
    """Multiply the per-token KL by the importance ratio, as TRL does by default."""
    reward_weights: list[float] | None = None
    """Weight of each reward function in the summed reward; ``None`` weighs each by 1."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (the kit's; TRL splits with ``per_device_train_batch_size`` and
    ``gradient_accumulation_steps``): each pass accumulates the gradients of its micro-batches, each cut
    to its own longest completion, into one optimizer step with the loss of the whole batch. ``None``:
    the whole batch in one forward. Long completions at a large vocabulary need it (the logits of
    64 rows of 4,096 tokens at 151,936 entries are 80 GB in bf16)."""
    micro_batch_tokens: int | None = None
    """Most padded tokens per forward/backward (rows x (longest prompt + longest completion) of the
    micro-batch; the kit's, as verl's dynamic batch size ``ppo_max_token_len_per_gpu``): rows, sorted by
    completion length, are packed greedily up to it, and a row longer than it goes alone;
    ``micro_batch_size``, when also set, caps the rows. In a long-tail batch most rows are short: on
    the H200, 64 rows of the 0.5 B e2e batch in micro-batches of 4 rows made 16 forward/backward
    passes, 12 of them under 200 tokens a row, and the update spent more time launching kernels than
    running them (1.34 s of wall time for 0.74 s of GPU work). ``None``: rows only."""

    def __post_init__(self) -> None:
        self._validate_optim()
        self.scale_rewards = normalize_scale_rewards(self.scale_rewards)  # type: ignore[assignment]
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1 or None, got {self.micro_batch_size!r}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens < 1:
            raise ValueError(f"micro_batch_tokens must be >= 1 or None, got {self.micro_batch_tokens!r}")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations must be >= 2 (GRPO's advantages compare completions of one prompt), "
                f"got {self.num_generations!r}"
            )
        if self.max_completion_length < 1:
            raise ValueError(f"max_completion_length must be >= 1, got {self.max_completion_length!r}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0 (0 disables the KL term), got {self.beta!r}")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations!r}")
        if not 0.0 <= self.epsilon < 1.0:
            raise ValueError(f"epsilon must be in [0, 1), got {self.epsilon!r}")
        if self.epsilon_high is not None and self.epsilon_high < self.epsilon:
            raise ValueError(
                f"epsilon_high must be >= epsilon ({self.epsilon!r}) or None, got {self.epsilon_high!r}"
            )
        if self.importance_sampling_level not in ("token", "sequence"):
            raise ValueError(
                f"importance_sampling_level must be 'token' or 'sequence', got {self.importance_sampling_level!r}"
            )
        if self.loss_type not in LOSS_AGGREGATIONS:
            raise ValueError(f"loss_type must be one of {sorted(LOSS_AGGREGATIONS)}, got {self.loss_type!r}")
        if self.reward_weights is not None:
            self.reward_weights = [float(w) for w in self.reward_weights]
            if not all(math.isfinite(w) for w in self.reward_weights):
                raise ValueError(f"reward_weights must be finite numbers, got {self.reward_weights!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for training (logits are divided by it), got {self.temperature!r}")
        self.sampling  # noqa: B018  (top_p and top_k are checked by SamplingConfig)

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def sampling(self) -> SamplingConfig:
        """The `SamplingConfig` these options describe."""
        return SamplingConfig(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_completion_length,
        )

    @classmethod
    def from_trl(cls, trl_config: Any) -> GRPOConfig:
        """Convert a ``trl.GRPOConfig`` (or any object with its attribute names) to this config.

        Options this kit does not implement (vLLM settings, PEFT, ...) are ignored; a ``loss_type``
        it does not implement is refused by validation.
        """
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if hasattr(trl_config, f.name):
                value = getattr(trl_config, f.name)
                if f.name == "lr_scheduler_type":
                    value = getattr(value, "value", value)  # transformers' SchedulerType enum
                values[f.name] = value
        return cls(**values)


@dataclass
class PPOConfig(OptimConfig):
    """PPO options; names and defaults are ``trl.experimental.ppo.PPOConfig``'s.

    PPO: Schulman et al. 2017 (arXiv 1707.06347), eq. 7 (clipped surrogate) and eq. 9 (value term);
    GAE: Schulman et al. 2016 (arXiv 1506.02438), eq. 16; per-token KL penalty in the reward:
    Ziegler et al. 2019 (arXiv 1909.08593), eq. 2.
    """

    learning_rate: float = 3e-6
    """AdamW learning rate (TRL PPOConfig default 3e-6)."""
    num_ppo_epochs: int = 4
    """Passes over each rollout batch."""
    num_mini_batches: int = 1
    """Mini-batches per pass, one optimizer step each."""
    kl_coef: float = 0.05
    """Weight of the per-token KL penalty added to the rewards."""
    kl_estimator: KLEstimator = "k1"
    """"k1": ``log p - log p_ref`` (unbiased, can be negative); "k3": ``(r - 1) - log r`` (unbiased, >= 0)."""
    cliprange: float = 0.2
    """Clipping range of the policy ratio."""
    vf_coef: float = 0.1
    """Weight of the value loss."""
    cliprange_value: float = 0.2
    """Clipping range of the value prediction around the rollout's value."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda."""
    whiten_rewards: bool = False
    """Whiten the per-token rewards (without shifting their mean) before GAE."""
    response_length: int = 53
    """Most tokens generated per completion (TRL's name for PPO)."""
    temperature: float = 0.7
    """Sampling temperature; the training forward divides the logits by it too."""
    missing_eos_penalty: float | None = None
    """Subtracted from the score of a completion that did not end with a stop token."""

    def __post_init__(self) -> None:
        self._validate_optim()
        if self.num_ppo_epochs < 1:
            raise ValueError(f"num_ppo_epochs must be >= 1, got {self.num_ppo_epochs!r}")
        if self.num_mini_batches < 1:
            raise ValueError(f"num_mini_batches must be >= 1, got {self.num_mini_batches!r}")
        if self.kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        if self.kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3', got {self.kl_estimator!r}")
        if not 0.0 < self.cliprange < 1.0:
            raise ValueError(f"cliprange must be in (0, 1), got {self.cliprange!r}")
        if self.cliprange_value <= 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value!r}")
        if self.vf_coef < 0:
            raise ValueError(f"vf_coef must be >= 0, got {self.vf_coef!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma!r}")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam must be in [0, 1], got {self.lam!r}")
        if self.response_length < 1:
            raise ValueError(f"response_length must be >= 1, got {self.response_length!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 for training (logits are divided by it), got {self.temperature!r}")
        self.sampling  # noqa: B018

    @property
    def sampling(self) -> SamplingConfig:
        """The `SamplingConfig` these options describe (TRL's PPO samples with top_k=0, top_p=1)."""
        return SamplingConfig(temperature=self.temperature, max_new_tokens=self.response_length)
