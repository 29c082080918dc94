"""Helpers shared by the benchmark scripts (imported as ``_common`` from ``benchmarks/``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent


def write_results(results: dict[str, Any], benchmark: str, *, smoke: bool, cuda: bool, out: str | None = None) -> Path:
    """Write a benchmark's JSON and say where: to ``out`` when given, else to
    ``benchmarks/results/<benchmark>_<card>_<date>.json`` (card ``h200``, ``cuda`` or ``cpu``, from
    ``results["card"]``; date from ``results["date"]``), or for a smoke run to
    ``benchmarks/results/smoke/<benchmark>_smoke.json`` (git-ignored: a smoke run never touches the
    recorded results)."""
    card = "h200" if "H200" in str(results.get("card", "")) else ("cuda" if cuda else "cpu")
    date = str(results["date"])[:10].replace("-", "")
    name = f"{benchmark}_smoke.json" if smoke else f"{benchmark}_{card}_{date}.json"
    path = Path(out) if out else ROOT / "benchmarks" / "results" / ("smoke" if smoke else "") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=float))
    print(f"wrote {path}", flush=True)
    return path


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
