"""Supervised fine-tuning on worked solutions: the warm start of a policy trained from scratch.

No pretrained policy exists offline, so RL starts from a zoo model fine-tuned on a task's worked
solutions (``prompt`` + ``completion``, TRL's prompt-completion format). The loss is next-token
cross-entropy on the completion tokens only (TRL's ``completion_only_loss=True``), averaged over
the completion tokens of the batch.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch.utils.data import Sampler
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from typing_extensions import override

from lightning_tlt.models.tokenizer import completion_text, encode_prompt
from lightning_tlt.rl.attention import training_attention
from lightning_tlt.rl.config import validate_adamw

IGNORE_INDEX = -100
"""Label of positions that do not count in the loss (prompt and padding), as in HF and TRL."""


@dataclass
class SFTConfig:
    """Optimisation settings of `SFTModule` (names follow TRL's ``SFTConfig`` / HF ``TrainingArguments``)."""

    learning_rate: float = 2e-3
    """Peak AdamW learning rate (a from-scratch char model wants ~1e-3..3e-3, not TRL's 2e-5)."""
    weight_decay: float = 0.0
    """AdamW weight decay (HF's default 0.0)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2 (0.95 is steadier than HF's 0.999 for short from-scratch runs)."""
    warmup_ratio: float = 0.05
    """Fraction of the steps with a linear warmup from 0."""
    lr_scheduler_type: str = "cosine"
    """``"cosine"`` (to ``min_lr_ratio`` of the peak at the last step) or ``"constant"`` (after warmup)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of the peak."""

    def __post_init__(self) -> None:
        validate_adamw(self)
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio!r}")
        if self.lr_scheduler_type not in ("cosine", "constant"):
            raise ValueError(
                f"lr_scheduler_type must be 'cosine' or 'constant', got {self.lr_scheduler_type!r}"
            )
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")


def lr_factor(step: int, total_steps: int, config: SFTConfig) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (linear warmup, then cosine/constant)."""
    warmup = int(config.warmup_ratio * total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if config.lr_scheduler_type == "constant" or total_steps <= warmup + 1:
        return 1.0
    progress = min(1.0, (step - warmup) / (total_steps - warmup - 1))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def sft_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Next-token cross-entropy over the labelled (completion) tokens.

    Position ``t`` of ``logits`` predicts ``labels[t + 1]``; positions labelled `IGNORE_INDEX`
    do not count. The loss is the mean over all counted tokens of the batch.

    Args:
        logits: ``(B, T, V)`` model outputs.
        labels: ``(B, T)`` token ids, `IGNORE_INDEX` outside the completions.

    Returns:
        The scalar loss and detached statistics: ``num_tokens`` (counted tokens) and
        ``mean_token_accuracy`` (argmax == label among them, TRL's metric name).
    """
    shift_logits = logits[:, :-1].float()  # (B, T-1, V)
    shift_labels = labels[:, 1:]  # (B, T-1)
    mask = shift_labels != IGNORE_INDEX  # (B, T-1)
    num_tokens = mask.sum()
    if int(num_tokens) == 0:
        raise ValueError("sft_loss: the batch has no completion token to learn from (all labels are ignored)")
    loss = (
        F.cross_entropy(
            shift_logits.reshape(-1, shift_logits.size(-1)),
            shift_labels.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        / num_tokens
    )
    with torch.no_grad():
        correct = (shift_logits.argmax(-1) == shift_labels) & mask
        accuracy = correct.sum() / num_tokens
    return loss, {"num_tokens": num_tokens.detach(), "mean_token_accuracy": accuracy.detach()}


class SFTCollator:
    """Tokenize ``prompt`` + ``completion`` rows into a right-padded batch with completion-only labels.

    Prompts go through `encode_prompt` (``<bos>`` + text, or the chat template); completions
    (str or conversational) are followed by ``<eos>``. Sequences longer than ``max_length`` are
    cut at the end, so a long completion keeps its beginning (and loses its ``<eos>``).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_length: int = 1024) -> None:
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2, got {max_length!r}")
        if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
            raise ValueError("SFTCollator needs a tokenizer with pad and eos tokens (see build_tokenizer)")
        self.tokenizer = tokenizer
        self.max_length = max_length

    def encode(self, row: Mapping[str, Any]) -> tuple[list[int], list[int]]:
        """``(input_ids, labels)`` of one row, not padded."""
        prompt = encode_prompt(self.tokenizer, row["prompt"])
        text = completion_text(row["completion"])
        completion = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + [
            self.tokenizer.eos_token_id
        ]
        ids = (prompt + completion)[: self.max_length]
        labels = ([IGNORE_INDEX] * len(prompt) + completion)[: self.max_length]
        return ids, labels

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, torch.Tensor]:
        encoded = [self.encode(row) for row in rows]
        width = max(len(ids) for ids, _ in encoded)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, T)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
        for i, (ids, lab) in enumerate(encoded):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            attention_mask[i, : len(ids)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class LengthGroupedBatchSampler(Sampler[list[int]]):
    """Batches of similar lengths (less padding), in a seeded random order (HF's ``group_by_length``).

    Indices are shuffled, cut into windows of ``batch_size * window_batches``, sorted by length
    inside each window, cut into batches, and the batches shuffled. Every index appears once per
    epoch; the order is fixed by ``seed`` and the epoch count. With ``max_tokens``, a batch also
    closes before its padded size (rows x longest) would pass ``max_tokens``: long sequences come
    in smaller batches, so memory is bounded by tokens, not rows.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        seed: int = 0,
        window_batches: int = 32,
        max_tokens: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if window_batches < 1:
            raise ValueError(f"window_batches must be >= 1, got {window_batches!r}")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {max_tokens!r}")
        self.lengths = list(lengths)
        self.batch_size = batch_size
        self.seed = seed
        self.window = batch_size * window_batches
        self.max_tokens = max_tokens
        self._epoch = 0

    def __len__(self) -> int:
        if self.max_tokens is None:
            return math.ceil(len(self.lengths) / self.batch_size)
        return len(self._batches(self._epoch))

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._batches(self._epoch)
        self._epoch += 1
        return iter(batches)

    def _batches(self, epoch: int) -> list[list[int]]:
        rng = random.Random(f"{self.seed}/{epoch}")
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        batches: list[list[int]] = []
        for start in range(0, len(order), self.window):
            batch: list[int] = []
            for i in sorted(order[start : start + self.window], key=self.lengths.__getitem__):
                full = len(batch) == self.batch_size
                if batch and (full or (self.max_tokens and (len(batch) + 1) * self.lengths[i] > self.max_tokens)):
                    batches.append(batch)
                    batch = []
                batch.append(i)
            if batch:
                batches.append(batch)
        rng.shuffle(batches)
        return batches


class SFTModule(LightningModule):
    """Fine-tune a causal LM on prompt-completion batches (from `SFTCollator`), loss on completions only.

    Logs ``train/loss``, ``train/mean_token_accuracy`` and ``train/num_tokens`` (TRL's SFT metric
    names under ``train/``), and ``val/loss`` when a validation loader is given. ``loss_history``
    holds every training step's loss (read it after ``fit``).
    """

    def __init__(self, model: PreTrainedModel, config: SFTConfig | None = None) -> None:
        super().__init__()
        self.model = model
        self.config = config if config is not None else SFTConfig()
        self._losses: list[torch.Tensor] = []

    @property
    def loss_history(self) -> list[float]:
        """The training loss of every step so far (one host transfer, on read)."""
        if not self._losses:
            return []
        return torch.stack(self._losses).float().cpu().tolist()

    @override
    def on_fit_start(self) -> None:
        # zoo models are built in eval mode, and Lightning keeps the submodules' modes as it finds them
        self.model.train()

    @override
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        with training_attention():  # not cuDNN's kernels: their backward can return NaN (OptimConfig.cudnn_attention)
            return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # (B, T, V)

    @override
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self(batch["input_ids"], batch["attention_mask"])  # (B, T, V)
        loss, stats = sft_loss(logits, batch["labels"])
        self._losses.append(loss.detach())
        batch_size = batch["input_ids"].size(0)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("train/mean_token_accuracy", stats["mean_token_accuracy"], batch_size=batch_size)
        self.log("train/num_tokens", stats["num_tokens"].float(), reduce_fx="sum", batch_size=batch_size)
        return loss

    @override
    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        logits = self(batch["input_ids"], batch["attention_mask"])
        loss, stats = sft_loss(logits, batch["labels"])
        batch_size = batch["input_ids"].size(0)
        self.log("val/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log("val/mean_token_accuracy", stats["mean_token_accuracy"], batch_size=batch_size)

    @override
    def configure_optimizers(self) -> Any:
        decay: list[torch.nn.Parameter] = []
        no_decay: list[torch.nn.Parameter] = []
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                (no_decay if p.ndim < 2 or "norm" in name else decay).append(p)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.config.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.config.learning_rate,
            betas=(self.config.adam_beta1, self.config.adam_beta2),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(step, total, self.config)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
