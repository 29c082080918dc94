"""`CUDAGraphProfileCache`: captured CUDA graphs keyed by a step profile, with bucketing and LRU.

A step of the engine (a plain decode, a speculative verify of ``k + 1`` tokens a row, a draft
step) has static shapes once its batch is padded to a *bucket*; each (phase, bucket, tokens per
row, extra) profile is captured once and replayed thereafter (vLLM's and TLT's recipe: one shared
memory pool, capture from the largest bucket down so smaller graphs reuse its memory). Without
CUDA, or when a capture fails, the step runs eagerly, with a warning, never a crash.

Graphs come in *groups* (``group_of``: by default a profile's phase; the engine's speculative graphs by
drafter too): a group is what is dropped together (a replaced drafter's graphs), and each group is captured
on a stream of its own that nothing else uses (`lightning_tlt.core.streams`). Removing any graph removes its
whole group: torch frees a capture stream's cuBLAS workspace when one graph captured on it is reset, while
every other graph captured on that stream still replays into it.

The bookkeeping (bucketing, keys, groups, LRU eviction under a memory budget, statistics, fallback) does
not depend on CUDA: a ``backend`` object does the capturing, so it can be exercised on the CPU.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from unittest import mock

import torch

from lightning_tlt.core.streams import EXCLUSIVE_STREAMS

DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512)
"""Batch sizes graphs are captured for; a batch is padded up to the nearest one."""


@dataclass(frozen=True, order=True)
class GraphProfile:
    """The key of a captured graph."""

    phase: str
    """"decode", "verify" or "draft"."""
    batch: int
    """The batch bucket (rows, padded)."""
    tokens_per_row: int = 1
    """Tokens each row feeds (1 for decode, k + 1 for verify)."""
    extra: tuple[Any, ...] = ()
    """Anything else the captured code depends on (sampling settings, a weight-layout version)."""


class CapturedGraph(Protocol):
    """What a backend returns for one capture (it may also have ``close()``: free it now)."""

    nbytes: int

    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """Captures a step function; `CUDAGraphBackend` on CUDA, anything with this shape in tests.

    ``group``: the capture's group (`CUDAGraphProfileCache`'s ``group_of``); a backend may also have
    ``release(group)``, which the cache calls once every graph of that group is closed.
    """

    def capture(
        self, fn: Callable[[], None], reset: Callable[[], None] | None = None, group: Hashable = ()
    ) -> CapturedGraph: ...


def phase_group(profile: GraphProfile) -> Hashable:
    """The default group of a profile: its phase."""
    return profile.phase


class _StreamHold:
    """A group's claim on its stream, kept by the backend and by every graph captured on the stream: the
    stream goes back to the pool only when the last of them goes (a graph destroyed later frees the
    stream's workspace, which must not be a later holder's by then)."""


@dataclass
class _CudaCaptured:
    graph: torch.cuda.CUDAGraph
    nbytes: int
    hold: _StreamHold | None = None

    def replay(self) -> None:
        self.graph.replay()

    def close(self) -> None:
        """Free the graph now (not whenever Python collects it), once its launches have finished: a replay
        runs on another stream than the one the freed memory belongs to (its capture stream, given back
        to the pool after this), so the allocator's stream ordering does not protect it."""
        torch.cuda.synchronize()
        self.graph.reset()


class CUDAGraphBackend:
    """Captures into ``torch.cuda.CUDAGraph`` objects that share one memory pool, each group of graphs on a
    stream of its own (`lightning_tlt.core.streams.EXCLUSIVE_STREAMS`: no other graph group and no drafter
    shares its cuBLAS workspace), warmed up there too.

    Args:
        device: the CUDA device.
        generators: device generators the captured code draws from; each is registered with every
            graph so that a replay draws fresh numbers from its current state.
        warmup_iters: eager runs (on a side stream) before a capture, as PyTorch requires (one is
            enough for compiled steps: the first run compiles, its kernels and workspaces are then set).
    """

    def __init__(
        self, device: torch.device, generators: Sequence[torch.Generator] = (), warmup_iters: int = 1
    ) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.generators = list(generators)
        self.warmup_iters = warmup_iters
        self._streams: dict[Hashable, tuple[Any, _StreamHold]] = {}

    def capture(
        self, fn: Callable[[], None], reset: Callable[[], None] | None = None, group: Hashable = ()
    ) -> CapturedGraph:
        """Warm up ``fn`` (eagerly, on ``group``'s stream), then capture it there.

        ``reset`` restores the state ``fn`` reads before each warm-up run and before the capture:
        a step is not idempotent (a verify advances its rows and leaves the catch-up block of the
        next step), so each run must see the state the live step will see.
        """
        if group not in self._streams:
            hold = _StreamHold()
            stream = EXCLUSIVE_STREAMS.acquire(self.device, f"CUDA graphs {group!r}", owner=hold)
            self._streams[group] = (stream, hold)
        stream, hold = self._streams[group]
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup_iters):
                if reset is not None:
                    reset()
                fn()
            if reset is not None:
                reset()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        # what the capture takes from the device: the allocator's reserve, and (device-wide) the
        # graph's own instantiation; the larger of the two (measured on the H200, the reserve alone
        # read 0: the shared pool had room from the warm-up)
        before = torch.cuda.memory_reserved(self.device)
        free_before, _ = torch.cuda.mem_get_info(self.device)
        graph = torch.cuda.CUDAGraph()
        for gen in self.generators:
            graph.register_generator_state(gen)
        with _cheap_capture(), torch.cuda.graph(graph, pool=self.pool, stream=stream):
            fn()
        torch.cuda.synchronize(self.device)
        free_after, _ = torch.cuda.mem_get_info(self.device)
        held = max(torch.cuda.memory_reserved(self.device) - before, free_before - free_after, 0)
        return _CudaCaptured(graph, held, hold)

    @property
    def streams(self) -> dict[Hashable, Any]:
        """The stream each group captures on (a copy)."""
        return {group: stream for group, (stream, _) in self._streams.items()}

    def release(self, group: Hashable) -> None:
        """Give ``group``'s stream back: every graph captured on it is closed (its workspace freed with them)."""
        held = self._streams.pop(group, None)
        if held is not None:
            EXCLUSIVE_STREAMS.release(self.device, held[0])


def _cheap_capture() -> contextlib.AbstractContextManager[Any]:
    """Around ``torch.cuda.graph``: its entry neither collects garbage nor empties the allocator's cache.

    Both free memory for one graph, at a cost paid per capture (a full ``gc.collect`` walks every
    Python object, Dynamo's caches included; emptying the cache makes the next allocations go back
    to the driver), while the engine captures dozens of graphs into one shared pool (vLLM's capture
    skips both the same way).
    """
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(gc, "collect", lambda *args, **kwargs: 0))
    stack.enter_context(mock.patch.object(torch.cuda, "empty_cache", lambda: None))
    return stack


def compile_seconds() -> float:
    """Seconds spent compiling in this process: Dynamo's (torch's own counter; 0 where it has none) and
    compiling versions ahead of time (`lightning_tlt.core.stored_compile`, which that counter misses)."""
    from lightning_tlt.core.stored_compile import stats

    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:  # pragma: no cover - a torch without the counter
        return stats()["compile_s"]
    return float(sum(compilation_time_metrics.get("_compile.compile_inner", ()))) + stats()["compile_s"]


@dataclass
class GraphStats:
    """Counters of a `CUDAGraphProfileCache`."""

    captures: int = 0
    replays: int = 0
    hits: int = 0
    misses: int = 0
    eager_runs: int = 0
    failures: int = 0
    evictions: int = 0
    bytes: int = 0
    capture_time_s: float = 0.0
    """Seconds in captures, their warm-up runs (and any compiling those did) included."""
    compile_time_s: float = 0.0
    """The part of ``capture_time_s`` that Dynamo spent compiling (a first use of a step function)."""
    captured: list[GraphProfile] = field(default_factory=list)

    def as_dict(self) -> dict[str, float]:
        return {
            "captures": self.captures, "replays": self.replays, "hits": self.hits, "misses": self.misses,
            "eager_runs": self.eager_runs, "failures": self.failures, "evictions": self.evictions,
            "bytes": self.bytes, "capture_time_s": self.capture_time_s, "compile_time_s": self.compile_time_s,
        }


class CUDAGraphProfileCache:
    """Graphs keyed by `GraphProfile`, batches padded to buckets, LRU-evicted under a memory budget.

    Args:
        backend: what captures; ``None`` runs every step eagerly (no CUDA, or graphs turned off).
        buckets: allowed batch sizes, ascending; `bucket` pads a batch up to the nearest one.
        max_batch: the largest batch served; buckets above it are dropped and it is added.
        memory_budget_bytes: evict least recently used graphs while their bytes exceed this (a whole group at
            a time).
        group_of: a profile's group (see the module docstring): graphs dropped together share one.
    """

    def __init__(
        self,
        backend: GraphBackend | None = None,
        *,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        max_batch: int | None = None,
        memory_budget_bytes: int | None = None,
        group_of: Callable[[GraphProfile], Hashable] = phase_group,
    ) -> None:
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"buckets must be non-empty positive batch sizes, got {tuple(buckets)!r}")
        if max_batch is not None and max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch!r}")
        if memory_budget_bytes is not None and memory_budget_bytes < 0:
            raise ValueError(f"memory_budget_bytes must be >= 0 or None, got {memory_budget_bytes!r}")
        b = sorted(set(buckets))
        if max_batch is not None:
            b = [x for x in b if x < max_batch] + [max_batch]
        self.buckets: tuple[int, ...] = tuple(b)
        self.backend = backend
        self.memory_budget_bytes = memory_budget_bytes
        self.group_of = group_of
        self.stats = GraphStats()
        self._graphs: OrderedDict[GraphProfile, CapturedGraph] = OrderedDict()
        self._failed: set[GraphProfile] = set()

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    def bucket(self, batch: int) -> int:
        """The smallest bucket ``>= batch``."""
        if not 1 <= batch <= self.buckets[-1]:
            raise ValueError(f"batch must be in [1, {self.buckets[-1]}], got {batch!r}")
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def __contains__(self, profile: GraphProfile) -> bool:
        return profile in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def profiles(self) -> list[GraphProfile]:
        """The profiles captured now, least recently replayed first."""
        return list(self._graphs)

    def run(self, profile: GraphProfile, fn: Callable[[], None], *, capture: bool = True) -> None:
        """Replay ``profile``'s graph, capturing ``fn`` first on a miss (when ``capture``).

        ``fn`` must work on static buffers only (its inputs and outputs live in tensors that
        outlast the graph). A failed capture is remembered: that profile then runs eagerly.
        """
        graph = self._graphs.get(profile)
        if graph is not None:
            self._graphs.move_to_end(profile)
            self.stats.hits += 1
            self.stats.replays += 1
            graph.replay()
            return
        self.stats.misses += 1
        if self.backend is None or not capture or profile in self._failed:
            self.stats.eager_runs += 1
            fn()
            return
        graph = self._capture(profile, fn)
        if graph is None:
            self.stats.eager_runs += 1
            fn()
        else:
            self.stats.replays += 1
            graph.replay()

    def capture(
        self,
        profiles: Sequence[GraphProfile],
        fn_for: Callable[[GraphProfile], Callable[[], None]],
        reset: Callable[[], None] | None = None,
    ) -> None:
        """Capture ``profiles`` ahead of use, largest batch first (so smaller graphs reuse its pool).

        ``reset`` restores the state the steps read, before each warm-up run and the capture.
        """
        if self.backend is None:
            return
        for profile in sorted(profiles, key=lambda p: (-p.batch, p)):
            if profile not in self._graphs and profile not in self._failed:
                self._capture(profile, fn_for(profile), reset)

    def _capture(
        self, profile: GraphProfile, fn: Callable[[], None], reset: Callable[[], None] | None = None
    ) -> CapturedGraph | None:
        assert self.backend is not None
        start, compiled = time.perf_counter(), compile_seconds()
        try:
            graph = self.backend.capture(fn, reset, group=self.group_of(profile))
        except Exception as err:  # noqa: BLE001 - any capture failure means: run this profile eagerly
            self._failed.add(profile)
            self.stats.failures += 1
            warnings.warn(f"CUDA graph capture of {profile} failed ({err!r}); running it eagerly", stacklevel=3)
            return None
        self.stats.capture_time_s += time.perf_counter() - start
        self.stats.compile_time_s += compile_seconds() - compiled
        self.stats.captures += 1
        self.stats.captured.append(profile)
        self._graphs[profile] = graph
        self.stats.bytes += graph.nbytes
        self._evict(keep=profile)
        return graph

    def _evict(self, keep: GraphProfile) -> None:
        """Evict the least recently replayed groups (never ``keep``'s) while over the budget."""
        if self.memory_budget_bytes is None:
            return
        kept = self.group_of(keep)
        while self.stats.bytes > self.memory_budget_bytes:
            group = next((g for g in map(self.group_of, self._graphs) if g != kept), None)
            if group is None:
                break
            self.stats.evictions += self._remove_groups({group})

    def _remove_groups(self, groups: set[Hashable]) -> int:
        """Close every graph of ``groups`` and give their streams back; returns how many graphs."""
        doomed = [p for p in self._graphs if self.group_of(p) in groups]
        for profile in doomed:
            graph = self._graphs.pop(profile)
            self.stats.bytes -= graph.nbytes
            close = getattr(graph, "close", None)
            if close is not None:
                close()
        release = getattr(self.backend, "release", None)
        if release is not None:
            for group in groups:
                release(group)
        return len(doomed)

    def drop(self, which: Callable[[GraphProfile], bool]) -> int:
        """Free the graphs whose profile ``which`` selects (e.g. those of a replaced drafter), with the rest of
        their groups (see the module docstring); returns how many were freed."""
        count = self._remove_groups({self.group_of(p) for p in self._graphs if which(p)})
        self._failed = {p for p in self._failed if not which(p)}
        return count

    def clear(self) -> None:
        """Drop every graph (e.g. after the policy's parameters were replaced by new tensors)."""
        self._remove_groups({self.group_of(p) for p in self._graphs})
        self._failed.clear()
        self.stats.bytes = 0
