"""CUDA streams that no other part of the kit shares: the drafter's side stream, and one stream per group of
captured rollout graphs.

Why a stream must not be shared. ``torch.cuda.Stream()`` hands out streams round-robin from a pool of 32 per
device and priority, so the 33rd stream made is the first one again. cuBLAS keeps one workspace per (handle,
stream); a CUDA graph replays into the workspace of the stream it was *captured* on, whatever stream replays
it; and in recent torch (pytorch/pytorch#175276, February 2026) resetting a graph frees its capture
stream's workspace (``CUDAGraph::reset`` calls ``clearCublasWorkspacesForStream``), even while other live
graphs captured on that stream still replay into it (pytorch/pytorch#193402). The engine captured each graph
on a fresh pool stream (55 graphs over 32 streams) and the drafter trained on another pool stream, so:

- a rollout graph captured on the drafter's stream replayed into the workspace the drafter's concurrent steps
  were writing (two split-K GEMMs on one scratch buffer: wrong numbers, or a kernel that never ends);
- with a torch that frees on reset, dropping a replaced drafter's graphs freed the workspace of every graph
  captured on the same pool streams, which then replayed into memory the allocator had handed to something
  else. (torch 2.11 on an H100 does not: ``benchmarks/graph_streams.py`` freed 0 bytes on a reset.)

The e2e's TLT arm stalled on the GPU in exactly that shape (one drafter step in flight, the main stream
waiting), intermittently, across sessions; with the streams held, its next 60 steps on an H100 (three seeds)
ran without a stall. `ExclusiveStreams` hands each user a pool stream no other user of
it holds; `lightning_tlt.rollout.cuda_graphs.CUDAGraphProfileCache` captures each *group* of graphs (what is
dropped together) on one such stream and always drops a group whole.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["EXCLUSIVE_STREAMS", "ExclusiveStreams"]

_POOL_SIZE = 32
"""Streams torch's pool holds per device and priority (``kStreamsPerPool``)."""


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class ExclusiveStreams:
    """Pool streams handed out so that no two holders share one.

    Args:
        factory: makes a stream for a device (``torch.cuda.Stream``; a fake in the CPU tests). Each call
            may return a stream that is already held (the pool repeats): those are skipped.
        device_index: the index a device maps to (``torch.cuda.current_device()`` for a bare ``"cuda"``).
    """

    def __init__(
        self,
        factory: Callable[[torch.device], Any] | None = None,
        device_index: Callable[[torch.device], int] = _device_index,
    ) -> None:
        self._factory = factory if factory is not None else (lambda device: torch.cuda.Stream(device=device))
        self._device_index = device_index
        self._held: dict[tuple[int, int], _Hold] = {}

    def acquire(self, device: torch.device, purpose: str, owner: object | None = None) -> Any:
        """A stream of ``device`` that no other holder has, held for ``purpose`` (named in errors) until
        `release`, or until ``owner`` is garbage-collected when one is given.

        Raises:
            RuntimeError: every stream of the pool is held, after a garbage collection gave back those
                whose owners were garbage (naming the holders).
        """
        index = self._device_index(device)
        for attempt in range(2):
            for _ in range(2 * _POOL_SIZE):  # one full turn of the pool visits every stream
                stream = self._factory(device)
                key = (index, int(stream.cuda_stream))
                if key not in self._held:
                    hold = self._held[key] = _Hold(purpose)
                    if owner is not None:  # given back when the owner goes, unless given back before
                        hold.finalizer = weakref.finalize(owner, self._drop, key, hold)
                    return stream
            if attempt == 0:  # owners that are garbage but not yet collected (an engine in a reference cycle)
                gc.collect()
        holders = sorted(h.purpose for (i, _), h in self._held.items() if i == index)
        raise RuntimeError(f"no CUDA stream of device {index} is free for {purpose}: the pool's streams are "
                           f"held by {holders}")  # fmt: skip

    def release(self, device: torch.device, stream: Any) -> None:
        """Give ``stream`` back (a stream not held is ignored)."""
        hold = self._held.pop((self._device_index(device), int(stream.cuda_stream)), None)
        if hold is not None and hold.finalizer is not None:
            hold.finalizer.detach()  # its owner's end must not give back a later holder's stream

    def _drop(self, key: tuple[int, int], hold: _Hold) -> None:
        if self._held.get(key) is hold:
            del self._held[key]

    def holders(self) -> list[str]:
        """What each held stream is held for (every device)."""
        return sorted(h.purpose for h in self._held.values())


class _Hold:
    """One holder's claim on a stream: its purpose, and the finalizer that gives it back with its owner."""

    def __init__(self, purpose: str) -> None:
        self.purpose = purpose
        self.finalizer: weakref.finalize | None = None


EXCLUSIVE_STREAMS = ExclusiveStreams()
"""The process's exclusive streams (the drafter's side streams, the rollout graphs' capture streams)."""
