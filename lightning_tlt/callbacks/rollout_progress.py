"""`RolloutProgressCallback`: live rollout progress inside the Trainer's progress bar.

A rollout of a long-tailed batch can take most of an RL step; this callback listens to the
engine's `StepEvent` s and writes "rollout: 812 tok, 3/64 rows active" into the Trainer's own
progress bar (TQDM or Rich) while generation runs, throttled to a few updates a second.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar
from typing_extensions import override

from lightning_tlt.core.types import StepEvent


class RolloutProgressCallback(Callback):
    """Show rollout progress (tokens, active rows, phase) in the Trainer's progress bar.

    Args:
        refresh_s: least seconds between two updates of the bar.
    """

    def __init__(self, refresh_s: float = 0.25) -> None:
        if refresh_s < 0:
            raise ValueError(f"refresh_s must be >= 0, got {refresh_s!r}")
        self.refresh_s = refresh_s
        self._trainer: pl.Trainer | None = None
        self._datamodule: Any = None
        self._tokens = 0
        self._last = 0.0
        self._shown = ""
        self.last_text = ""
        """The latest progress text (also what the bar shows)."""

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "add_listener"):
            dm.add_listener(self._on_event)
            self._datamodule = dm

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._datamodule is not None:
            self._datamodule.remove_listener(self._on_event)
            self._datamodule = None

    def _on_event(self, event: StepEvent) -> None:
        self._tokens += event.new_tokens
        now = time.perf_counter()
        if event.phase != "done" and now - self._last < self.refresh_s:
            return
        self._last = now
        rows = f"{event.active_rows}/{event.num_slots} rows active"
        if event.queued_rows:
            rows += f", {event.queued_rows} queued"
        phase = "" if event.phase in ("decode", "done") else f", {event.phase}"
        self.last_text = f"rollout: {self._tokens} tok, {rows}{phase}" if event.phase != "done" else ""
        if event.phase == "done":
            self._tokens = 0
        self._show(self.last_text)

    def _show(self, text: str) -> None:
        bar = self._trainer.progress_bar_callback if self._trainer is not None else None
        if isinstance(bar, TQDMProgressBar) and bar._train_progress_bar is not None:
            bar.train_progress_bar.set_postfix_str(text, refresh=True)
        elif isinstance(bar, RichProgressBar) and bar.progress is not None and bar.train_progress_bar_id is not None:
            task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
            base = str(task.description)
            if self._shown and base.endswith(self._shown):
                base = base[: -len(self._shown)].rstrip(" |")
            self._shown = f" | {text}" if text else ""
            bar.progress.update(bar.train_progress_bar_id, description=base + self._shown)
            bar.refresh()
