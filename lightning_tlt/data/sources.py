"""A user's own prompts and reward functions, named by strings that a YAML config can hold.

``data.dataset`` (and ``data.eval_dataset``) of `RolloutDataModule` is a zoo task name or one of:

- a ``.json`` (a list of objects), ``.jsonl``, ``.parquet`` or ``.csv`` file;
- a directory written by ``datasets.Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: a split is
  taken), or a directory of such data files (one split per file name, as ``datasets.load_dataset`` reads it);
- a Hugging Face Hub dataset id (``owner/name``) already in the local HF cache: resolved offline
  (``huggingface_hub.snapshot_download(..., local_files_only=True)``), never downloaded here.

Rows follow TRL's prompt-only formats: a ``prompt`` column holding a string (standard) or a list of
``{"role", "content"}`` messages (conversational); every other column reaches the reward functions as a
keyword argument, one value per completion (TRL's convention).

``data.reward_funcs`` entries may be import paths: ``package.module:function`` (or
``package.module.function``), the module importable or found under the working directory, or
``path/to/file.py:function``. Each error names the file, column or key, and what is allowed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

FILE_FORMATS = (".json", ".jsonl", ".parquet", ".csv")
"""The file suffixes ``data.dataset`` reads."""


class DataSourceError(ValueError):
    """A dataset or reward function that a config names cannot be used; the message says why and what is allowed."""


def is_task_name(source: str) -> bool:
    """Whether ``source`` names a registered zoo task (cheap: no dataset is built)."""
    from lightning_tlt.tasks import TASKS

    return source in TASKS


def describe_source(source: str) -> str:
    """How a dataset string will be read ("task", "file", "directory" or "hub"), without reading it.

    Raises:
        DataSourceError: a path-like string that does not exist, a file of another format, or a string
            that is none of a task name, a path and an ``owner/name`` hub id.
    """
    if is_task_name(source):
        return "task"
    path = Path(source).expanduser()
    if path.is_dir():
        return "directory"
    if path.is_file():
        if path.suffix.lower() not in FILE_FORMATS:
            raise DataSourceError(f"{source!r} is a {path.suffix or 'suffix-less'} file; data files may be "
                                  f"{', '.join(FILE_FORMATS)}")
        return "file"
    file_like = path.suffix.lower() in (*FILE_FORMATS, ".txt", ".tsv", ".arrow", ".gz", ".zip", ".yaml", ".yml")
    if file_like or source.startswith((".", "/", "~")) or ("/" in source and path.parent.is_dir()):
        raise DataSourceError(f"no such file or directory: {source!r} (relative to {os.getcwd()})")
    if _looks_like_hub_id(source):
        return "hub"
    from lightning_tlt.tasks import TASKS

    raise DataSourceError(
        f"unknown task {source!r}; registered tasks: {sorted(TASKS)} (or give a {'/'.join(FILE_FORMATS)} file, "
        "a datasets.save_to_disk directory or an owner/name dataset in the local HF cache)"
    )


def _looks_like_hub_id(source: str) -> bool:
    parts = source.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") and " " not in p for p in parts)


def load_prompts(source: str, *, split: str = "train") -> Dataset:
    """The prompt dataset a string names (see the module docstring); ``split`` picks one of several.

    Raises:
        DataSourceError: an unreadable file (with its line for JSON), a missing split (naming those there),
            a hub id not in the local cache, no ``prompt`` column (naming the columns), or no rows.
    """
    kind = describe_source(source)
    if kind == "task":
        raise DataSourceError(f"{source!r} is a zoo task: build it with its task (RolloutDataModule does)")
    path = Path(source).expanduser()
    if kind == "file":
        data = _read_file(path)
    elif kind == "directory":
        data = _read_directory(path, split)
    else:
        data = _read_directory(_hub_snapshot(source), split, name=source)
    check_prompt_column(data, source)
    return data


def check_prompt_column(data: Any, source: str = "the dataset") -> None:
    """Refuse a dataset without a ``prompt`` column or without rows, naming the columns it has."""
    columns = list(getattr(data, "column_names", []) or [])
    if "prompt" not in columns:
        raise DataSourceError(
            f"{source} has no 'prompt' column (TRL's prompt-only format: a string, or a list of "
            f"{{'role', 'content'}} messages); its columns are {columns}"
        )
    if len(data) == 0:
        raise DataSourceError(f"{source} has no rows")


def _read_file(path: Path) -> Dataset:
    from datasets import Dataset

    suffix = path.suffix.lower()
    if suffix in (".json", ".jsonl"):
        return Dataset.from_list(_read_json(path))
    try:
        reader = Dataset.from_parquet if suffix == ".parquet" else Dataset.from_csv
        data = reader(str(path))
    except Exception as err:  # pyarrow's own errors: several types, each with a message worth showing
        raise DataSourceError(f"{path}: cannot read it as {suffix[1:]}: {type(err).__name__}: {err}") from err
    assert isinstance(data, Dataset)
    return data


def _read_json(path: Path) -> list[dict[str, Any]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".json" and not text.lstrip().startswith("{"):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise DataSourceError(f"{path}:{err.lineno}:{err.colno}: invalid JSON: {err.msg}") from None
        if not isinstance(rows, list):
            raise DataSourceError(f"{path}: a .json file must hold a list of objects, got a {type(rows).__name__}")
        lines = [(1, row) for row in rows]
    else:  # JSON Lines (a .json file of objects one per line is read the same way)
        lines = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                lines.append((number, json.loads(line)))
            except json.JSONDecodeError as err:
                raise DataSourceError(f"{path}:{number}:{err.colno}: invalid JSON: {err.msg}") from None
    for number, row in lines:
        if not isinstance(row, dict):
            raise DataSourceError(f"{path}:{number}: each row must be an object, got {json.dumps(row)[:60]}")
    return [row for _, row in lines]


def _read_directory(path: Path, split: str, name: str | None = None) -> Dataset:
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    name = name or str(path)
    if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
        data = load_from_disk(str(path))
        if isinstance(data, DatasetDict):
            return _split(data, split, name)
        assert isinstance(data, Dataset)
        return data
    try:
        loaded = load_dataset(str(path))
    except Exception as err:  # datasets raises several types for a folder it cannot infer a format for
        raise DataSourceError(
            f"{name}: not a datasets.save_to_disk directory, and its data files cannot be read "
            f"({type(err).__name__}: {err})"
        ) from err
    assert isinstance(loaded, DatasetDict)
    return _split(loaded, split, name)


def _split(data: Any, split: str, name: str) -> Dataset:
    if split not in data:
        raise DataSourceError(f"{name} has no split {split!r}; its splits are {sorted(data)}")
    return data[split]  # type: ignore[no-any-return]


def _hub_snapshot(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, repo_type="dataset", local_files_only=True))
    except Exception as err:  # LocalEntryNotFoundError and kin: the message below says what to do
        raise DataSourceError(
            f"hub dataset {repo_id!r} is not in the local HF cache (it is read offline); download it first with "
            f"`hf download --repo-type dataset {repo_id}` or give a file"
        ) from err


def load_reward_func(spec: str) -> Callable[..., Any]:
    """The reward function an import path names: ``pkg.module:func``, ``pkg.module.func`` or ``file.py:func``.

    Raises:
        DataSourceError: naming the path, what failed (module, file or attribute), and the accepted forms.
    """
    forms = "give package.module:function or path/to/file.py:function"
    module_name, sep, attr = spec.rpartition(":") if ":" in spec else spec.rpartition(".")
    if not sep or not module_name or not attr:
        raise DataSourceError(f"reward function {spec!r} is not an import path; {forms}")
    if module_name.endswith(".py"):
        module = _module_from_file(Path(module_name).expanduser(), spec)
    else:
        module = _import(module_name, spec, forms)
    func = getattr(module, attr, None)
    if func is None:
        public = sorted(n for n in vars(module) if not n.startswith("_") and callable(vars(module)[n]))
        raise DataSourceError(f"reward function {spec!r}: {module_name} has no {attr!r}; it has {public}")
    if not callable(func):
        raise DataSourceError(f"reward function {spec!r} is a {type(func).__name__}, not a function")
    return func  # type: ignore[no-any-return]


def _import(module_name: str, spec: str, forms: str) -> Any:
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:  # `lightning-tlt` runs from its own script directory: look in the working directory too
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and not module_name.startswith(err.name) and err.name != module_name:
            raise  # the user's module imports something missing: their traceback, not ours
        raise DataSourceError(f"reward function {spec!r}: no module named {module_name!r} "
                              f"(searched sys.path and {cwd}); {forms}") from None
    finally:
        if added:
            sys.path.remove(cwd)


def _module_from_file(path: Path, spec: str) -> Any:
    if not path.is_file():
        raise DataSourceError(f"reward function {spec!r}: no such file {str(path)!r} (relative to {os.getcwd()})")
    name = f"lightning_tlt_rewards_{path.stem}_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    assert loader_spec is not None and loader_spec.loader is not None
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # before exec: dataclasses and pickling look the module up by name
    loader_spec.loader.exec_module(module)
    return module


def resolve_reward_funcs(funcs: Any) -> list[Callable[..., Any]]:
    """Each entry a callable, or an import path string loaded with `load_reward_func`."""
    return [load_reward_func(f) if isinstance(f, str) else f for f in funcs]


__all__ = [
    "FILE_FORMATS",
    "DataSourceError",
    "check_prompt_column",
    "describe_source",
    "is_task_name",
    "load_prompts",
    "load_reward_func",
    "resolve_reward_funcs",
]
