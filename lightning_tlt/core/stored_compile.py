"""Compiled step functions whose Dynamo output is stored: a restart skips tracing, not only code generation.

`lightning_tlt.core.compile_cache.CompileCache` keeps Inductor's artifacts, so a restart generates
and compiles no kernel again; but Dynamo still traces every step function through the policy's
layers, and that is most of what a warm restart costs (the H200, the e2e's TLT shape: about 15 of a
warm first call's 22 s; the CPU, the 0.5 B policy's decode and verify forwards: 9.4 s of tracing).
`StoredCompile` stands for ``torch.compile(fn, fullgraph=True, dynamic=...)`` but compiles each
version of ``fn`` ahead of time (``torch.compile(fn).aot_compile``: the traced bytecode, its guards
and the compiled graph, serialisable) and writes it to the compile cache directory; the next process
loads the file and runs it without tracing.

**Versions.** A call runs the first version whose guards accept its arguments (the checks Dynamo
makes before it reuses a compile: dtypes, ranks, the sizes it specialised, constants such as the
sampling settings, ``None`` against a tensor). When none does, a new version is compiled and stored.
Sizes marked dynamic (``dynamic=True``, or ``dynamic_dims``) are symbolic in a version: every batch
bucket is one version, as with ``torch.compile``. Tensors are never marked at a call (a version
loaded from disk refuses marked tensors); ``dynamic_dims`` marks views of the first call's arguments
when a version is compiled.

**Safety.** A file holds a magic line, a JSON header (the key: the caller's, the function's name,
torch's, Triton's and Python's versions; the SHA-256 of the payload; the SHA-256 of the source of
every module whose code Dynamo traced into the version) and the payload. A file of another key, a
payload whose checksum fails, a traced module whose source differs from the one installed now (an
edited or upgraded kit or library), a file torch cannot load: one warning, the file is removed and
the version compiled afresh; never an error, and never a stale graph run. Where torch cannot compile
a function ahead of time (no ``aot_compile``, or it raises on the function), that function falls back
to plain ``torch.compile`` with one warning: slower restarts, the same outputs.

Off with ``LIGHTNING_TLT_COMPILE_AOT=0`` (plain ``torch.compile``; the Inductor cache stays on), or
with the compile cache itself (``compile_cache=False``, ``LIGHTNING_TLT_COMPILE_CACHE=0``).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from lightning_tlt.core.compile_cache import env_off, library_versions, read_framed, write_framed

MAGIC = b"lightning-tlt stored compile\n"
FORMAT = 1
ENV_VAR = "LIGHTNING_TLT_COMPILE_AOT"
"""``0``, ``false``, ``off`` or ``no``: compile with plain ``torch.compile`` (restarts trace again)."""
MAX_VERSIONS = 64
"""Versions one function may compile in a process (the engine's recompile limit; past it, plain
``torch.compile``), and may keep on disk (past it, the least recently used files are deleted)."""

DynamicDims = Callable[..., Mapping[int, Sequence[int]]]
"""``(*args) -> {argument index: dims}``: the sizes of a call's tensor arguments to compile as dynamic."""

_STATS: dict[str, float] = {"compile_s": 0.0, "load_s": 0.0, "compiled": 0, "loaded": 0, "discarded": 0,
                            "fell_back": 0}
_BY_FUNCTION: dict[str, dict[str, float]] = {}


class _Held:
    """The versions of one function and key held in this process: shared by every `StoredCompile` of them
    (a second engine in the process runs what the first compiled or loaded, as ``torch.compile`` would)."""

    def __init__(self) -> None:
        self.versions: list[Any] = []
        self.loaded = False
        self.compiled = 0  # versions compiled in this process: the cap (loaded ones a run never uses don't count)
        self.files: dict[int, Path] = {}  # id(version) -> its file, until this process first uses it
        self.paths: set[Path] = set()  # files loaded or written by this process (`refresh` loads only newer ones)


_HELD: dict[Path, _Held] = {}


def reset() -> None:
    """Forget the versions held in this process (the next call loads them from disk, as a new process would)."""
    _HELD.clear()


def refresh() -> None:
    """Look again for stored versions at each function's next miss: another process (a background compile,
    `lightning_tlt.rollout.background_compile`) may have stored some since this one loaded the folder. The files
    this process already holds are not loaded twice."""
    for held in _HELD.values():
        held.loaded = False


def stats() -> dict[str, float]:
    """This process's totals: ``compile_s`` (versions compiled ahead of time, tracing and code generation),
    ``load_s`` (files read and loaded), and the counts ``compiled``, ``loaded``, ``discarded`` and
    ``fell_back`` (functions compiled with plain ``torch.compile`` instead: their restarts trace again)."""
    return dict(_STATS)


def stats_by_function() -> dict[str, dict[str, float]]:
    """This process's compiles ahead of time by function name: ``compile_s`` (each try, one that fell back
    included) and ``compiled`` (versions): where a cold start's compiling went."""
    return {name: dict(figures) for name, figures in _BY_FUNCTION.items()}


def frozen_view(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` as a compiled region should take a trainable module: the same structure over the same storage
    (an optimizer's in-place step shows through), every parameter a detached alias with no ``.grad`` and
    ``requires_grad=False``, buffers and plain attributes shared; modules it holds outside its registry (an
    EAGLE drafter's reference to the policy's embedding and head) viewed alike.

    A version's guards hold its arguments' tensors, and torch (2.11 on the H100) cannot store a version
    whose guarded parameter has a ``.grad``: "assigned grad expected to be a Tensor or None" when the guards
    are read back, so a co-trained drafter's regions were compiled again in every process (10 s at the
    e2e's first speculative step) and never by the background compile. Keep the view while `storage_key`
    stays the same: a new view object is a new guard input."""
    return _view(module, {})


def _view(module: torch.nn.Module, memo: dict[int, torch.nn.Module]) -> torch.nn.Module:
    if id(module) in memo:  # a module reached twice (or a cycle) has one view
        return memo[id(module)]
    view = memo[id(module)] = copy.copy(module)  # a new instance, its __dict__ a shallow copy
    view._parameters = {name: None if p is None else torch.nn.Parameter(p.detach(), requires_grad=False)
                        for name, p in module._parameters.items()}
    view._buffers = dict(module._buffers)
    view._modules = {name: None if m is None else _view(m, memo) for name, m in module._modules.items()}
    for name, held in _held_modules(module).items():
        object.__setattr__(view, name, _view(held, memo))
    return view


def _held_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modules ``module`` holds as plain attributes, outside its registry (by attribute name)."""
    return {name: value for name, value in vars(module).items() if isinstance(value, torch.nn.Module)}


def storage_key(module: torch.nn.Module) -> tuple[int, ...]:
    """Where every parameter a `frozen_view` of ``module`` aliases lives: a view stays valid while this does."""
    seen: set[int] = set()
    key: list[int] = []

    def walk(m: torch.nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        key.extend(p.data_ptr() for p in m._parameters.values() if p is not None)
        for child in (*m._modules.values(), *_held_modules(m).values()):
            if child is not None:
                walk(child)

    walk(module)
    return tuple(key)


class FrozenViewCache:
    """One module's `frozen_view` at a time, kept while the module object and its storage (`storage_key`) stay:
    a new view object is a new guard input, so a compiled region must be handed the same one call after call."""

    def __init__(self) -> None:
        self._entry: tuple[tuple[int, ...], torch.nn.Module] | None = None

    def __call__(self, module: torch.nn.Module) -> torch.nn.Module:
        key = (id(module), *storage_key(module))
        if self._entry is None or self._entry[0] != key:
            self._entry = (key, frozen_view(module))
        return self._entry[1]


def aot_enabled() -> bool:
    """Whether versions are compiled ahead of time and stored: torch has the API and `ENV_VAR` allows it."""
    if env_off(ENV_VAR):
        return False
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction  # noqa: F401
    except ImportError:  # pragma: no cover - a torch older than the API
        return False
    return True


def _module_digest(name: str) -> str | None:
    """SHA-256 of a module's source as installed now (``None``: not importable or no source)."""
    module = sys.modules.get(name)
    try:
        if module is None:
            import importlib

            module = importlib.import_module(name)
        return hashlib.sha256(inspect.getsource(module).encode()).hexdigest()
    except (ImportError, OSError, TypeError):
        return None


def _touch(path: Path) -> None:
    """Mark ``path`` used now, to the nanosecond (the kernel's own file times are coarse: a few milliseconds
    apart, two files would tie)."""
    now = time.time_ns()
    with contextlib.suppress(OSError):
        os.utime(path, ns=(now, now))


class StoredCompile:
    """``torch.compile(fn, fullgraph=True, dynamic=dynamic)``, its versions stored in ``directory``.

    Args:
        fn: the function (a module-level function: its name and module are part of the key).
        directory: the compile cache directory, or ``None``: plain ``torch.compile``, nothing stored.
        key: what the compiled code depends on besides ``fn`` and the library versions (model shapes,
            dtype, device...), JSON-serialisable.
        dynamic: ``torch.compile``'s ``dynamic``.
        dynamic_dims: which sizes of a call's tensors to compile as dynamic (`DynamicDims`).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        directory: Path | None,
        key: Mapping[str, Any] | None = None,
        dynamic: bool | None = None,
        dynamic_dims: DynamicDims | None = None,
    ) -> None:
        self.fn = fn
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.dynamic = dynamic
        self.dynamic_dims = dynamic_dims
        self.key = {**dict(key or {}), "function": self.name, "versions": library_versions(), "format": FORMAT}
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.folder = None if directory is None else Path(directory) / "aot" / f"{fn.__name__}-{digest}"
        self._plain: Callable[..., Any] | None = None
        if self.folder is None or not aot_enabled():
            self._plain = torch.compile(fn, fullgraph=True, dynamic=dynamic)
        self._held = _Held() if self.folder is None else _HELD.setdefault(self.folder, _Held())

    @property
    def stored(self) -> bool:
        """Whether versions are compiled ahead of time and stored (else plain ``torch.compile``)."""
        return self._plain is None

    @property
    def num_versions(self) -> int:
        """Versions held in this process (loaded or compiled)."""
        return len(self._held.versions)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._plain is not None:
            self._mark(args, in_place=True)
            return self._plain(*args, **kwargs)
        version = self._find(args, kwargs)
        if version is None and not self._held.loaded:
            self._load()
            version = self._find(args, kwargs)
        if version is None:
            version = self._compile(args, kwargs)
            if version is None:  # fell back to plain torch.compile
                return self(*args, **kwargs)
        return version(*args, **kwargs)

    def _find(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        for version in self._held.versions:
            if version.guard_check(*args, **kwargs):
                path = self._held.files.pop(id(version), None)
                if path is not None:  # first use of a loaded version: its file is recently used again
                    _touch(path)
                return version
        return None

    def _mark(self, args: tuple[Any, ...], in_place: bool) -> tuple[Any, ...]:
        """``args`` with the `dynamic_dims` marked: on the tensors themselves, or on aliases of them.

        An alias is ``detach()`` (with the tensor's ``requires_grad``, which the version's guards check), not
        a view: Dynamo reads a view's marked sizes from its ``_base``, and the version's guards would then
        read ``_base`` of every later argument, which a tensor that is no view lacks (every call would
        compile a new version)."""
        if self.dynamic_dims is None:
            return args
        out = list(args)
        for index, dims in self.dynamic_dims(*args).items():
            if dims:
                tensor = out[index] if in_place else out[index].detach().requires_grad_(out[index].requires_grad)
                torch._dynamo.maybe_mark_dynamic(tensor, list(dims))
                out[index] = tensor
        return tuple(out)

    # ------------------------------------------------------------------ compile and store
    def _compile(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._held.compiled >= MAX_VERSIONS:
            return self._fall_back(f"more than {MAX_VERSIONS} versions compiled in this process")
        start = time.perf_counter()
        try:
            # floats specialised: a float argument made a tensor asks Dynamo to restart its analysis, which the
            # ahead-of-time path cannot (the sampling settings are constants of a run anyway). No automatic
            # dynamic shapes: what Dynamo remembers of earlier compiles of the same code made later versions'
            # guards reject the very arguments they were compiled for (`size()` of an argument that is None),
            # and a first process sampled one token other than its restart did (CPU, T=1) until it was off;
            # the dynamic sizes are the ones asked for (``dynamic``, `DynamicDims`), in every version.
            # No duck shaping: sizes that happen to be equal in the first call (a batch equal to the slots, k + 1
            # equal to a buffer's width) were unified into one symbol, and each later call where they differ
            # compiled a version of its own (the speculative step's verify update: 13 versions for 5 batches x 4
            # draft lengths on the CPU, 2 without).
            # Sizes size-oblivious: a dynamic size is not specialised to 1 (Dynamo's default gives a batch of 1
            # or a one-token query a version of its own), where torch has the option.
            oblivious = {"backed_size_oblivious": True} if hasattr(fx_config, "backed_size_oblivious") else {}
            no_duck_shapes = fx_config.patch(use_duck_shape=False, **oblivious)  # type: ignore[attr-defined]
            with torch._dynamo.config.patch(enable_aot_compile=True, specialize_float=True,
                                            automatic_dynamic_shapes=False), no_duck_shapes:
                # made under the flag: torch 2.11 gives the wrapper its `aot_compile` only when it is on
                compiled = torch.compile(self.fn, fullgraph=True, dynamic=self.dynamic)
                version = compiled.aot_compile((self._mark(args, in_place=False), kwargs))  # type: ignore[attr-defined]
        except Exception as err:  # noqa: BLE001 - whatever the AOT path cannot do, plain torch.compile may
            return self._fall_back(repr(err))
        finally:
            seconds = time.perf_counter() - start
            _STATS["compile_s"] += seconds
            mine = _BY_FUNCTION.setdefault(self.fn.__name__, {"compile_s": 0.0, "compiled": 0})
            mine["compile_s"] += seconds
        version.disable_guard_check()  # `_find` checked them
        self._held.versions.append(version)
        self._held.compiled += 1
        _STATS["compiled"] += 1
        mine["compiled"] += 1
        self._store(version)
        return version

    def _fall_back(self, why: str) -> None:
        warnings.warn(f"could not compile {self.name} ahead of time ({why}); compiling it with torch.compile "
                      "(a restart traces it again)", stacklevel=4)
        self._plain = torch.compile(self.fn, fullgraph=True, dynamic=self.dynamic)
        _STATS["fell_back"] += 1
        return None

    def _store(self, version: Any) -> None:
        """Write ``version`` to its file (atomically); a version that cannot be stored only costs the next start."""
        assert self.folder is not None
        try:
            payload = type(version).serialize(version).serialized_data
            modules = sorted({s.module for s in version.source_info().inlined_sources})
            # the guards must load in this torch (2.11 pickled some guard sources it could not read back)
            import pickle

            pickle.loads(version._artifacts.guards_state)
        except Exception as err:  # noqa: BLE001 - not stored: the next process compiles this version again
            warnings.warn(f"could not store a compiled version of {self.name} ({err!r})", stacklevel=4)
            return
        sources = {name: _module_digest(name) for name in modules}
        digest = hashlib.sha256(payload).hexdigest()
        header = {"key": self.key, "sources": sources, "bytes": len(payload), "sha256": digest}
        path = self.folder / f"{digest[:16]}.bin"
        self._held.paths.add(path)
        try:
            write_framed(path, MAGIC, header, [payload])
        except OSError as err:
            warnings.warn(f"could not write {path}: {err}", stacklevel=4)
            return
        _touch(path)
        self._prune(keep=path)

    def _prune(self, keep: Path) -> None:
        """Delete the least recently used files past `MAX_VERSIONS` (versions of sizes no run asks for any more
        would otherwise be loaded, and checked against every call, by every later process)."""
        assert self.folder is not None
        try:
            files = self._files_oldest_first()
        except OSError:
            return
        for path in [p for p in files if p != keep][: max(0, len(files) - MAX_VERSIONS)]:
            with contextlib.suppress(OSError):
                path.unlink()

    def _files_oldest_first(self) -> list[Path]:
        """The folder's stored versions, least recently used first (`_touch` marks a use)."""
        assert self.folder is not None
        return sorted(self.folder.glob("*.bin"), key=lambda p: (p.stat().st_mtime_ns, p.name))

    # ------------------------------------------------------------------ load
    def _load(self) -> None:
        """Load every stored version of this function (once per process and folder), oldest first."""
        self._held.loaded = True
        if self.folder is None or not self.folder.is_dir():
            return
        from torch._dynamo.aot_compile import AOTCompiledFunction
        from torch._inductor import config as inductor_config

        start = time.perf_counter()
        for path in self._files_oldest_first():
            if path in self._held.paths:
                continue  # held already (loaded before a `refresh`, or written by this process)
            self._held.paths.add(path)
            try:
                payload = self._read(path)
                # kernels loaded in this process, with no compile-worker pool: loading a version's Triton
                # kernels asks for Inductor's pool (one process a core, each importing torch and Triton for
                # seconds), which has nothing to compile. On an H100 host a warm restart's steady calls took
                # 0.49 s against 0.12 s cold with the same 76 ms of GPU kernels, its CPU ops starved (a sort
                # of the draft vocabulary 196 ms against 1 ms): the booting pool, by torch's code and a CPU
                # reproduction. A version compiled later starts the pool as usual.
                with inductor_config.patch(compile_threads=1):
                    version = AOTCompiledFunction.deserialize(payload, self.fn.__globals__)
            except Exception as err:  # noqa: BLE001 - a file this process cannot use is rebuilt, never fatal
                self._discard(path, err)
                continue
            version.disable_guard_check()
            self._held.versions.append(version)
            self._held.files[id(version)] = path
            _STATS["loaded"] += 1
        _STATS["load_s"] += time.perf_counter() - start

    def _read(self, path: Path) -> bytes:
        header, payload = read_framed(path, MAGIC, self.key, "stored compile")
        if len(payload) != int(header["bytes"]) or hashlib.sha256(payload).hexdigest() != header["sha256"]:
            raise ValueError("truncated or corrupt (checksum mismatch)")
        stale = [name for name, digest in header["sources"].items() if _module_digest(name) != digest]
        if stale:
            raise ValueError(f"compiled from other source code of {', '.join(stale)}")
        return payload

    def _discard(self, path: Path, why: BaseException) -> None:
        _STATS["discarded"] += 1
        warnings.warn(f"stored compile {path} is unusable ({why}); compiling afresh and replacing it", stacklevel=5)
        path.unlink(missing_ok=True)


class CompileStore:
    """Where a layout's compiled step functions are stored: one directory and one key for all of them.

    Args:
        directory: the compile cache directory (``None``: plain ``torch.compile``, nothing stored).
        key: what the compiled code depends on (model shapes, dtype, device, attention backend...).
    """

    def __init__(self, directory: Path | None, key: Mapping[str, Any] | None = None) -> None:
        self.directory = directory
        self.key = dict(key or {})

    def compile(
        self, fn: Callable[..., Any], *, dynamic: bool | None = None, dynamic_dims: DynamicDims | None = None
    ) -> StoredCompile:
        """``fn`` compiled (see `StoredCompile`)."""
        return StoredCompile(fn, directory=self.directory, key=self.key, dynamic=dynamic, dynamic_dims=dynamic_dims)


__all__ = ["ENV_VAR", "CompileStore", "DynamicDims", "FrozenViewCache", "StoredCompile", "aot_enabled", "frozen_view", "refresh", "reset",
           "stats", "stats_by_function", "storage_key"]
