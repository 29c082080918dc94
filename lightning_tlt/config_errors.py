"""One-line config errors for ``lightning-tlt``: ``lightning-tlt <cmd>: error: <key>: <message>`` (exit 2).

jsonargparse reports a bad value inside a nested config as a tree of every union member it tried
(80-115 lines); a dataclass's ``__post_init__`` ``ValueError`` arrives wrapped in that tree too. This
module digs out the leaf (the message that says what is wrong) and the dotted key it belongs to, reads
YAML errors with their file and line, and lets negative numbers be values on the command line. The
traceback stays available behind ``--debug``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from lightning_tlt.core.cli_options import option_error

_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
_PARSER_KEY = re.compile(r'^\s*(?:- )?Parser key "([^"]+)":')
_CLASS = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")
_SUBTYPES = re.compile(r"Subtypes: \[<class '[\w.]*?(\w+)'>")
_NOISE = ("Does not validate against", "Subtypes:", "Errors:", "Given value", "Expected a <class 'NoneType'>",
          "Problem with given class_path")
_FIELD = re.compile(r"^(\w+)(?: and \w+)?(?:=| must | should | needs | is not | has )")


class ConfigError(ValueError):
    """A config value that cannot run here: reported as one line ``<key>: <message>``, without a traceback."""

    def __init__(self, key: str, message: str) -> None:
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}" if key else message)


def negative_numbers_as_values(argv: Sequence[str]) -> list[str]:
    """``--opt -1e-4`` as ``--opt=-1e-4``: argparse reads a token like ``-1e-4`` as an option name."""
    out: list[str] = []
    for arg in argv:
        if out and _NUMBER.match(arg) and out[-1].startswith("--") and "=" not in out[-1]:
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def check_yaml_files(argv: Sequence[str]) -> None:
    """Parse each ``--config FILE`` as YAML first, so that an error names the file and line (jsonargparse
    names ``<unicode string>``).

    Raises:
        ConfigError: keyed ``--config``, with ``FILE:LINE:COLUMN`` and the YAML parser's own words.
    """
    import yaml

    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg.partition("=")[2]
        if not (arg == "--config" or arg.startswith("--config=")) or not path:
            continue
        file = Path(path)
        if not file.is_file():
            raise ConfigError("--config", f"no such file: {path!r}")
        try:
            yaml.safe_load(file.read_text())
        except yaml.MarkedYAMLError as err:
            mark = err.problem_mark or err.context_mark
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else path
            problem = " ".join(str(p) for p in (err.context, err.problem) if p)
            raise ConfigError("--config", f"{where}: invalid YAML: {problem}") from None
        except yaml.YAMLError as err:
            raise ConfigError("--config", f"{path}: invalid YAML: {err}") from None


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _is_noise(line: str) -> bool:
    return not line.strip() or any(line.strip().lstrip("- ").startswith(n) for n in _NOISE) or bool(
        _PARSER_KEY.match(line))


def summarize(text: str, options: Iterable[str] = (), fields: dict[str, str] | None = None) -> ConfigError:
    """The `ConfigError` a jsonargparse error message (``ArgumentError``, or a ``ValueError`` raised while
    instantiating a config) comes down to: its deepest line and the dotted key above it.

    Args:
        text: the exception's message.
        options: the parser's option strings, to suggest one for an unrecognized argument.
        fields: the option that takes each config class (`config_fields`), to key an error of one; without it,
            a ``...Config`` is the RL modules' ``config``.
    """
    text = text.strip()
    found = option_error(text, options)
    if found is not None:
        return ConfigError(*found)
    lines = text.splitlines()
    leaves = [i for i, line in enumerate(lines) if not _is_noise(line)]
    if not leaves:
        return ConfigError("", lines[0] if lines else text)
    leaf = max(leaves, key=lambda i: (_indent(lines[i]), -i))
    keys: list[str] = []
    has_keys = any(_PARSER_KEY.match(line) for line in lines)
    depth = _indent(lines[leaf])
    for line in reversed(lines[:leaf]):  # the leaf's ancestors (and their headers), innermost first
        if _indent(line) > depth or not line.strip():
            continue
        # a header beside an ancestor names the union a value was tried against: the key, where none is given
        subtype = None if has_keys else _SUBTYPES.search(line)
        if subtype and subtype.group(1).endswith("Config"):
            keys.insert(0, (fields or {}).get(subtype.group(1), "config"))
        elif subtype and subtype.group(1).endswith("Module"):
            keys.insert(0, "model.init_args")
        if _indent(line) == depth:
            continue
        depth = _indent(line)
        match = _PARSER_KEY.match(line)
        if match:
            keys.insert(0, match.group(1))
        elif "Problem with given class_path" in line and keys and not _names_dataclass(line):
            keys.insert(0, "init_args")
    message = _CLASS.sub(r"\1", lines[leaf].strip().lstrip("- "))
    message = re.sub(r"^Expected a typing\.Literal\[(.*)\]\. Got value: (.*)$", r"expected one of \1, got \2", message)
    message = re.sub(r"^Expected a (.+?)\. Got value: (.*)$", r"expected \1, got \2", message)
    option = re.match(r"^Option '(\w+)' is not accepted$", message)
    if option:
        keys.append(option.group(1))
        paths = [m.group(1) for line in lines[:leaf] if (m := re.search(r"class_path '([\w.]+)'", line))]
        close = difflib.get_close_matches(option.group(1), _parameters(paths[-1]) if paths else [], n=1)
        message = f"unknown option (did you mean {close[0]}?)" if close else "unknown option (see --help)"
    field = _FIELD.match(message) or _FIELD.match(message.split(": ", 1)[-1])  # "<task>: difficulty must ..."
    if field and (not keys or keys[-1].split(".")[-1] != field.group(1)):
        keys.append(field.group(1))
    parts = ".".join(keys).split(".") if keys else []
    key = ".".join(p for i, p in enumerate(parts) if i == 0 or p != parts[i - 1])  # each level named once
    if key.startswith("model.") and not key.startswith("model.init_args") and key != "model.class_path":
        key = "model.init_args." + key[len("model."):]
    return ConfigError(key, message)


def _parameters(class_path: str) -> list[str]:
    """The ``__init__`` parameters of the class ``class_path`` names (its fields, for a dataclass)."""
    import importlib
    import inspect

    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError):
        return []


def config_fields(cls: type) -> dict[str, str]:
    """``{config class name: parameter}`` of ``cls.__init__`` (``{"SpeculativeConfig": "speculative", ...}``)."""
    import inspect

    found: dict[str, str] = {}
    for name, parameter in inspect.signature(cls).parameters.items():
        for match in re.findall(r"\b(\w+Config)\b", str(parameter.annotation)):
            found.setdefault(match, name)
    return found


def _names_dataclass(line: str) -> bool:
    """Whether a "Problem with given class_path 'X'" line names a dataclass (no ``init_args`` level)."""
    import dataclasses
    import importlib

    match = re.search(r"class_path '([\w.]+)'", line)
    if match is None:
        return False
    module, _, name = match.group(1).rpartition(".")
    try:
        return dataclasses.is_dataclass(getattr(importlib.import_module(module), name, None))
    except ImportError:
        return False


__all__ = ["ConfigError", "check_yaml_files", "config_fields", "negative_numbers_as_values", "summarize"]
