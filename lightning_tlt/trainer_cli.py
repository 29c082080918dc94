"""``lightning-tlt fit`` and ``validate``: LightningCLI over the RL modules and `RolloutDataModule`.

Every typed ``__init__`` argument of the module (``model: class_path: lightning_tlt.rl.grpo.GRPOModule``
or ``PPOModule``) and of the datamodule (``data:``) is a YAML key. Before any class is built (the
policy's warm start is an SFT run), the parsed config is checked for what would otherwise fail
late: a GPU config on a machine without a GPU, an unknown task name or difficulty, a ``--ckpt_path``
that does not exist or is not a sound checkpoint (unreadable, truncated, or a tensor failing its
checksum: `lightning_tlt.core.checksums`).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
from jsonargparse import Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_tlt.callbacks.interrupt_checkpoint import exit_code
from lightning_tlt.core.checksums import CheckpointCorruptError, load_checkpoint
from lightning_tlt.data.datamodule import RolloutDataModule, check_task_names
from lightning_tlt.rl.common import PolicySpec, RLModule, check_completion_length

LIGHTNING_SUBCOMMANDS = ("fit", "validate")
"""The LightningCLI subcommands ``lightning-tlt`` offers."""

CPU_CONFIGS = ("configs/demo_cpu.yaml", "configs/demo_cpu_eagle.yaml", "configs/ppo_cpu.yaml")
"""The shipped configs that run on a CPU (named when a GPU config meets a machine without a GPU)."""

TRAINER_DEFAULTS: dict[str, Any] = {
    "log_every_n_steps": 1,  # one RL step is expensive: log every one, as TRL's logging_steps=1 users do
    "num_sanity_val_steps": 0,  # a sanity "validation" would be two whole rollouts before training
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs"}},
}


class ConfigError(ValueError):
    """A parsed config that cannot run here; reported in one line, without a traceback."""


class TLTLightningCLI(LightningCLI):
    """LightningCLI limited to ``fit`` and ``validate``, with CSV logging and per-step logs by default."""

    @staticmethod
    @override
    def subcommands() -> dict[str, set[str]]:
        return {name: spec for name, spec in LightningCLI.subcommands().items() if name in LIGHTNING_SUBCOMMANDS}

    @override
    def parse_arguments(self, parser: Any, args: Any) -> None:
        # LightningCLI warns when both ``args`` and sys.argv hold arguments; ``lightning-tlt`` passes sys.argv
        # on as ``args`` (after its own subcommand dispatch), so the warning would greet every call
        self.config = parser.parse_args(args)
        # before LightningCLI itself reads the checkpoint (for its hyperparameters), and before any class is built
        subcommand = self.config.get("subcommand")
        check_ckpt_path(_get(self.config[subcommand], "ckpt_path") if subcommand else None)

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_devices(config)
        check_model(_get(config, "model"))
        try:
            check_task_names(_get(config, "data", "dataset"), _get(config, "data", "eval_dataset"),
                             _get(config, "data", "difficulty") or 1)
        except ValueError as err:
            raise ConfigError(f"data: {err}") from None


def _get(node: Any, *keys: str) -> Any:
    """``node[k1][k2]...`` through parsed namespaces and dicts; ``None`` where a key is missing."""
    for key in keys:
        if not isinstance(node, (Namespace, dict)) or key not in node:
            return None
        node = node[key]
    return node


def _config_name(config: Any) -> str:
    paths = _get(config, "config") or []
    if not paths:
        return "this config"
    return str(getattr(paths[-1], "relative", None) or os.fspath(paths[-1]))  # as the user wrote it


def check_devices(config: Any, cuda_available: bool | None = None) -> None:
    """Refuse a config that asks for a GPU (``trainer.accelerator`` or the warm start's ``device``) without one.

    Raises:
        ConfigError: one line saying no GPU was found and which shipped configs run on the CPU.
    """
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if available:
        return
    wants = []
    accelerator = _get(config, "trainer", "accelerator")
    if isinstance(accelerator, str) and accelerator.lower() in ("gpu", "cuda"):
        wants.append(f"trainer.accelerator={accelerator}")
    device = _get(config, "model", "init_args", "policy", "warm_start_kwargs", "device")
    if isinstance(device, str) and device.startswith("cuda"):
        wants.append(f"warm_start_kwargs.device={device}")
    if wants:
        raise ConfigError(
            f"no GPU found (torch.cuda.is_available() is False), but {_config_name(config)} asks for one "
            f"({', '.join(wants)}); on a CPU run {' or '.join(CPU_CONFIGS)}"
        )


def check_model(model: Any) -> None:
    """Check the policy spec and the completion budget of a parsed ``model:`` before the policy is built.

    Raises:
        ConfigError: the `PolicySpec`'s or `check_completion_length`'s message, prefixed with its key.
    """
    policy = _get(model, "init_args", "policy")
    if not isinstance(policy, Namespace) or "class_path" in policy:  # a module given by class path: not checked
        return
    try:
        spec = PolicySpec(**policy.as_dict())
    except (TypeError, ValueError) as err:
        raise ConfigError(f"model.init_args.policy: {err}") from None
    for name in ("max_completion_length", "response_length"):  # GRPOConfig's, PPOConfig's
        length = _get(model, "init_args", "config", name)
        if isinstance(length, int):
            try:
                check_completion_length(spec, length, name)
            except ValueError as err:
                raise ConfigError(f"model.init_args.config: {err}") from None


LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")
"""``ckpt_path`` values that Lightning resolves itself (checked when it loads them)."""


def check_ckpt_path(ckpt_path: Any) -> None:
    """Refuse a ``--ckpt_path`` that is missing, unreadable, truncated or corrupt, before any class is built.

    The file is memory-mapped and every tensor checked against its checksum (about a second per few GB),
    so a damaged checkpoint stops the run before the warm start, and before anything is written.

    Raises:
        ConfigError: one line naming the file and, for a checksum mismatch, the first bad tensor.
    """
    if ckpt_path is None or (isinstance(ckpt_path, str) and ckpt_path.split(":")[0] in LIGHTNING_CKPT_NAMES):
        return
    try:
        load_checkpoint(os.fspath(ckpt_path))
    except FileNotFoundError:
        raise ConfigError(f"ckpt_path: no checkpoint at {os.fspath(ckpt_path)!r}") from None
    except CheckpointCorruptError as err:
        raise ConfigError(f"ckpt_path: {err}") from None


def run(argv: list[str]) -> int:
    """``lightning-tlt fit|validate ...``: run LightningCLI on ``argv`` (subcommand first)."""
    try:
        TLTLightningCLI(
            RLModule,
            RolloutDataModule,
            subclass_mode_model=True,
            trainer_defaults=TRAINER_DEFAULTS,
            args=argv,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "lightning-tlt"},
        )
    except ConfigError as err:
        print(f"lightning-tlt {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except SIGTERMException:  # Lightning's own stop on SIGTERM (InterruptCheckpoint exits 143 itself)
        return exit_code(signal.SIGTERM)
    return 0
