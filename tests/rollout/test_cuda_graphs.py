"""CUDAGraphProfileCache bookkeeping on the CPU: bucketing, keys, capture order, groups, LRU, stats, fallback."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import pytest
import torch

from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.cuda_graphs import (
    DEFAULT_BUCKETS,
    CUDAGraphBackend,
    CUDAGraphProfileCache,
    GraphProfile,
)
from lightning_tlt.rollout.engine import RolloutEngine


@dataclass
class Replayable:
    """An eager stand-in for a captured graph: replay re-runs the captured function."""

    fn: Callable[[], None]
    nbytes: int

    def replay(self) -> None:
        self.fn()


class RecordingBackend:
    """Captures by keeping the function; records the capture order; can be told to fail."""

    def __init__(self, nbytes: int = 100, fail_batches: tuple[int, ...] = ()) -> None:
        self.nbytes = nbytes
        self.fail_batches = fail_batches
        self.order: list[int] = []
        self.current_batch = 0

    def capture(self, fn: Callable[[], None], reset: Callable[[], None] | None = None, group: Hashable = ()) -> Replayable:
        self.order.append(self.current_batch)
        if self.current_batch in self.fail_batches:
            raise RuntimeError("capture failed")
        return Replayable(fn, self.nbytes)


def test_bucketing() -> None:
    cache = CUDAGraphProfileCache(None, max_batch=100)
    assert cache.buckets == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    assert [cache.bucket(n) for n in (1, 2, 3, 5, 9, 17, 33, 65, 97, 100)] == [1, 2, 4, 8, 16, 24, 48, 96, 100, 100]
    with pytest.raises(ValueError, match=r"batch must be in \[1, 100\], got 101"):
        cache.bucket(101)
    with pytest.raises(ValueError, match=r"batch must be in \[1, 100\], got 0"):
        cache.bucket(0)
    assert CUDAGraphProfileCache(None).buckets == DEFAULT_BUCKETS
    with pytest.raises(ValueError, match="buckets must be non-empty"):
        CUDAGraphProfileCache(None, buckets=())
    with pytest.raises(ValueError, match="memory_budget_bytes must be >= 0 or None, got -1"):
        CUDAGraphProfileCache(None, memory_budget_bytes=-1)


def test_profile_keys_hits_and_misses() -> None:
    backend = RecordingBackend()
    cache = CUDAGraphProfileCache(backend, max_batch=8)
    calls: list[str] = []
    decode4 = GraphProfile("decode", 4, 1, ("greedy",))
    verify4 = GraphProfile("verify", 4, 5)
    backend.current_batch = 4
    cache.run(decode4, lambda: calls.append("d4"))
    cache.run(decode4, lambda: calls.append("other"))  # a hit replays the captured function
    cache.run(verify4, lambda: calls.append("v4"))
    cache.run(GraphProfile("decode", 4, 1, ("t=1.0",)), lambda: calls.append("d4b"))
    assert calls == ["d4", "d4", "v4", "d4b"]
    s = cache.stats
    assert (s.captures, s.hits, s.misses, s.replays, s.eager_runs) == (3, 1, 3, 4, 0)
    assert s.bytes == 300 and len(cache) == 3
    assert decode4 in cache and GraphProfile("decode", 8, 1, ("greedy",)) not in cache


def test_capture_largest_first() -> None:
    backend = RecordingBackend()
    cache = CUDAGraphProfileCache(backend, max_batch=16)
    profiles = [GraphProfile("decode", b) for b in (1, 4, 16, 2, 8)]

    def fn_for(p: GraphProfile) -> Callable[[], None]:
        backend.current_batch = p.batch
        return lambda: None

    cache.capture(profiles, fn_for)
    assert backend.order == [16, 8, 4, 2, 1]
    assert cache.stats.captured == [GraphProfile("decode", b) for b in (16, 8, 4, 2, 1)]
    cache.capture(profiles, fn_for)  # all there: nothing recaptured
    assert cache.stats.captures == 5


def test_lru_eviction_under_budget_evicts_whole_groups() -> None:
    backend = GroupRecordingBackend(nbytes=100)
    cache = CUDAGraphProfileCache(backend, max_batch=8, memory_budget_bytes=350)
    a, b, b2, c = GraphProfile("decode", 1), GraphProfile("verify", 2), GraphProfile("verify", 4), GraphProfile("draft", 4)
    for profile in (a, b, b2, a):  # a is now more recently used than b's group
        backend.run(cache, profile)
    backend.run(cache, c)  # 400 bytes > 350: evict the least recently used group, b's (both of its graphs)
    assert a in cache and c in cache and b not in cache and b2 not in cache
    assert cache.stats.evictions == 2 and cache.stats.bytes == 200
    assert backend.closed == [b, b2] and backend.released == ["verify"]  # closed first, then the stream back
    backend.run(cache, GraphProfile("draft", 8))  # 300 bytes: within the budget
    backend.run(cache, GraphProfile("draft", 2))  # 400: a's group goes, never the one just captured
    assert a not in cache and len(cache) == 3 and backend.released == ["verify", "decode"]
    tight = CUDAGraphProfileCache(GroupRecordingBackend(nbytes=100), max_batch=8, memory_budget_bytes=150)
    for n in (1, 2, 4):  # one group over the budget by itself: kept whole (one graph freed would free the
        tight.run(GraphProfile("decode", n), lambda: None)  # workspace its siblings replay into)
    assert len(tight) == 3 and tight.stats.evictions == 0
    cache.clear()
    assert len(cache) == 0 and cache.stats.bytes == 0 and sorted(backend.released) == ["decode", "draft", "verify"]


class GroupRecordingBackend(RecordingBackend):
    """Records each capture's group, which graphs are closed, and which groups are released."""

    def __init__(self, nbytes: int = 100) -> None:
        super().__init__(nbytes)
        self.groups: dict[Hashable, list[GraphProfile]] = {}
        self.closed: list[GraphProfile] = []
        self.released: list[Hashable] = []
        self.profile: GraphProfile | None = None

    def capture(self, fn: Callable[[], None], reset: Callable[[], None] | None = None, group: Hashable = ()) -> Replayable:
        backend, profile = self, self.profile

        class Closable(Replayable):
            def close(self) -> None:
                assert group not in backend.released, "a graph closed after its group's stream was given back"
                backend.closed.append(profile)

        return Closable(fn, self.nbytes)

    def release(self, group: Hashable) -> None:
        self.released.append(group)

    def run(self, cache: CUDAGraphProfileCache, profile: GraphProfile) -> None:
        self.profile = profile  # what a capture of this run records as closed later
        cache.run(profile, lambda: None)


def test_dropping_one_graph_drops_its_group_and_gives_its_stream_back() -> None:
    # torch frees a capture stream's cuBLAS workspace when any graph captured on it is reset: every other graph
    # of that stream would replay into freed memory, so a group (one stream) goes whole or not at all
    from lightning_tlt.rollout.spec_step import graph_group

    backend = GroupRecordingBackend()
    cache = CUDAGraphProfileCache(backend, max_batch=8, group_of=graph_group)
    profiles = [GraphProfile("spec", n, 3, ("s", handle, 64)) for handle in (1, 2) for n in (1, 2)]
    profiles.append(GraphProfile("decode", 4, 1, ("s", 64)))
    for profile in profiles:
        backend.run(cache, profile)
    assert cache.drop(lambda p: p == profiles[0]) == 2  # drafter 1's graph asked for, drafter 1's group freed
    assert backend.closed == profiles[:2] and backend.released == [("spec", 1)]
    assert cache.profiles() == profiles[2:]
    assert cache.drop(lambda p: False) == 0 and backend.released == [("spec", 1)]
    cache.clear()
    assert backend.closed == profiles and sorted(map(str, backend.released)) == ["('spec', 1)", "('spec', 2)", "decode"]


def test_failed_capture_falls_back_to_eager_with_warning() -> None:
    backend = RecordingBackend(fail_batches=(2,))
    cache = CUDAGraphProfileCache(backend, max_batch=4)
    calls: list[int] = []
    backend.current_batch = 2
    with pytest.warns(UserWarning, match="capture of .*decode.* failed"):
        cache.run(GraphProfile("decode", 2), lambda: calls.append(2))
    cache.run(GraphProfile("decode", 2), lambda: calls.append(2))  # remembered: no second attempt
    assert calls == [2, 2]
    assert cache.stats.failures == 1 and cache.stats.eager_runs == 2 and cache.stats.captures == 0
    assert backend.order == [2]


def test_no_backend_runs_eagerly() -> None:
    cache = CUDAGraphProfileCache(None, max_batch=4)
    calls: list[int] = []
    for _ in range(3):
        cache.run(GraphProfile("decode", 4), lambda: calls.append(1))
    assert calls == [1, 1, 1] and not cache.enabled
    assert cache.stats.eager_runs == 3 and cache.stats.captures == 0 and cache.stats.replays == 0


def test_engine_without_cuda_warns_and_runs_eagerly() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    engine = RolloutEngine(model, max_seq_len=16, max_batch_size=2, use_cuda_graphs=True, compile=False)
    with pytest.warns(UserWarning, match="use_cuda_graphs=True without CUDA"):
        out = engine.generate([[4, 5]], SamplingConfig(temperature=0.0, max_new_tokens=3, stop_token_ids=[]))
    ref = model.generate(torch.tensor([[4, 5]]), do_sample=False, max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    assert out.completion_ids[0] == ref[0, 2:].tolist()
    assert engine.graph_stats["eager_runs"] == 4 and engine.graph_stats["captures"] == 0  # 3 steps + 1 masked


class WarmupBackend:
    """Runs the step twice at capture, as the CUDA backend's warm-up does (resetting the state before
    each run and before the capture, as it does), then replays eagerly."""

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, fn: Callable[[], None], reset: Callable[[], None] | None = None, group: Hashable = ()) -> Replayable:
        for _ in range(2):
            if reset is not None:
                reset()
            fn()
        if reset is not None:
            reset()
        self.captures += 1
        return Replayable(fn, 10)


def test_engine_graph_warmup_leaves_no_trace() -> None:
    """Capturing mid-generation (with warm-up runs of the live step) changes no sampled token."""
    model = build_model("llama", "tiny", seed=0)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8, stop_token_ids=[])
    prompts = [[4, 5], [6, 7, 8], [9], [10, 11], [12, 13, 14]]
    plain = RolloutEngine(model, max_seq_len=16, max_batch_size=4)
    ref = plain.generate(prompts, cfg, num_samples=2, generator=torch.Generator().manual_seed(7))
    graphed = RolloutEngine(model, max_seq_len=16, max_batch_size=4)
    backend = WarmupBackend()
    graphed.use_graph_backend(backend)
    out = graphed.generate(prompts, cfg, num_samples=2, generator=torch.Generator().manual_seed(7))
    assert out.completion_ids == ref.completion_ids
    assert out.logprobs == ref.logprobs
    assert backend.captures == 2  # waves of 4, 4 and 2 rows: buckets 4 and 2
    assert graphed.graph_stats["hits"] > 0


def test_speculative_graph_warmups_see_the_live_state() -> None:
    """Capturing speculative steps mid-generation (two warm-up runs each, as on CUDA) while the tuner
    alternates k, with a drafter that gets many drafts accepted: every warm-up run starts from the live
    state, so the same seed gives the same rollouts with and without graphs. (On the H200 the second
    warm-up run read the catch-up block the first had written, with the old width, and indexed out of
    bounds.)"""
    from lightning_tlt.core.types import SpeculativeConfig
    from lightning_tlt.drafters.eagle import EagleDrafter

    model = build_model("qwen2", "tiny", seed=0)  # its untrained drafter gets most drafts accepted
    prompts = [[4 + i % 50, 5 + (7 * i) % 60, 6 + i % 3] for i in range(24)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, stop_token_ids=[7, 9, 11, 13])
    spec = SpeculativeConfig(method="eagle", num_draft_tokens=None, draft_candidates=(2, 8), threshold=8,
                             hysteresis_steps=1, tuner_epsilon=0.5, tuner_min_samples=1, plain_arm=False)
    drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    outs = []
    for graphs in (False, True):
        engine = RolloutEngine(model, max_seq_len=48, max_batch_size=8, speculative=spec)
        engine.drafter = drafter
        assert engine.tuner is not None
        engine.tuner.cost_model = lambda k, rows: 1e-3 * (1 + 0.1 * k)  # the same k choices in both runs
        backend = WarmupBackend()
        if graphs:
            engine.use_graph_backend(backend)
        outs.append(engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(3)))
    assert outs[1].completion_ids == outs[0].completion_ids and outs[1].logprobs == outs[0].logprobs
    assert backend.captures > 4 and outs[1].stats["spec/acceptance_length"] > 2.0


def test_the_cuda_backend_captures_each_group_on_its_own_stream_and_gives_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`CUDAGraphBackend`'s bookkeeping over a fake of torch.cuda (the GPU check is benchmarks/graph_streams.py):
    one held stream per group, warm-up and capture on it, and the stream given back after its group's graphs
    are reset."""
    from contextlib import contextmanager

    from lightning_tlt.core.streams import ExclusiveStreams
    from lightning_tlt.rollout import cuda_graphs

    log: list[tuple[str, object]] = []
    current: list[object] = ["main"]

    class Stream:
        made = 0

        def __init__(self, device: object = None) -> None:
            Stream.made += 1
            self.cuda_stream = 100 + Stream.made % 4  # a pool of 4 that comes round

        def wait_stream(self, other: object) -> None:
            pass

    class Graph:
        def register_generator_state(self, gen: object) -> None:
            pass

        def reset(self) -> None:
            log.append(("reset", self))

        def replay(self) -> None:
            log.append(("replay", self))

    @contextmanager
    def on_stream(stream: object):  # type: ignore[no-untyped-def]
        current.append(stream)
        try:
            yield
        finally:
            current.pop()

    @contextmanager
    def capturing(graph: Graph, pool: object = None, stream: Stream | None = None):  # type: ignore[no-untyped-def]
        log.append(("capture on", stream.cuda_stream if stream is not None else None))
        yield

    class Main:
        def wait_stream(self, other: object) -> None:
            pass

    fake = {"graph_pool_handle": lambda: "pool", "current_stream": lambda device=None: Main(),
            "stream": on_stream, "synchronize": lambda device=None: None, "memory_reserved": lambda device=None: 0,
            "mem_get_info": lambda device=None: (1 << 30, 1 << 31), "CUDAGraph": Graph, "graph": capturing}
    for name, value in fake.items():
        monkeypatch.setattr(torch.cuda, name, value)
    exclusive = ExclusiveStreams(Stream, device_index=lambda device: 0)
    monkeypatch.setattr(cuda_graphs, "EXCLUSIVE_STREAMS", exclusive)
    side = exclusive.acquire(torch.device("cuda"), "a drafter's side stream")
    for _ in range(3):  # streams made elsewhere: the pool's next stream is the drafter's again
        Stream()

    backend = CUDAGraphBackend(torch.device("cuda"))
    cache = CUDAGraphProfileCache(backend, max_batch=8)
    warmed_on: list[object] = []
    for profile in (GraphProfile("decode", 2), GraphProfile("decode", 4), GraphProfile("verify", 4, 3)):
        cache.run(profile, lambda: warmed_on.append(current[-1]))
    streams = backend.streams
    assert set(streams) == {"decode", "verify"} and streams["decode"] is not streams["verify"]
    handles = {s.cuda_stream for s in streams.values()}
    assert len(handles) == 2 and side.cuda_stream not in handles  # never the drafter's, though the pool repeats
    assert [h for what, h in log if what == "capture on"] == [streams["decode"].cuda_stream] * 2 + [
        streams["verify"].cuda_stream]
    assert warmed_on[0] is streams["decode"]  # the warm-up ran on the group's stream (then the replays on main)
    cache.drop(lambda p: p.phase == "verify")
    assert [what for what, _ in log].count("reset") == 1 and set(backend.streams) == {"decode"}
    assert sorted(exclusive.holders()) == ["CUDA graphs 'decode'", "a drafter's side stream"]
    cache.clear()
    assert exclusive.holders() == ["a drafter's side stream"]
    # a graph that outlives its backend keeps its group's stream held: its destruction frees the stream's
    # workspace, which must not be a later holder's by then
    import gc

    other = CUDAGraphBackend(torch.device("cuda"))
    survivor = other.capture(lambda: None, group="late")
    del other
    gc.collect()
    assert "CUDA graphs 'late'" in exclusive.holders()
    del survivor
    gc.collect()
    assert exclusive.holders() == ["a drafter's side stream"]
