"""Lightning's progress bars, counting optimizer steps: what ``max_steps`` counts in an RL run.

An RL module makes several optimizer steps per training batch (GRPO's ``num_iterations``, PPO's
``num_ppo_epochs x num_mini_batches``), and ``trainer.global_step`` counts those steps, as
``max_steps``, the logged ``step`` and checkpoint names do. Lightning's bars count batches
against ``max_steps`` instead, so a GRPO run with ``num_iterations=2`` ended at "16/32". These
bars count ``global_step`` (a batch of two optimizer steps advances them by two), so the bar ends
at ``max_steps``, its ETA is right, and the Rich bar no longer shows "Epoch 0/-2" when only
``max_steps`` bounds the run. `RLModule.configure_callbacks` puts them in place of Lightning's
default bars, with the same settings.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


def optimizer_steps_per_batch(pl_module: Any) -> int:
    """Optimizer steps one training batch makes (``pl_module.optimizer_steps_per_batch()``, else 1)."""
    fn = getattr(pl_module, "optimizer_steps_per_batch", None)
    return max(1, int(fn())) if fn is not None else 1


class _OptimizerStepProgress:
    """Mixin of a Lightning progress bar: the training bar's total and position in optimizer steps."""

    trainer: pl.Trainer
    _first_step = 0  # global_step when the epoch (or a resumed run) started

    @property
    def total_train_batches(self) -> int | float:
        trainer = self.trainer
        total = trainer.num_training_batches * optimizer_steps_per_batch(trainer.lightning_module)
        if trainer.max_steps is not None and trainer.max_steps > 0:
            total = min(total, trainer.max_steps - self._first_step)
        return total

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step
        super().on_train_start(trainer, pl_module)  # type: ignore[misc]

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step
        super().on_train_epoch_start(trainer, pl_module)  # type: ignore[misc]

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # the parent bars show ``batch_idx + 1``: hand them the optimizer steps made so far instead
        steps_done = trainer.global_step - self._first_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, steps_done - 1)  # type: ignore[misc]


class OptimizerStepTQDMProgressBar(_OptimizerStepProgress, TQDMProgressBar):
    """`TQDMProgressBar` whose training bar counts optimizer steps (``global_step``) up to ``max_steps``."""


class OptimizerStepRichProgressBar(_OptimizerStepProgress, RichProgressBar):
    """`RichProgressBar` whose training bar counts optimizer steps (``global_step``) up to ``max_steps``."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        # Lightning writes "Epoch 0/-2" when max_steps alone bounds the run (max_epochs=-1)
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:
            return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"
        return super()._get_train_description(current_epoch)


def print_line(trainer: pl.Trainer | None, text: str) -> None:
    """Print ``text`` as whole lines above the Trainer's progress bar, through the bar's own console, on rank zero.

    A line written beside a live bar (a log record, a ``print``) is erased or glued to the bar by its next
    redraw in a terminal; TQDM's ``write`` and Rich's console clear the bar, print the line and redraw it.
    Without a bar the line goes to Lightning's rank-zero log (``rank_zero_info``), as before.
    """
    if trainer is not None and not trainer.is_global_zero:
        return
    bar = trainer.progress_bar_callback if trainer is not None else None
    if isinstance(bar, TQDMProgressBar) and bar.is_enabled:
        import sys

        from tqdm.auto import tqdm

        for line in text.splitlines():
            tqdm.write(line, file=sys.stdout)
        return
    if isinstance(bar, RichProgressBar) and bar.is_enabled and bar.progress is not None:
        # soft_wrap: never re-wrap a long line; markup/highlight off: print the text exactly as written
        bar.progress.console.print(text, soft_wrap=True, markup=False, highlight=False)
        return
    rank_zero_info(text)


def optimizer_step_bar(bar: Callback | None) -> Callback | None:
    """The optimizer-step version of Lightning's own bar ``bar``, with its settings; ``None`` for any other bar
    (a user's own progress bar class, or none, is left as it is)."""
    if type(bar) is TQDMProgressBar:
        return OptimizerStepTQDMProgressBar(
            refresh_rate=bar.refresh_rate, process_position=bar.process_position, leave=bar._leave
        )
    if type(bar) is RichProgressBar:
        return OptimizerStepRichProgressBar(
            refresh_rate=int(bar.refresh_rate), leave=bar._leave, theme=bar.theme, console_kwargs=bar._console_kwargs
        )
    return None
