"""Helpers shared by the benchmark scripts (imported as ``_common`` from ``benchmarks/``)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
CACHE_DIR = str(ROOT / ".cache" / "lightning_tlt")
"""``--cache-dir``'s default: the warm starts the benchmarks share (git-ignored)."""

_SMOKE_HELP = "tiny sizes on the CPU: a check of the script"


def add_common_flags(
    p: argparse.ArgumentParser,
    *,
    seed: int | None = None,
    cache_dir: bool = False,
    out: str | None = None,
    out_default: Any = None,
    out_type: Callable[[str], Any] | None = None,
    smoke: str | bool = True,
) -> None:
    """The flags the benchmark scripts share, defined once (added after the script's own, in this order).

    Args:
        p: the script's parser.
        seed: ``--seed``'s default; ``None``: no ``--seed``.
        cache_dir: add ``--cache-dir`` (default `CACHE_DIR`).
        out: ``--out``'s help (where the JSON goes; default ``out_default``, ``None``: `write_results`' path).
        out_default: ``--out``'s default.
        out_type: ``--out``'s type (``None``: a string).
        smoke: ``--smoke``'s help (``True``: the usual one), or ``False``: no ``--smoke``.
    """
    if seed is not None:
        p.add_argument("--seed", type=int, default=seed)
    if cache_dir:
        p.add_argument("--cache-dir", default=CACHE_DIR)
    p.add_argument("--out", type=out_type, default=out_default, help=out)
    if smoke:
        p.add_argument("--smoke", action="store_true", help=_SMOKE_HELP if smoke is True else smoke)


def write_results(
    results: dict[str, Any], benchmark: str, *, smoke: bool, cuda: bool, out: str | None = None, quiet: bool = False
) -> Path:
    """Write a benchmark's JSON and say where: to ``out`` when given, else to
    ``benchmarks/results/<benchmark>_<card>_<date>.json`` (card ``h200``, ``cuda`` or ``cpu``, from
    ``results["card"]``; date from ``results["date"]``), or for a smoke run to
    ``benchmarks/results/smoke/<benchmark>_smoke.json`` (git-ignored: a smoke run never touches the
    recorded results). ``quiet``: without the line (a partial write a benchmark repeats)."""
    card = "h200" if "H200" in str(results.get("card", "")) else ("cuda" if cuda else "cpu")
    date = str(results["date"])[:10].replace("-", "")
    name = f"{benchmark}_smoke.json" if smoke else f"{benchmark}_{card}_{date}.json"
    path = Path(out) if out else ROOT / "benchmarks" / "results" / ("smoke" if smoke else "") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=float))
    if not quiet:
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


def kernel_totals(prof: Any, cuda: bool, top: int = 25) -> dict[str, Any]:
    """A finished ``torch.profiler.profile``'s time by name, largest first: kernels on the GPU (CUPTI reports
    each kernel of a CUDA graph's replay), top-level ops on the CPU. ``busy_us``: their sum."""
    totals: dict[str, list[float]] = {}
    for event in prof.events():
        on_device = event.device_type == torch.autograd.DeviceType.CUDA
        if on_device != cuda or (not cuda and event.cpu_parent is not None):
            continue
        entry = totals.setdefault(event.name, [0.0, 0])
        entry[0] += event.device_time if cuda else event.cpu_time_total
        entry[1] += 1
    busy = sum(us for us, _ in totals.values())
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return {"what": "GPU kernels" if cuda else "CPU ops", "busy_us": busy,
            "top": [{"name": name[:160], "us": us, "calls": n, "share": us / busy if busy else None}
                    for name, (us, n) in ranked]}


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
    p.add_argument("--cache-dir", default=CACHE_DIR)


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


@dataclass
class WarmDrafter:
    """What `warm_drafter` made: the rollouts it trained on, the offline training's result, and their times."""

    output: Any
    """The policy's rollouts (`RolloutOutput`)."""
    result: Any
    """`lightning_tlt.drafters.offline.OfflineTrainResult` (the drafter, steps, held-out acceptance before/after)."""
    rollout_s: float
    """Seconds of the engine's build and its ``generate``."""
    train_s: float
    """Seconds of the drafter's training (synchronized)."""


def warm_drafter(
    policy: torch.nn.Module,
    prompts: list[list[int]],
    out_dir: Path,
    *,
    samples: int,
    max_new: int,
    steps: int,
    config: Any,
    rollout_seed: int,
    seed: int = 0,
    on_rollouts: Callable[[Any, float], None] | None = None,
) -> WarmDrafter:
    """An EAGLE drafter trained offline on ``policy``'s own rollouts (TLT's drafter warm-up), saved to ``out_dir``.

    ``samples`` rollouts of each prompt at temperature 1 (``max_new`` tokens at most, noise seeded with
    ``rollout_seed``), then ``steps`` updates of `train_drafter` (``config``: a `DrafterTrainConfig`; ``seed``:
    the drafter's init and the buffer's draws), the same captured step the co-training callback replays in the
    stalls. The drafter is saved as its inference copy (in the policy's dtype, as the engine drafts).
    ``on_rollouts(output, rollout_s)`` runs between the two (the engine is freed by then)."""
    from lightning_tlt.core.types import SamplingConfig
    from lightning_tlt.drafters.offline import train_drafter
    from lightning_tlt.rollout.engine import RolloutEngine

    device = next(policy.parameters()).device
    t0 = time.perf_counter()
    engine = RolloutEngine(policy, max_batch_size=len(prompts) * samples, max_seq_len=max(map(len, prompts)) + max_new)
    output = engine.generate(
        prompts,
        SamplingConfig(temperature=1.0, max_new_tokens=max_new),
        num_samples=samples,
        generator=torch.Generator(device=device).manual_seed(rollout_seed),
    )
    rollout_s = time.perf_counter() - t0
    del engine
    if on_rollouts is not None:
        on_rollouts(output, rollout_s)
    t1 = time.perf_counter()
    result = train_drafter(
        policy,
        [list(p) + list(c) for p, c in zip(output.prompt_ids, output.completion_ids)],
        [len(p) for p in output.prompt_ids],
        steps=steps,
        config=config,
        seed=seed,
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    train_s = time.perf_counter() - t1
    result.drafter.inference_copy().save_pretrained(out_dir)
    return WarmDrafter(output, result, rollout_s, train_s)
