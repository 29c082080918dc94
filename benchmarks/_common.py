"""Helpers shared by the benchmark scripts (imported as ``_common`` from ``benchmarks/``)."""

from __future__ import annotations

import argparse
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


def add_workload_flags(p: argparse.ArgumentParser) -> None:
    """The e2e's workload and warm start as flags (task, size, SFT settings): a machine that ran the e2e
    (or another script with these defaults) loads its cached policy instead of training it again."""
    from e2e.options import E2EOptions

    e2e = E2EOptions()
    p.add_argument("--task", default=e2e.task)
    p.add_argument("--difficulty", type=int, default=e2e.difficulty)
    p.add_argument("--arch", default=e2e.arch)
    p.add_argument("--size", default=e2e.size, help="zoo size (0.5b: Qwen2.5-0.5B's shapes and vocabulary)")
    p.add_argument("--sft-steps", type=int, default=e2e.sft_steps)
    p.add_argument("--sft-batch", type=int, default=e2e.sft_batch)
    p.add_argument("--sft-lr", type=float, default=e2e.sft_lr)
    p.add_argument("--sft-batch-tokens", type=int, default=e2e.sft_batch_tokens)
    p.add_argument("--sft-max-length", type=int, default=e2e.sft_max_length)
    p.add_argument("--sft-max-time-s", type=float, default=e2e.sft_max_time_s)
    p.add_argument("--cache-dir", default=str(ROOT / ".cache" / "lightning_tlt"))


def smoke_workload(args: argparse.Namespace) -> None:
    """``--smoke``: the workload flags at tiny sizes (a 30-step SFT of the tiny model, difficulty 1)."""
    args.size, args.sft_steps, args.sft_batch, args.difficulty = "tiny", 30, 16, 1
    args.sft_batch_tokens, args.sft_max_length, args.sft_max_time_s = None, None, 60.0


def workload_policy(args: argparse.Namespace, device: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The warm-started policy of the workload flags (cached), on ``device`` in ``dtype``, and its tokenizer."""
    from e2e.workload import warm_start_config

    from lightning_tlt.rl.warmstart import warm_start

    policy, tokenizer = warm_start(warm_start_config(args, device))
    return policy.to(device=device, dtype=dtype).eval(), tokenizer
