"""`InterruptCheckpoint`: Ctrl-C, a scheduler's SIGTERM or an exception loses at most the RL step in flight.

An RL step is long (a whole rollout, then ``num_iterations`` optimizer steps), and the Trainer's
checkpoints come every few of them at best. On SIGINT or SIGTERM this callback lets the step in
flight finish, writes ``last.ckpt`` beside the run's other checkpoints and ends the process with
the shell's code for the signal (130 for SIGINT, 143 for SIGTERM). The checkpoint is written
where `ModelCheckpoint` writes its own, at the same point of the loop, so resuming from it
(``--ckpt_path .../last.ckpt``) continues exactly as the uninterrupted run would have. A second
signal stops at once (the last cadence checkpoint stays the one to resume from), as does a signal
before the first step has started.

An exception raised during training (a reward function that fails, an out-of-memory error) writes
``on_exception.ckpt`` instead, as Lightning's `OnExceptionCheckpoint` does: the state at that
moment, inside an RL step, so resuming from it redoes that step (resumable, not bit for bit; the
cadence checkpoint ``last.ckpt`` is left as it was). Under DDP a failing rank cannot wait for the
others (they may be blocked in a collective), and each holds the whole model: every rank that fails
writes ``on_exception-rank{R}.ckpt`` on its own. Under sharded strategies (FSDP, DeepSpeed) no
exception checkpoint is written; ``last.ckpt`` is the one to resume from.

The decision to stop is agreed across ranks at every step's end (a max over ranks of the signal
received), so a signal that reaches one rank stops them all at the same step.

Its end of a step runs after every other callback's, wherever it is listed (``setup`` appends a
private callback that runs it to the end of the Trainer's callbacks), as `ModelCheckpoint`'s does:
the checkpoint then holds every callback's state after the step (the co-trained drafter's harvest
and publication, a held-out evaluation's history), and the step's logged metrics are handed to the
loggers before the process ends, so the interrupted run's metrics lack no step the resumed one does
not redo. Its signal handlers are installed where it is listed (``on_train_start``, after the
Trainer's own): listed first, they cover the other callbacks' ``on_train_start`` work too.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_tlt.core.checksums import CheckpointCorruptError
from lightning_tlt.core.rank_state import saving_alone

SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM}
"""The signals handled, by name."""


def exit_code(signum: int) -> int:
    """The shell's exit status of a process ended by ``signum`` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


class InterruptCheckpoint(Callback):
    """Write a resumable checkpoint when a signal or an exception ends ``fit``.

    Args:
        dirpath: where ``last.ckpt`` and ``on_exception.ckpt`` go; ``None`` is the `ModelCheckpoint`'s
            folder (the run's ``checkpoints/``), or ``default_root_dir/checkpoints`` without one.
        signals: the signals that stop the run after the step in flight (``"SIGINT"``, ``"SIGTERM"``).
        on_exception: write ``on_exception.ckpt`` when an exception stops training.
    """

    LAST_NAME = "last.ckpt"
    EXCEPTION_NAME = "on_exception.ckpt"

    def __init__(
        self, dirpath: str | None = None, signals: tuple[str, ...] = ("SIGINT", "SIGTERM"), on_exception: bool = True
    ) -> None:
        unknown = [s for s in signals if s not in SIGNALS]
        if unknown:
            raise ValueError(f"signals must be among {sorted(SIGNALS)}, got {unknown!r}")
        self.dirpath = dirpath
        self.signals = tuple(signals)
        self.on_exception_save = on_exception
        self._signum: int | None = None  # the first signal received while training
        self._previous: dict[int, Any] = {}  # the handlers ours replaced, put back at teardown
        self._active = False  # between the first training batch and teardown
        self.saved_path: Path | None = None
        """The checkpoint this callback wrote, if any."""
        self._step_end = _StepEnd(self)

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # the step's end (a save, then the exit) after every other callback's: a new list, so the hook loop going
        # over the old one (this very call's) is not disturbed
        others = [c for c in trainer.callbacks if c is not self._step_end]  # type: ignore[attr-defined]
        trainer.callbacks = [*others, self._step_end]  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ signals
    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # here, after the Trainer has registered its own SIGTERM handler, which ours stands in for while training
        self._signum, self.saved_path = None, None
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("InterruptCheckpoint: fit runs outside the main thread, where Python cannot handle "
                           "signals; only exceptions are checkpointed")
            return
        for name in self.signals:
            signum = SIGNALS[name]
            previous = signal.getsignal(signum)
            if previous == signal.SIG_IGN:  # ignored on purpose (nohup, a supervisor): left so
                continue
            self._previous[signum] = previous
            signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if not self._active or self._signum is not None:  # before the first step, or a second signal: stop now
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(exit_code(signum))
        self._signum = signum
        name = signal.Signals(signum).name
        print(f"\nreceived {name}: finishing the RL step in flight, then writing {self.LAST_NAME} "
              f"(send it again to stop now)", file=sys.stderr, flush=True)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._active = True

    def end_step(self, trainer: pl.Trainer) -> None:
        """At the end of an RL step, after every other callback's: save and exit if a signal came (any rank's)."""
        signum = self._agreed_signal(trainer)
        if not signum:
            return
        path = self._save(trainer, self.LAST_NAME)
        rank_zero_info(f"{signal.Signals(signum).name}: saved the run at optimizer step {trainer.global_step} to "
                       f"{path}; resume with --ckpt_path {path}")
        self._active = False
        # the step's metrics, as the loop would log them after this hook (the loggers save them as the run ends)
        trainer._logger_connector.update_train_step_metrics()
        raise SystemExit(exit_code(signum))

    def _agreed_signal(self, trainer: pl.Trainer) -> int:
        """The signal any rank received (the largest number), 0 for none: every rank stops at the same step."""
        local = self._signum or 0
        if trainer.world_size <= 1:
            return local
        flag = torch.tensor(float(local), device=trainer.strategy.root_device)
        return int(trainer.strategy.reduce(flag, reduce_op="max").item())  # type: ignore[union-attr]

    # ------------------------------------------------------------------ exceptions
    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        active = self._active
        self._restore()  # the Trainer may not call teardown after an exception
        if not self.on_exception_save or not active or self.saved_path is not None:
            return  # before training, or after a signal's checkpoint
        if isinstance(exception, (KeyboardInterrupt, SystemExit, CheckpointCorruptError)):
            return  # asked to stop now, or nothing was trained
        distributed = trainer.world_size > 1
        if distributed and type(trainer.strategy) is not DDPStrategy:  # sharded state needs every rank to save
            rank_zero_warn(f"InterruptCheckpoint: an exception under {type(trainer.strategy).__name__} is not "
                           f"checkpointed (the other ranks cannot join the save); resume from "
                           f"{self._dir(trainer) / self.LAST_NAME}")
            return
        try:
            path = self._save_alone(trainer) if distributed else self._save(trainer, self.EXCEPTION_NAME)
        except Exception as err:  # never mask the exception that stopped the run
            rank_zero_warn(f"InterruptCheckpoint: could not save after {type(exception).__name__}: {err}")
            return
        print(f"{type(exception).__name__} stopped the run inside the RL step after optimizer step "
              f"{trainer.global_step}; saved to {path} (resuming from it redoes that RL step)", file=sys.stderr)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore()

    def _restore(self) -> None:
        self._active = False
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:  # ours still: put back the one it replaced
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    # ------------------------------------------------------------------ saving
    def _dir(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return Path(self.dirpath)
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath:
            return Path(callback.dirpath)
        return Path(trainer.default_root_dir) / "checkpoints"

    def _save_alone(self, trainer: pl.Trainer) -> Path:
        """Under DDP, this rank's checkpoint without the other ranks (which may be blocked in a collective or
        failing too): each rank holds the whole model, so it writes ``on_exception-rank{R}.ckpt`` itself."""
        path = self._dir(trainer) / f"{Path(self.EXCEPTION_NAME).stem}-rank{trainer.global_rank}.ckpt"
        # the Trainer's dump, as save_checkpoint makes it, but written by this rank (no barrier, no rank-0 filter)
        with saving_alone():  # the rank-local states are this rank's only: the others do not join
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        trainer.strategy.checkpoint_io.save_checkpoint(checkpoint, path)
        self.saved_path = path
        return path

    def _save(self, trainer: pl.Trainer, name: str) -> Path:
        path = self._dir(trainer) / name
        trainer.save_checkpoint(path)  # every rank takes part (sharded strategies); rank 0 writes
        self.saved_path = path
        return path


class _StepEnd(Callback):
    """`InterruptCheckpoint.end_step` as a callback of its own, put last in the Trainer's list at ``setup``."""

    def __init__(self, owner: InterruptCheckpoint) -> None:
        self.owner = owner

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.owner.end_step(trainer)
