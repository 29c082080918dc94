"""The ``lightning-tlt`` command: a small registry of subcommands, each importing what it needs when it runs.

``lightning-tlt --help`` and an unknown command answer at once (nothing heavy is imported here);
``fit``/``validate`` import Lightning and the RL modules (`lightning_tlt.trainer_cli`), ``warmstart``
and ``export-drafter`` their own modules.

A new subcommand is one registered function taking the arguments after its name and returning an
exit code; import inside it::

    @subcommand("my-command", "one line for lightning-tlt --help")
    def _my_command(argv: list[str]) -> int:
        from lightning_tlt.some.module import main

        return main(argv)
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Handler = Callable[[list[str]], int]
"""A subcommand: the arguments after its name in, an exit code out."""


@dataclass(frozen=True)
class Subcommand:
    """One ``lightning-tlt`` subcommand."""

    run: Handler
    """Called with the arguments after the subcommand's name."""
    help: str
    """One line for ``lightning-tlt --help``."""


SUBCOMMANDS: dict[str, Subcommand] = {}
"""The registered subcommands by name, in ``--help`` order."""


def subcommand(name: str, help: str) -> Callable[[Handler], Handler]:
    """Register the decorated function as ``lightning-tlt NAME``."""

    def register(fn: Handler) -> Handler:
        if name in SUBCOMMANDS:
            raise ValueError(f"lightning-tlt subcommand {name!r} is registered twice")
        SUBCOMMANDS[name] = Subcommand(fn, help)
        return fn

    return register


@subcommand("fit", "train an RL module from a YAML config (LightningCLI)")
def _fit(argv: list[str]) -> int:
    from lightning_tlt.trainer_cli import run

    return run(["fit", *argv])


@subcommand("validate", "evaluate a config's policy on its held-out prompts (LightningCLI)")
def _validate(argv: list[str]) -> int:
    from lightning_tlt.trainer_cli import run

    return run(["validate", *argv])


@subcommand("warmstart", "SFT warm start of a zoo policy on a task, cached on disk")
def _warmstart(argv: list[str]) -> int:
    from lightning_tlt.rl.warmstart import main

    return main(argv)


@subcommand("export-drafter", "write a checkpoint's co-trained drafter as a vLLM EAGLE draft directory")
def _export_drafter(argv: list[str]) -> int:
    from lightning_tlt.drafters.export import main

    return main(argv)


@subcommand("train-drafter", "train an EAGLE drafter offline on a task's rollouts or SFT data, saved for vLLM")
def _train_drafter(argv: list[str]) -> int:
    from lightning_tlt.data.drafter_data import main

    return main(argv)


def usage() -> str:
    """What ``lightning-tlt --help`` prints."""
    width = max(map(len, SUBCOMMANDS))
    lines = [
        f"usage: lightning-tlt {{{','.join(SUBCOMMANDS)}}} ...",
        "",
        "Fast RL training (GRPO, PPO) of reasoning LLMs on PyTorch Lightning, with speculative rollouts.",
        "",
        "commands:",
        *(f"  {name:<{width}}  {sub.help}" for name, sub in SUBCOMMANDS.items()),
        "",
        "examples:",
        "  lightning-tlt fit --config configs/demo_cpu.yaml",
        "  lightning-tlt fit --config configs/ppo_cpu.yaml --trainer.max_steps 8",
        "  lightning-tlt warmstart --task arithmetic --size tiny",
        "  lightning-tlt export-drafter --checkpoint_path RUN.ckpt --out_dir drafter/",
        "",
        "`lightning-tlt COMMAND --help` lists a command's options with their defaults. A config error is one line",
        "(fit and validate: `--debug` shows its traceback). Warm starts, compiled graphs and help texts are cached under",
        "$LIGHTNING_TLT_CACHE (default ~/.cache/lightning_tlt).",
    ]
    return "\n".join(lines)


def help_cache_path(name: str) -> Path:
    """Where ``lightning-tlt NAME --help`` is kept: under ``$LIGHTNING_TLT_CACHE`` (else ``~/.cache/lightning_tlt``),
    keyed by the kit's source files (path, size, mtime), the versions of the packages that write the help, and
    the terminal's width, so that an edit, an upgrade or a wider terminal writes it afresh."""
    from importlib.metadata import PackageNotFoundError, version

    key = hashlib.sha256()
    package = Path(__file__).parent
    for path in sorted(package.rglob("*.py")):
        stat = path.stat()
        key.update(f"{path.relative_to(package)}:{stat.st_size}:{stat.st_mtime_ns};".encode())
    for dist in ("lightning", "jsonargparse", "torch", "transformers"):
        try:
            key.update(f"{dist}={version(dist)};".encode())
        except PackageNotFoundError:
            key.update(f"{dist}=none;".encode())
    key.update(f"columns={shutil.get_terminal_size().columns}".encode())
    root = Path(os.environ.get("LIGHTNING_TLT_CACHE") or "~/.cache/lightning_tlt").expanduser()
    return root / "help" / f"{name}-{key.hexdigest()[:16]}.txt"


def _cached_help(name: str, sub: Subcommand) -> int:
    """``lightning-tlt NAME --help``: printed from the cache (a few ms); the first time, written by the subcommand
    (which imports Lightning, torch, ...: seconds) and kept."""
    path = help_cache_path(name)
    if path.is_file():
        print(path.read_text(), end="")
        return 0
    out = io.StringIO()
    code: int | str | None = 0
    with contextlib.redirect_stdout(out):
        try:
            code = sub.run(["--help"])
        except SystemExit as done:  # argparse and jsonargparse exit after printing help
            code = done.code
    text = out.getvalue()
    print(text, end="")
    if code in (0, None) and text:
        with contextlib.suppress(OSError):  # a read-only home: the help is still printed, only not kept
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(text)
            tmp.replace(path)
    return int(code or 0) if not isinstance(code, str) else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``lightning-tlt``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    sub = SUBCOMMANDS.get(argv[0])
    if sub is None:
        print(f"{usage()}\n\nlightning-tlt: error: unknown command {argv[0]!r}", file=sys.stderr)
        return 2
    if argv[1:] in (["--help"], ["-h"]):
        return _cached_help(argv[0], sub)
    return sub.run(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
