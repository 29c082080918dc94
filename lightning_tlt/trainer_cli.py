"""``lightning-tlt fit`` and ``validate``: LightningCLI over the RL modules and `RolloutDataModule`.

Every typed ``__init__`` argument of the module (``model: class_path: lightning_tlt.rl.grpo.GRPOModule``
or ``PPOModule``) and of the datamodule (``data:``) is a YAML key. Before any class is built (the
policy's warm start is an SFT run), the parsed config is checked for what would otherwise fail
late: a GPU config on a machine without a GPU, an unknown task name or difficulty, a ``--ckpt_path``
that does not exist or is not a sound checkpoint (unreadable, truncated, or a tensor failing its
checksum: `lightning_tlt.core.checksums`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import warnings
from argparse import ArgumentError
from typing import Any

import torch
from jsonargparse import ArgumentParser, Namespace
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException
from typing_extensions import override

from lightning_tlt.callbacks.interrupt_checkpoint import exit_code
from lightning_tlt.config_errors import (
    ConfigError,
    check_yaml_files,
    config_fields,
    negative_numbers_as_values,
    summarize,
)
from lightning_tlt.core.checksums import CheckpointCorruptError, load_checkpoint
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.data.sources import DataSourceError, describe_source, load_reward_func
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
        self._argv = list(args or [])
        try:
            self.config = parser.parse_args(args)
        except (ArgumentError, ValueError, TypeError) as err:  # a bad value: one line, not jsonargparse's tree
            raise summarize(str(err), _option_strings(parser, self._argv[:1])) from err
        # before LightningCLI itself reads the checkpoint (for its hyperparameters), and before any class is built
        subcommand = self.config.get("subcommand")
        check_ckpt_path(_get(self.config[subcommand], "ckpt_path") if subcommand else None)

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_devices(config, command_line=self._argv)
        check_model(_get(config, "model"))
        check_data(_get(config, "data"))

    @override
    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:  # a class's own validation (``__post_init__``, ``__init__``)
            raise summarize(str(err)) from err


def _option_strings(parser: Any, subcommand: list[str]) -> list[str]:
    """The options of ``lightning-tlt <subcommand>`` (to suggest one for a misspelled flag)."""
    action = getattr(parser, "_subcommands_action", None)
    sub = action._name_parser_map.get(subcommand[0]) if action is not None and subcommand else None
    return [opt for opt in (sub or parser)._option_string_actions if opt.startswith("--")]


def check_data(data: Any) -> None:
    """Build the datamodule of a parsed ``data:`` before the policy (it is cheap: no file is read and no rollout
    runs), so that a bad option, task, path or reward function is refused before a warm start.

    Raises:
        ConfigError: keyed ``data.<option>``, with the datamodule's own message.
    """
    if not isinstance(data, Namespace):
        return
    for key in ("dataset", "eval_dataset"):
        if isinstance(data.get(key), str):
            try:
                describe_source(data[key])
            except DataSourceError as err:
                raise ConfigError(f"data.{key}", str(err)) from None
    for func in data.get("reward_funcs") or []:
        if isinstance(func, str):
            try:
                load_reward_func(func)
            except DataSourceError as err:
                raise ConfigError("data.reward_funcs", str(err)) from None
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(RolloutDataModule, "data")
    try:
        parser.instantiate(parser.parse_object({"data": data.clone().as_dict()}))
    except (ArgumentError, ValueError, TypeError) as err:
        found = summarize(str(err), fields=config_fields(RolloutDataModule))
        key = found.key if found.key.startswith("data") else ".".join(filter(None, ("data", found.key)))
        raise ConfigError(key, found.message) from err


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


def check_devices(config: Any, cuda_available: bool | None = None, command_line: list[str] | None = None) -> None:
    """Refuse a config that asks for a GPU (``trainer.accelerator`` or the warm start's ``device``) without one.

    Args:
        config: the parsed config.
        cuda_available: stands in for ``torch.cuda.is_available()`` (tests).
        command_line: the arguments given, to tell a request made there from one in the config file.

    Raises:
        ConfigError: one line saying no GPU was found, where the request came from (the command line or the
            config file) and what runs on the CPU instead.
    """
    available = torch.cuda.is_available() if cuda_available is None else cuda_available
    if available:
        return
    flags = [a.split("=")[0] for a in command_line or [] if a.startswith("--")]
    wants: list[tuple[str, str, bool]] = []  # (key, value, given on the command line)
    accelerator = _get(config, "trainer", "accelerator")
    if isinstance(accelerator, str) and accelerator.lower() in ("gpu", "cuda"):
        wants.append(("trainer.accelerator", accelerator, "--trainer.accelerator" in flags))
    device = _get(config, "model", "init_args", "policy", "warm_start", "device")
    if isinstance(device, str) and device.startswith("cuda"):
        wants.append(("model.init_args.policy.warm_start.device", device,
                      any(f.startswith("--model.init_args.policy") for f in flags)))
    if not wants:
        return
    no_gpu = "no GPU found (torch.cuda.is_available() is False)"
    key, value, on_command_line = wants[0]
    if on_command_line:
        raise ConfigError(key, f"{no_gpu}, but the command line asks for one (--{key} {value}); leave it out or "
                               f"give --{key} cpu")
    asks = ", ".join(f"{'.'.join(k.split('.')[-2:]) if k.endswith('device') else k}={v}" for k, v, _ in wants)
    raise ConfigError(
        key, f"{no_gpu}, but {_config_name(config)} asks for one ({asks}); on a CPU run {' or '.join(CPU_CONFIGS)}"
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
        found = summarize(str(err))
        raise ConfigError(f"model.init_args.policy.{found.key}".rstrip("."), found.message) from None
    for name in ("max_completion_length", "response_length"):  # GRPOConfig's, PPOConfig's
        length = _get(model, "init_args", "config", name)
        if isinstance(length, int):
            try:
                check_completion_length(spec, length, name)
            except ValueError as err:
                raise ConfigError(f"model.init_args.config.{name}", str(err)) from None


NOISE_WARNINGS = (
    r".*isinstance\(treespec, LeafSpec\)",  # torch's deprecation, raised inside Lightning, every run
    r"Your `IterableDataset` has `__len__` defined",  # the rollout stream runs in the main process only
)
"""Warnings that every ``lightning-tlt fit`` would print and that say nothing about the user's run."""


class _NoTips(logging.Filter):
    """Drops Lightning's advertisements ("💡 Tip: ... try installing litlogger") from the console."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def _quiet_known_noise() -> None:
    for message in NOISE_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    rank_zero_logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _NoTips) for f in rank_zero_logger.filters):
        rank_zero_logger.addFilter(_NoTips())


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
        raise ConfigError("ckpt_path", f"no checkpoint at {os.fspath(ckpt_path)!r}") from None
    except CheckpointCorruptError as err:
        raise ConfigError("ckpt_path", str(err)) from None


def run(argv: list[str]) -> int:
    """``lightning-tlt fit|validate ...``: run LightningCLI on ``argv`` (subcommand first).

    A config error is one line, ``lightning-tlt <cmd>: error: <key>: <message>`` (exit 2); ``--debug`` shows
    its traceback instead. Options are never abbreviated, and ``--opt -1e-4`` reads ``-1e-4`` as the value.
    """
    debug = "--debug" in argv
    _quiet_known_noise()
    argv = negative_numbers_as_values([a for a in argv if a != "--debug"])
    try:
        check_yaml_files(argv)
        TLTLightningCLI(
            RLModule,
            RolloutDataModule,
            subclass_mode_model=True,
            trainer_defaults=TRAINER_DEFAULTS,
            args=argv,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"prog": "lightning-tlt", "exit_on_error": False, "allow_abbrev": False},
        )
    except ConfigError as err:
        if debug:
            raise
        print(f"lightning-tlt {argv[0]}: error: {err}", file=sys.stderr)
        return 2
    except SIGTERMException:  # Lightning's own stop on SIGTERM (InterruptCheckpoint exits 143 itself)
        return exit_code(signal.SIGTERM)
    return 0
