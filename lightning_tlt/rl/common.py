"""What the GRPO and PPO LightningModules share: the policy spec, the policy forward, the optimizer.

The modules only orchestrate: losses and advantages are pure functions (`lightning_tlt.rl.losses`,
`lightning_tlt.rl.advantages`); this file holds the plumbing both need: building the policy from
a small typed spec (so LightningCLI can describe it in YAML), the policy's forward over a batch
(`lightning_tlt.rl.forward`, re-exported here), AdamW with TRL's linear schedule, and
the declared interface through which the drafter co-training callback receives the policy's
hidden states (`PolicyFeatureSource`, implemented by `RLModule`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, cast, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from lightning_tlt.core.checksums import add_checksums, verify_checksums
from lightning_tlt.core.sharding import is_dtensor, local_tensor
from lightning_tlt.core.types import DTYPES
from lightning_tlt.rl.batch import RolloutBatch
from lightning_tlt.rl.config import OptimConfig
from lightning_tlt.rl.forward import PolicyForward as PolicyForward
from lightning_tlt.rl.forward import completion_forward as completion_forward
from lightning_tlt.rl.fsdp import check_sharded_training, check_strategy, checkpoint_layers, shard_module
from lightning_tlt.rl.progress_bar import optimizer_step_bar
from lightning_tlt.rl.warmstart import WarmStartConfig


@dataclass
class PolicySpec:
    """A policy described in a few fields (what ``policy:`` in a LightningCLI YAML holds).

    Either a zoo model (``arch``/``size``/``seed``), optionally warm-started by SFT on a zoo task
    (``warm_start``, cached on disk), or an HF model directory (``path``).
    """

    arch: str = "qwen2"
    """Zoo architecture: "qwen2", "llama" or "qwen3"."""
    size: str = "tiny"
    """Zoo size (a key of ``lightning_tlt.models.zoo.ZOO_SIZES``)."""
    seed: int = 0
    """Seed of the zoo model's init."""
    warm_start: WarmStartConfig | str | None = None
    """SFT-warm-start the zoo model first (``lightning_tlt.rl.warmstart.warm_start``, cached): its settings
    (``{task: arithmetic, steps: 300, ...}``), or a task name for the defaults. Its ``arch``, ``size`` and
    ``seed`` are this spec's (leave them out, or give the same)."""
    path: str | None = None
    """An HF model directory (``AutoModelForCausalLM.from_pretrained``); overrides the zoo fields."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""

    def __post_init__(self) -> None:
        from lightning_tlt.models.zoo import ARCHS, ZOO_SIZES

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.path is not None and self.warm_start is not None:
            raise ValueError(f"give either path ({self.path!r}) or warm_start ({self.warm_start!r}), not both")
        if self.path is None and self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {list(ARCHS)}, got {self.arch!r}")
        if self.path is None and self.size not in ZOO_SIZES:
            raise ValueError(f"size must be one of {list(ZOO_SIZES)}, got {self.size!r}")
        if self.warm_start is not None:
            self.warm_start = self._warm_start_config(self.warm_start)

    def _warm_start_config(self, given: WarmStartConfig | str | dict[str, Any]) -> WarmStartConfig:
        """``given`` as a `WarmStartConfig` whose ``arch``, ``size`` and ``seed`` are the spec's."""
        if isinstance(given, str):
            given = WarmStartConfig(task=given)
        elif isinstance(given, dict):  # a parsed config's ``as_dict()``
            given = WarmStartConfig(**given)
        for name in ("arch", "size", "seed"):
            value = getattr(given, name)
            if value is not None and value != getattr(self, name):
                raise ValueError(
                    f"warm_start.{name}={value!r} differs from the policy's {name}={getattr(self, name)!r}; "
                    f"give {name} on the policy only"
                )
        return replace(given, arch=self.arch, size=self.size, seed=self.seed)

    def max_positions(self) -> int | None:
        """The policy's ``max_position_embeddings``, read from its config without building (or warm-starting) it."""
        if self.path is not None:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.path)
        else:
            from lightning_tlt.models.zoo import build_config

            config = build_config(self.arch, self.size)
        positions = getattr(config, "max_position_embeddings", None)
        return int(positions) if positions is not None else None

    def build(self) -> nn.Module:
        """Build (or load) the policy, on the CPU."""
        dtype = DTYPES[self.dtype]
        if self.path is not None:
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_pretrained(self.path, dtype=dtype)
        if self.warm_start is not None:
            from lightning_tlt.rl.warmstart import warm_start

            model: Any = warm_start(self._warm_start_config(self.warm_start))[0]
            return model.to(dtype)
        from lightning_tlt.models.zoo import build_model

        return build_model(self.arch, self.size, seed=self.seed, dtype=dtype)


def resolve_policy(policy: nn.Module | PolicySpec | dict[str, Any]) -> nn.Module:
    """A policy module from a module, a `PolicySpec` or the dict of one."""
    if isinstance(policy, dict):
        policy = PolicySpec(**policy)
    if isinstance(policy, PolicySpec):
        return policy.build()
    if isinstance(policy, nn.Module):
        return policy
    raise ValueError(f"policy must be an nn.Module, a PolicySpec or a dict of one, got {type(policy)!r}")


def check_completion_length(policy: nn.Module | PolicySpec | dict[str, Any], max_new_tokens: int, name: str) -> None:
    """Refuse a completion budget the policy has no positions for, before the policy is built or warm-started.

    Args:
        policy: what the RL module was given.
        max_new_tokens: the completion budget.
        name: the option that set it, for the message (``max_completion_length``, ``response_length``).

    Raises:
        ValueError: naming both numbers.
    """
    if isinstance(policy, dict):
        policy = PolicySpec(**policy)
    if isinstance(policy, PolicySpec):
        positions = policy.max_positions()
    else:
        positions = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
    if positions is not None and max_new_tokens >= positions:
        raise ValueError(
            f"{name}={max_new_tokens} leaves no room for a prompt in the policy's {positions} positions "
            f"(config.max_position_embeddings); {name} must be < {positions}"
        )


def frozen_copy(model: nn.Module) -> nn.Module:
    """A frozen, eval-mode deep copy (the reference model of the KL term)."""
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


@dataclass
class PolicyFeatures:
    """The policy's final hidden states from the first training forward of an RL step.

    What an RL module hands to the drafter co-training callback (`PolicyFeatureSource`), so the
    EAGLE drafter trains on what the policy computed anyway.
    """

    hidden_states: Tensor
    """``(N, T, H)`` detached final-layer hidden states, after the final norm (HF ``hidden_states[-1]``)."""
    input_ids: Tensor
    """``(N, T)`` prompt and completion tokens."""
    attention_mask: Tensor
    """``(N, T)`` 1 on real tokens (prompts are left-padded)."""
    completion_mask: Tensor
    """``(N, T)`` 1 on completion tokens."""
    step: int
    """The RL step (``trainer.global_step`` when the batch was trained on)."""


@runtime_checkable
class PolicyFeatureSource(Protocol):
    """A LightningModule that can hand over the policy's hidden states of each RL step.

    `lightning_tlt.callbacks.drafter_cotrain.DrafterCoTrainCallback` calls
    ``request_policy_features(True)`` at fit start, `take_policy_features` at each RL step
    boundary, and ``request_policy_features(False)`` at teardown. `RLModule` implements it.
    """

    def request_policy_features(self, enabled: bool = True) -> None:
        """Keep (or stop keeping) the features of the first training forward of each RL step."""
        ...

    def take_policy_features(self) -> PolicyFeatures | None:
        """The features the latest RL step kept, handed over once; ``None`` if there are none."""
        ...


def gradient_norm(optimizer: Any, sum_across_ranks: Callable[[Tensor], Tensor] | None = None) -> Tensor | None:
    """The L2 norm of all gradients ``optimizer`` holds, in float32 (``None`` when it holds none).

    Sharded gradients (FSDP2 ``DTensor`` s) are normed from this rank's slices, whose squared norms
    ``sum_across_ranks`` adds up over the ranks: the whole gradient's norm, the same on every rank
    (NaN on every rank when any slice is not finite).
    """
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if not grads:
        return None
    sharded = sum_across_ranks is not None and any(is_dtensor(g) for g in grads)
    norms = [torch.linalg.vector_norm(local_tensor(g) if sharded else g, dtype=torch.float32) for g in grads]
    norm = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    if sharded:
        assert sum_across_ranks is not None
        norm = sum_across_ranks(norm.square()).sqrt()
    return norm


@torch.no_grad()
def clip_sharded_gradients(optimizer: Any, max_norm: float, norm: Tensor) -> None:
    """Scale sharded gradients by ``max_norm / norm`` when above it, as ``clip_grad_norm_`` would (with
    its 1e-6), from the norm `gradient_norm` computed already: no second reduction."""
    grads = [local_tensor(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].device))


class RLModule(pl.LightningModule):
    """Base of `GRPOModule` and `PPOModule`: manual optimization over rollout batches.

    A `PolicyFeatureSource`: once `request_policy_features` was called, the first training forward
    of each RL step also returns the policy's final hidden states (a copy of a tensor the loss
    computes anyway), kept detached until `take_policy_features` hands them over. Off by default:
    it costs nothing then.
    """

    config: OptimConfig
    _features_requested: bool
    """Whether the first training forward of each RL step keeps the policy's hidden states."""
    _policy_features: PolicyFeatures | None
    """What that forward kept last, until `take_policy_features` hands it over."""

    def __init__(self, policy: nn.Module | PolicySpec | dict[str, Any]) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.policy = resolve_policy(policy)
        self._applied_lr: float | None = None
        self._grad_norm = math.nan
        """The last optimizer step's gradient norm before clipping (NaN before the first)."""
        self._nonfinite_steps = 0
        """Optimizer steps skipped because the gradient was not finite (checkpointed)."""
        self._nonfinite_in_a_row = 0
        self._micro_losses: list[Tensor] = []
        """The detached losses of the micro-batches since the last optimizer step (read only when its
        gradient is not finite, to say which micro-batches were)."""
        self._features_requested = False
        self._policy_features = None
        self._sharded = False
        """Whether `configure_model` sharded the models (FSDP2): gradients are then ``DTensor`` slices."""

    # ------------------------------------------------------------------ PolicyFeatureSource
    def request_policy_features(self, enabled: bool = True) -> None:
        """Keep (``enabled``) or stop keeping the policy's features of each RL step (see the class)."""
        self._features_requested = bool(enabled)
        if not enabled:
            self._policy_features = None

    @property
    def policy_features_requested(self) -> bool:
        """Whether `request_policy_features` is on (the training step then asks its first forward for them)."""
        return self._features_requested

    def take_policy_features(self) -> PolicyFeatures | None:
        """The `PolicyFeatures` of the latest RL step, handed over once (then ``None`` until the next)."""
        features, self._policy_features = self._policy_features, None
        return features

    @override
    def on_fit_start(self) -> None:
        self.policy.train()  # as HF's Trainer does; a reference model stays in eval mode
        max_steps, per = self.trainer.max_steps, self.optimizer_steps_per_batch()
        if max_steps is not None and max_steps > 0 and max_steps % per:
            rank_zero_warn(
                f"max_steps={max_steps} is not a multiple of the {per} optimizer steps each rollout batch makes: "
                f"the last batch is trained on for {max_steps % per} of them, and training stops at step {max_steps}"
            )

    @override
    def configure_callbacks(self) -> list[Callback]:
        # Lightning's own progress bar counts batches; ours counts optimizer steps, as max_steps does
        trainer = self._trainer
        default = trainer.progress_bar_callback if trainer is not None else None
        bar = optimizer_step_bar(default)
        if bar is None:
            return []
        # take Lightning's default bar out ourselves: returned as an override, it would print a notice
        # about "callbacks passed to Trainer" that a user who passed none could not place
        assert trainer is not None
        trainer.callbacks = [c for c in trainer.callbacks if c is not default]  # type: ignore[attr-defined]
        return [bar]

    # ------------------------------------------------------------------ optimizer
    def optimizer_steps_per_batch(self) -> int:
        """Optimizer steps one rollout batch makes (for the schedule's length and the progress bar)."""
        return 1

    def optimizer_steps_left(self, wanted: int) -> int:
        """How many of ``wanted`` optimizer steps this batch may make without going past ``max_steps``."""
        trainer = self._trainer
        if trainer is None or trainer.max_steps is None or trainer.max_steps < 0:
            return wanted
        return max(0, min(wanted, trainer.max_steps - self.global_step))

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    # ------------------------------------------------------------------ sharding (FSDP)
    def models_to_shard(self) -> list[nn.Module]:
        """The modules `configure_model` shards under ``ModelParallelStrategy``: the policy, and the
        reference model when there is one (a subclass adds its own: PPO's value model and head)."""
        ref = getattr(self, "ref_model", None)
        return [self.policy] + ([ref] if ref is not None else [])

    @override
    def configure_model(self) -> None:
        """Shard the models with FSDP2 under ``ModelParallelStrategy`` (`lightning_tlt.rl.fsdp`): the
        Lightning way, once the device mesh exists and before the optimizer is made; nothing under any
        other strategy (``FSDPStrategy`` is refused, with what to use instead). With
        ``config.gradient_checkpointing``, the trained models' decoder layers are checkpointed first
        (`lightning_tlt.rl.fsdp.checkpoint_layers`), sharded or not."""
        if self.config.gradient_checkpointing:  # before sharding, under any strategy
            trainable = {id(p) for p in self.trainable_parameters()}
            for module in self.models_to_shard():
                if any(id(p) in trainable for p in module.parameters()):
                    checkpoint_layers(module)
        trainer = self._trainer
        mesh = check_strategy(trainer) if trainer is not None else None
        if mesh is None:
            return
        for module in self.models_to_shard():
            shard_module(module, mesh)
        check_sharded_training(self.trainable_parameters(), self)
        self._sharded = True

    @override
    def configure_optimizers(self) -> Any:
        cfg = self.config
        optimizer = torch.optim.AdamW(
            self.trainable_parameters(),
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            eps=cfg.adam_epsilon,
            weight_decay=cfg.weight_decay,
        )
        total = self._total_optimizer_steps()
        warmup = cfg.warmup_steps
        linear = cfg.lr_scheduler_type == "linear"

        def factor(step: int) -> float:  # transformers' get_linear_schedule_with_warmup / constant_with_warmup
            if step < warmup:
                return step / max(1, warmup)
            if not linear:
                return 1.0
            return max(0.0, (total - step) / max(1, total - warmup))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_optimizer_steps(self) -> int:
        trainer = self._trainer
        if trainer is None:
            return 1
        if trainer.max_steps and trainer.max_steps > 0:
            return int(trainer.max_steps)
        batches = trainer.estimated_stepping_batches
        if not isinstance(batches, int) and not float(batches) < float("inf"):
            raise ValueError("set Trainer(max_steps=...) (or max_epochs) so the learning-rate schedule has a length")
        return int(batches) * self.optimizer_steps_per_batch()

    def _optimizer(self) -> Any:
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list), "RL modules configure one optimizer"
        return optimizer

    def _step(self, loss: Tensor) -> None:
        """One manual optimizer step on ``loss`` (backward, clip, step, schedule)."""
        self._optimizer().zero_grad(set_to_none=True)
        self.manual_backward(loss)
        self._finish_step()

    def _finish_step(self) -> None:
        """Clip, step and schedule on the gradients accumulated since the last ``zero_grad``.

        A gradient that is not finite is never applied: the step is skipped (the weights and the
        optimizer's state stay as they were; the step still counts, and the schedule advances),
        counted in ``train/nonfinite_grad_steps`` and warned about; more than
        ``max_consecutive_nonfinite_steps`` in a row stop training with an error. Under a loss
        scaler (``16-mixed``) the scaler skips such steps itself and this check stays out of its way.
        """
        optimizer = self._optimizer()
        self._applied_lr = float(optimizer.param_groups[0]["lr"])
        guarded = getattr(self.trainer.precision_plugin, "scaler", None) is None if self._trainer else True
        norm = gradient_norm(optimizer, self._sum_across_ranks if self._sharded else None) if guarded else None
        if norm is not None:
            norm = norm if self._sharded else self._agree_norm(norm)  # a sharded norm is every rank's already
            self._grad_norm = float(norm)  # one host sync per optimizer step
        if norm is not None and not math.isfinite(self._grad_norm):
            optimizer.zero_grad(set_to_none=True)
            self._nonfinite_steps += 1
            self._nonfinite_in_a_row += 1
            limit = self.config.max_consecutive_nonfinite_steps
            losses = torch.stack(self._micro_losses).tolist() if self._micro_losses else []
            where = (
                f"; micro-batch losses not finite: {[i for i, x in enumerate(losses) if not math.isfinite(x)]} "
                f"of {len(losses)}" if losses else ""
            )
            message = (
                f"optimizer step {self.global_step}: the policy's gradient norm is {self._grad_norm} (not finite); "
                f"the step was skipped and the weights are unchanged ({self._nonfinite_in_a_row} in a row, "
                f"{self._nonfinite_steps} in all){where}"
            )
            if self._nonfinite_in_a_row > limit:
                raise FloatingPointError(
                    f"{message}: more than max_consecutive_nonfinite_steps={limit} in a row, training stops. "
                    f"Look for a reward, advantage or loss that is not finite, or lower the learning rate"
                )
            rank_zero_warn(message)
        else:
            self._nonfinite_in_a_row = 0
            if self.config.max_grad_norm > 0 and self._sharded and norm is not None:
                clip_sharded_gradients(optimizer, self.config.max_grad_norm, norm)
            elif self.config.max_grad_norm > 0:
                self.clip_gradients(optimizer, gradient_clip_val=self.config.max_grad_norm, gradient_clip_algorithm="norm")
        self._micro_losses = []
        # a skipped step still steps, with no gradient (AdamW leaves such parameters and their state
        # alone): the optimizer step is counted (global_step, max_steps) and its hooks run as usual
        optimizer.step()
        scheduler: Any = self.lr_schedulers()
        if scheduler is not None:
            scheduler.step()

    def _sum_across_ranks(self, value: Tensor) -> Tensor:
        return cast(Tensor, self.trainer.strategy.reduce(value, reduce_op="sum"))

    def _agree_norm(self, norm: Tensor) -> Tensor:
        """This rank's gradient norm, made NaN when any rank's is not finite: ranks must skip a step
        together or apply it together (a sharded strategy's ranks each see part of the gradient)."""
        trainer = self._trainer
        if trainer is None or trainer.world_size <= 1:
            return norm
        bad = cast(Tensor, trainer.strategy.reduce((~torch.isfinite(norm)).float(), reduce_op="sum"))
        return torch.where(bad > 0, torch.full_like(norm, math.nan), norm)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["nonfinite_grad_steps"] = [self._nonfinite_steps, self._nonfinite_in_a_row]
        # last: the callbacks' and the datamodule's states are in already (a subclass adds its own before calling this)
        add_checksums(checkpoint)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # before any weight is loaded: a corrupt checkpoint is one error naming the file and the tensor
        trainer = self._trainer
        verify_checksums(checkpoint, getattr(trainer, "ckpt_path", None) or "the checkpoint")
        self._nonfinite_steps, self._nonfinite_in_a_row = checkpoint.get("nonfinite_grad_steps", [0, 0])

    def _step_metrics(self) -> dict[str, float]:
        """What every RL step logs about its optimizer steps (TRL's ``grad_norm``, before clipping)."""
        return {"grad_norm": self._grad_norm, "train/nonfinite_grad_steps": float(self._nonfinite_steps)}

    def _learning_rate(self) -> float:
        """The learning rate of the batch's last optimizer step (not the next step's, which is 0.0 at the end
        of a linear schedule)."""
        if self._applied_lr is None:
            return float(self._optimizer().param_groups[0]["lr"])
        return self._applied_lr

    # ------------------------------------------------------------------ features and logging
    def _store_features(self, batch: RolloutBatch, hidden: Tensor | None) -> None:
        if hidden is None:
            return
        p = batch.prompt_ids.shape[1]
        completion_mask = torch.zeros_like(batch.attention_mask)
        completion_mask[:, p:] = batch.completion_mask
        self._policy_features = PolicyFeatures(
            hidden_states=hidden.detach(),
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            completion_mask=completion_mask,
            step=int(self.global_step),
        )

    def _log_metrics(self, metrics: dict[str, float | Tensor], batch_size: int, prefix: str = "") -> None:
        shown = {"reward", "loss", "completions/mean_length", "spec/accept_len"}
        # the loggers' x-axis is the optimizer step (global_step, as max_steps and checkpoint names count),
        # not Lightning's default count of training batches (Lightning reads a logged "step" as the step);
        # evaluation rows too (logged per epoch: the mean of a constant is that constant)
        self.log("step", float(self.global_step), on_step=not prefix, on_epoch=bool(prefix), batch_size=batch_size)
        for name, value in metrics.items():
            value = float(value.item()) if isinstance(value, Tensor) else float(value)
            self.log(
                prefix + name, value, on_step=not prefix, on_epoch=bool(prefix), batch_size=batch_size,
                prog_bar=name in shown and not prefix,
            )

    @override
    def validation_step(self, batch: RolloutBatch, batch_idx: int) -> None:
        # TRL prefixes evaluation metrics with "eval_"; rewards need no gradient
        self._log_metrics(
            {k: v for k, v in batch.metrics.items() if not k.startswith("num_tokens")}, len(batch), prefix="eval_"
        )
