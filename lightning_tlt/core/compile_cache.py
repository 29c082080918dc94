"""The engine's persistent compile cache: a restart reuses what the last run compiled.

PyTorch keeps Inductor's and AOTAutograd's results (the Triton kernels inside them included) in a
cache under the system temp folder: shared by every program of the user, gone with the machine's
temp files, and not the run's own. The engine keeps its own copy in the kit's cache directory
(`default_cache_dir`): after a ``generate`` call that compiled something, `CompileCache.save`
writes what PyTorch recorded (``torch.compiler.save_cache_artifacts``) to one file keyed by what
the compiled code depends on (the model's shapes, the dtype, the device, torch's and Triton's
versions); the next process loads it before its first compile (``load_cache_artifacts``) and its
compiles hit. Dynamo's tracing still runs (seconds); Inductor's code generation, Triton's compiling
and autotuning do not.

A file is a magic line, a JSON header (the key, and each blob's length and SHA-256), then the
blobs. A file of another key, a checksum that does not match, an unreadable header or blob: one
warning, the file is removed and rebuilt by the next save; never an error, and never a wrong
output (PyTorch's own entries are keyed by the code they compile: a stale one cannot hit).

Off with ``compile_cache=False`` on the engine or ``LIGHTNING_TLT_COMPILE_CACHE=0``.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

MAGIC = b"lightning-tlt compile cache\n"
FORMAT = 1
MAX_BLOBS = 8
"""Blobs kept in one file (each process that compiled something new appends its own)."""
ENV_VAR = "LIGHTNING_TLT_COMPILE_CACHE"
"""``0``, ``false``, ``off`` or ``no`` turns the cache off; a path puts it there."""

_loaded: set[Path] = set()  # files loaded in this process (PyTorch's caches hold them from then on)


OFF_WORDS = ("0", "false", "off", "no")
"""What an environment switch of the kit's compiling may say to turn its feature off."""


def env_off(name: str) -> bool:
    """Whether the environment variable ``name`` turns a feature off (one of `OFF_WORDS`, any case)."""
    return os.environ.get(name, "").strip().lower() in OFF_WORDS


def default_cache_dir() -> Path:
    """The kit's cache directory: ``$LIGHTNING_TLT_CACHE`` if set, else ``~/.cache/lightning_tlt``."""
    env = os.environ.get("LIGHTNING_TLT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_tlt"


def resolve_cache_dir(setting: bool | str | os.PathLike[str] | None) -> Path | None:
    """Where compiled steps are cached, or ``None`` (off).

    ``setting``: ``False`` off; a path there; ``None`` or ``True``: ``$LIGHTNING_TLT_COMPILE_CACHE``
    if it names a path (or turns the cache off), else ``<default_cache_dir()>/compile``.
    """
    if setting is False:
        return None
    if setting is not None and setting is not True:
        return Path(setting).expanduser()
    if env_off(ENV_VAR):
        return None
    env = os.environ.get(ENV_VAR, "").strip()
    if env and env.lower() not in ("1", "true", "on", "yes"):
        return Path(env).expanduser()
    return default_cache_dir() / "compile"


def library_versions() -> dict[str, str]:
    """Versions the compiled code depends on (part of every key)."""
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        versions["triton"] = str(triton.__version__)
    except ImportError:
        versions["triton"] = "none"
    return versions


def device_key(device: torch.device) -> str:
    """The device's name and compute capability (``cpu`` for the CPU)."""
    if device.type != "cuda":
        return device.type
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} sm_{major}{minor}"


def write_framed(path: Path, magic: bytes, header: Mapping[str, Any], payloads: Sequence[bytes]) -> None:
    """Write ``magic``, ``header`` as one JSON line, then ``payloads``, atomically (a temporary file renamed
    over ``path``: a reader never sees half a file). Raises ``OSError``; no temporary file is left behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(magic + json.dumps(header, default=str).encode() + b"\n")
            for payload in payloads:
                f.write(payload)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_framed(path: Path, magic: bytes, key: Mapping[str, Any], what: str) -> tuple[dict[str, Any], bytes]:
    """A file `write_framed` wrote: its header and the bytes after it. Raises ``ValueError`` if it is not a
    ``what`` file or its header's key is not ``key`` (``OSError``, ``json.JSONDecodeError`` as they come)."""
    data = path.read_bytes()
    if not data.startswith(magic):
        raise ValueError(f"not a {what} file")
    end = data.index(b"\n", len(magic))
    header = json.loads(data[len(magic) : end])
    if header.get("key") != json.loads(json.dumps(key, default=str)):
        raise ValueError("written for another model, device or library version")
    return header, data[end + 1 :]


class CompileCache:
    """One cache file for one key.

    Args:
        directory: the folder of cache files (created on save).
        key: what the compiled code depends on (JSON-serialisable); library versions are added.
        name: the file's readable prefix.
    """

    def __init__(self, directory: Path, key: Mapping[str, Any], name: str = "steps") -> None:
        self.key = {**dict(key), "versions": library_versions(), "format": FORMAT}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.path = Path(directory) / f"{name}-{digest}.bin"
        self._blobs: list[bytes] = []  # what the file held when loaded (kept on save)
        self.loaded = False
        """Whether a valid file was loaded into PyTorch's caches by this object."""

    # ------------------------------------------------------------------ load
    def load(self) -> bool:
        """Load the file into PyTorch's caches (once per process and file); returns whether it did."""
        if self.path in _loaded:
            return False
        _loaded.add(self.path)
        if not self.path.exists():
            return False
        try:
            blobs = self._read()
        except (OSError, ValueError, json.JSONDecodeError) as err:
            self._discard(f"{err}")
            return False
        for blob in blobs:
            try:
                ok = torch.compiler.load_cache_artifacts(blob) is not None
            except Exception as err:  # noqa: BLE001 - whatever PyTorch raises on it: the cache is unusable
                ok, why = False, repr(err)
            else:
                why = "PyTorch could not read its artifacts"
            if not ok:
                self._discard(why)
                return False
        self._blobs = blobs
        self.loaded = True
        return True

    def _read(self) -> list[bytes]:
        header, body = read_framed(self.path, MAGIC, self.key, "compile cache")
        blobs, at = [], 0
        for i, meta in enumerate(header["blobs"]):
            blob = body[at : at + int(meta["bytes"])]
            at += len(blob)
            if len(blob) != int(meta["bytes"]) or hashlib.sha256(blob).hexdigest() != meta["sha256"]:
                raise ValueError(f"blob {i} is truncated or corrupt (checksum mismatch)")
            blobs.append(blob)
        return blobs  # every blob checked before any is handed to PyTorch

    def _discard(self, why: str) -> None:
        warnings.warn(f"compile cache {self.path} is unusable ({why}); compiling afresh and rebuilding it",
                      stacklevel=3)
        self.path.unlink(missing_ok=True)

    # ------------------------------------------------------------------ save
    def save(self) -> bool:
        """Write what PyTorch recorded in this process beside what was loaded; returns whether it wrote.

        Atomic (a temporary file renamed over the old one): a reader never sees half a file.
        """
        try:
            result = torch.compiler.save_cache_artifacts()
        except Exception as err:  # noqa: BLE001 - a cache that cannot be written costs the next start, not this run
            warnings.warn(f"could not serialise the compile cache for {self.path}: {err!r}", stacklevel=2)
            return False
        if result is None:
            return False
        new = result[0]
        blobs = [b for b in self._blobs if b != new][-(MAX_BLOBS - 1) :] + [new]
        header = {"key": self.key, "blobs": [{"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for b in blobs]}
        try:
            write_framed(self.path, MAGIC, header, blobs)
        except OSError as err:
            warnings.warn(f"could not write the compile cache {self.path}: {err}", stacklevel=2)
            return False
        self._blobs = blobs
        return True


__all__ = [
    "OFF_WORDS", "CompileCache", "default_cache_dir", "device_key", "env_off", "library_versions", "read_framed",
    "resolve_cache_dir", "write_framed",
]
