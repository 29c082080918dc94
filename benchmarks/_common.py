"""Helpers shared by the benchmark scripts (imported as ``_common`` from ``benchmarks/``)."""

from __future__ import annotations

from typing import Any

import torch


def graph_replay_ms(
    engine: Any, batch: int, phase: str = "decode", tokens_per_row: int = 1, replays: int = 50, warmup: int = 3
) -> float | None:
    """GPU time of one replay of an engine's captured ``phase`` graph at ``batch``'s bucket (no host loop).

    Replays after a finished ``generate``: every row is finished, so the step only rewrites junk
    (with each row's KV length as the call left it). A "spec" step's catch-up block is always the
    engine's widest, so its graph is one per bucket and ``k``.
    """
    graphs = engine._graphs
    if graphs is None or not graphs.enabled or engine.device.type != "cuda":
        return None
    bucket = graphs.bucket(batch)
    found = [g for p, g in graphs._graphs.items()
             if p.phase == phase and p.batch == bucket and p.tokens_per_row == tokens_per_row]
    if not found:
        return None
    graph = found[0]
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays
