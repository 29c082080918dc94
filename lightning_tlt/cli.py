"""The ``lightning-tlt`` command: LightningCLI for RL training, plus the kit's helper subcommands.

- ``lightning-tlt fit --config configs/demo_cpu.yaml`` (and ``validate``): a LightningCLI over
  the RL modules (``model: class_path: lightning_tlt.rl.grpo.GRPOModule``, or ``PPOModule``) and
  `RolloutDataModule` (``data:``); every typed ``__init__`` argument is a YAML key.
- ``lightning-tlt warmstart ...``: SFT warm start of a zoo policy (``lightning_tlt.models.warmstart``).
- ``lightning-tlt export-drafter ...``: export a co-trained drafter for vLLM
  (``lightning_tlt.drafters.export.export_drafter``).
- ``lightning-tlt train-drafter ...``: train an EAGLE drafter offline on a task (a warm start),
  written for vLLM (``lightning_tlt.data.drafter_data.main``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from lightning.pytorch.cli import LightningCLI

from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.rl.common import RLModule

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "warmstart": ("lightning_tlt.models.warmstart", "main"),
    "export-drafter": ("lightning_tlt.drafters.export", "export_drafter"),
    "train-drafter": ("lightning_tlt.data.drafter_data", "main"),
}
"""Subcommands dispatched before LightningCLI: name -> (module, a ``main(argv)`` or a function to wrap)."""

CLI_SUBCOMMANDS = ("fit", "validate")

TRAINER_DEFAULTS: dict[str, Any] = {
    "log_every_n_steps": 1,  # one RL step is expensive: log every one, as TRL's logging_steps=1 users do
    "num_sanity_val_steps": 0,  # a sanity "validation" would be two whole rollouts before training
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}},
}


class TLTLightningCLI(LightningCLI):
    """LightningCLI limited to ``fit`` and ``validate``, with CSV logging and per-step logs by default."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: spec for name, spec in LightningCLI.subcommands().items() if name in CLI_SUBCOMMANDS}


def _run_helper(name: str, argv: list[str]) -> int:
    module_name, attr = SUBCOMMANDS[name]
    try:
        target: Callable[..., Any] = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        print(f"lightning-tlt {name}: not available ({err})", file=sys.stderr)
        return 2
    if attr == "main":
        return int(target(argv) or 0)
    from jsonargparse import CLI

    result = CLI(target, args=argv, as_positional=False)
    if result is not None:
        print(result)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-tlt``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return _run_helper(argv[0], argv[1:])
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lightning-tlt {fit,validate} --config CONFIG.yaml | lightning-tlt {warmstart,export-drafter,train-drafter} ...")
        print(__doc__)
        if not argv:
            return 0
    TLTLightningCLI(
        RLModule,
        RolloutDataModule,
        subclass_mode_model=True,
        trainer_defaults=TRAINER_DEFAULTS,
        args=argv,
        save_config_kwargs={"overwrite": True},
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
