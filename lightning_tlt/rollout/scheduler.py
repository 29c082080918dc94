"""Host-side slot bookkeeping for continuous batching.

Requests wait in a FIFO queue; a request admitted to the engine takes a KV-cache slot. Active
requests are kept *packed* in slots ``0..n-1``: when some finish, the last active rows move into
the holes (one batched KV copy on the device), so a decode step over ``n`` rows works on the first
``bucket(n)`` slots with no gather. All of this is host-side Python over small lists; it runs
between steps, never inside the captured step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """One completion to generate."""

    index: int
    """Position of the completion in the output (prompt-major: all samples of prompt 0 first)."""
    prompt_index: int
    """Which prompt it continues."""
    prompt: tuple[int, ...]
    """The prompt's token ids."""
    key: int = 0
    """Its sampling noise key (`lightning_tlt.core.sampling.row_keys`): what it draws depends on nothing else."""


class SlotScheduler:
    """FIFO admission into ``num_slots`` slots, with active rows packed at the front."""

    def __init__(self, num_slots: int, requests: Iterable[Request] = ()) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self.queue: deque[Request] = deque(requests)
        self.active: list[Request] = []
        """``active[i]`` is the request in slot ``i``."""

    @property
    def num_active(self) -> int:
        return len(self.active)

    @property
    def num_queued(self) -> int:
        return len(self.queue)

    @property
    def done(self) -> bool:
        return not self.queue and not self.active

    def admit(self) -> list[tuple[int, Request]]:
        """Move queued requests into the free slots; returns ``(slot, request)`` pairs."""
        admitted: list[tuple[int, Request]] = []
        while self.queue and len(self.active) < self.num_slots:
            request = self.queue.popleft()
            admitted.append((len(self.active), request))
            self.active.append(request)
        return admitted

    def release(self, slots: Iterable[int]) -> tuple[list[Request], list[tuple[int, int]]]:
        """Free finished ``slots`` and repack; returns the finished requests and ``(src, dst)`` moves.

        ``finished[i]`` is the request that was in ``slots[i]``, in the caller's order (a caller reads
        the rows' outputs in that same order; the engine's harvest one step late asks for slots in the
        order of an older snapshot, which repacking has since permuted). Each move says: the request in
        slot ``src`` now lives in slot ``dst`` (``dst < src``); the caller copies that slot's device
        state (KV cache, step state) accordingly.
        """
        order = list(slots)
        if len(set(order)) != len(order) or any(not 0 <= s < len(self.active) for s in order):
            raise ValueError(f"slots must be distinct active slots in [0, {len(self.active)}), got {order!r}")
        done = [self.active[s] for s in order]
        keep = len(self.active) - len(order)
        finished_set = set(order)
        holes = sorted(s for s in order if s < keep)
        movers = [s for s in range(keep, len(self.active)) if s not in finished_set]
        assert len(holes) == len(movers)
        moves = list(zip(movers, holes))
        for src, dst in moves:
            self.active[dst] = self.active[src]
        del self.active[keep:]
        return done, moves

    def siblings(self, prompt_index: int, exclude: int | None = None) -> list[int]:
        """Active slots continuing ``prompt_index`` (the suffix drafter's siblings)."""
        return [s for s, r in enumerate(self.active) if r.prompt_index == prompt_index and s != exclude]
