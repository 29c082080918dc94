"""The option style of ``lightning-tlt``'s own subcommands (``warmstart``, ``export-drafter``, ``train-drafter``).

One style with ``fit``, whose options LightningCLI spells with underscores (``--trainer.max_steps``): each
option is ``--out_dir``, and ``--out-dir`` is accepted too. Help shows each default; an error is one line,
``lightning-tlt <cmd>: error: <option>: <message>`` (exit 2), without the usage block (``--help`` has it).
Nothing heavy is imported here.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn


def option_error(message: str, options: Iterable[str]) -> tuple[str, str] | None:
    """``(option, message)`` for argparse's "unrecognized arguments: --x ..." (with the closest known option) and
    "argument --x: expected one argument"; ``None`` for any other message."""
    unknown = re.match(r"unrecognized arguments: (\S+)", message)
    if unknown:
        flag = unknown.group(1).split("=")[0]
        close = difflib.get_close_matches(flag, list(options), n=1, cutoff=0.8)
        hint = f" (did you mean {close[0]}?)" if close else " (options are not abbreviated; see --help)"
        return flag, f"unknown option{hint}"
    expected_one = re.match(r"argument (\S+?)(?:, \S+)*: expected one argument", message)
    if expected_one:  # "-c/--config" or "--out_dir, --out-dir": name the long spelling
        return expected_one.group(1).split("/")[-1], "expected a value after it"
    return None


class DefaultsFormatter(argparse.HelpFormatter):
    """Help that shows each option's default (unless it is ``None``, ``False`` or already said)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)".strip()


class OptionParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` in ``lightning-tlt``'s style: `add_option` and one-line errors."""

    def __init__(self, prog: str, description: str) -> None:
        super().__init__(prog=prog, description=description, formatter_class=DefaultsFormatter, allow_abbrev=False)

    def add_option(self, name: str, **kwargs: Any) -> argparse.Action:
        """``--name_with_underscores``, with ``--name-with-hyphens`` as an alias when it differs."""
        if "help" not in kwargs and kwargs.get("default") not in (None, False):
            kwargs["help"] = "(default: %(default)s)"  # argparse shows no help line for an option without help
        flag = "--" + name.replace("-", "_")
        alias = "--" + name.replace("_", "-")
        return self.add_argument(flag, *([alias] if alias != flag else []), **kwargs)

    def error(self, message: str) -> NoReturn:
        found = option_error(message, self._option_string_actions)
        if found is not None:
            message = ": ".join(found)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


__all__ = ["DefaultsFormatter", "OptionParser", "option_error"]
