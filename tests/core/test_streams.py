"""ExclusiveStreams on the CPU, over a fake of torch's stream pool (round-robin over a fixed set of streams)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from lightning_tlt.core.streams import ExclusiveStreams


class FakeStream:
    def __init__(self, handle: int) -> None:
        self.cuda_stream = handle


class FakePool:
    """torch's pool: the n-th stream made is stream n mod size, shared by whoever made it."""

    def __init__(self, size: int) -> None:
        self.size, self.made = size, 0

    def __call__(self, device: torch.device) -> FakeStream:
        self.made += 1
        return FakeStream(1000 + self.made % self.size)


class Owner:
    """Something a stream is held for (a trainer, a graph group's hold)."""


def streams(size: int) -> tuple[ExclusiveStreams, FakePool]:
    pool = FakePool(size)
    return ExclusiveStreams(pool, device_index=lambda device: 0), pool


def test_no_two_holders_get_one_stream_even_when_the_pool_comes_round() -> None:
    exclusive, pool = streams(4)
    cpu = torch.device("cpu")
    side = exclusive.acquire(cpu, "drafter")
    for _ in range(7):  # others take pool streams too (torch.cuda.Stream() elsewhere): the pool comes round
        pool(cpu)
    groups = [exclusive.acquire(cpu, f"graphs {g}") for g in range(3)]
    handles = [s.cuda_stream for s in (side, *groups)]
    assert len(set(handles)) == 4  # a plain torch.cuda.Stream() after 4 would have been the drafter's again
    with pytest.raises(RuntimeError, match=r"no CUDA stream of device 0 is free for graphs 3: the pool's streams "
                                           r"are held by \['drafter', 'graphs 0', 'graphs 1', 'graphs 2'\]"):
        exclusive.acquire(cpu, "graphs 3")
    exclusive.release(cpu, groups[1])
    again = exclusive.acquire(cpu, "graphs 3")
    assert again.cuda_stream == groups[1].cuda_stream
    exclusive.release(cpu, FakeStream(7))  # not held: ignored
    assert exclusive.holders() == ["drafter", "graphs 0", "graphs 2", "graphs 3"]


def test_a_stream_held_for_an_owner_is_given_back_when_the_owner_goes() -> None:
    exclusive, _ = streams(2)
    cpu = torch.device("cpu")

    owner: Any = Owner()
    exclusive.acquire(cpu, "a drafter's side stream", owner=owner)
    exclusive.acquire(cpu, "graphs")
    with pytest.raises(RuntimeError, match="no CUDA stream"):
        exclusive.acquire(cpu, "another")
    del owner
    gc.collect()
    assert exclusive.holders() == ["graphs"]
    exclusive.acquire(cpu, "another")


def test_an_owner_that_goes_after_giving_its_stream_back_leaves_the_next_holder_alone() -> None:
    exclusive, _ = streams(1)
    cpu = torch.device("cpu")

    owner: Any = Owner()
    first = exclusive.acquire(cpu, "graphs of an old engine", owner=owner)
    exclusive.release(cpu, first)
    again = exclusive.acquire(cpu, "a drafter's side stream")
    assert again.cuda_stream == first.cuda_stream
    del owner
    gc.collect()
    assert exclusive.holders() == ["a drafter's side stream"]  # still held: no one else may get it
    with pytest.raises(RuntimeError, match="no CUDA stream"):
        exclusive.acquire(cpu, "another")


def test_owners_in_a_reference_cycle_give_their_streams_back_when_the_pool_runs_out() -> None:
    exclusive, _ = streams(2)
    cpu = torch.device("cpu")

    class Engine:  # a finished run's engine, kept alive only by a cycle until the collector runs
        def __init__(self) -> None:
            self.me = self

    gc.disable()
    try:
        for run in range(3):  # a third run finds both streams held by unreachable engines: collected, then free
            engine: Any = Engine()
            exclusive.acquire(cpu, f"graphs of run {run}", owner=engine)
            exclusive.acquire(cpu, f"side stream of run {run}", owner=engine)
            del engine
    finally:
        gc.enable()
    assert exclusive.holders() == ["graphs of run 2", "side stream of run 2"]
