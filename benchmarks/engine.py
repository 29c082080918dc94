"""Decode throughput of `RolloutEngine` against HF ``generate``, verify cost, long-context cost.

On the GPU (issue 9): a ~0.4 B zoo model (``build_model("qwen2", "400m", vocab_size=32000)``,
random init, bf16), completions of ``--new-tokens`` tokens with no stop token, at several batch
sizes; HF ``generate`` configured as TRL 1.16's ``GRPOTrainer`` configures it without vLLM
(``do_sample=True``, temperature 1, top-p 1, top-k 0, the default dynamic cache,
``disable_compile=True``), run for fewer tokens (``--hf-new-tokens``) because it is slow, so per-step
figures are compared. Also: the weight-read floor (parameter bytes / measured copy bandwidth),
graph capture and compile time, memory, and sanity checks (greedy parity with HF, seeded
reproducibility). Then (issue 12), on a Qwen2.5-0.5B-shaped model (the same body, vocab 151,936):
a 5-token verify step (``k = 4``) over a 1-token decode step at batch 1 and 8 (CUDA-graph replay
times of the two captured steps); the step time at batch 32 with rows at about 1,000 tokens in an
8,192-token cache over the same rows in a 1,024-token cache; and the graph cache's memory budget,
eviction and ``bytes`` statistic on the GPU. Prints a table and writes JSON to
``benchmarks/results/`` with a ``"summary"`` of the issue's keys.

CPU smoke run (seconds): ``python benchmarks/engine.py --size tiny --smoke``.
GPU run: ``python benchmarks/engine.py --size 400m``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from _common import add_common_flags, graph_replay_ms, kernel_totals
from transformers import GenerationConfig

from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """Measured device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    _sync(device)
    iters = 10
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    _sync(device)
    return 2 * src.numel() * src.element_size() * iters / (time.perf_counter() - start)


def random_prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, length), generator=g).tolist()


def hf_trl_generate(model: Any, prompts: list[list[int]], new_tokens: int, device: torch.device) -> float:
    """Seconds for HF ``generate`` with TRL GRPOTrainer's (no-vLLM) generation config."""
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=True, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0, cache_implementation=None,
        disable_compile=True,
    )
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    _sync(device)
    assert out.shape[1] == ids.shape[1] + new_tokens, out.shape
    return time.perf_counter() - start


def engine_generate(
    engine: RolloutEngine, prompts: list[list[int]], new_tokens: int, seed: int
) -> tuple[float, dict[str, float]]:
    cfg = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens, stop_token_ids=[])
    device = engine.device
    _sync(device)
    start = time.perf_counter()
    out = engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(seed))
    _sync(device)
    wall = time.perf_counter() - start
    assert all(len(c) == new_tokens for c in out.completion_ids)
    return wall, out.stats


def sanity(model: Any, engine: RolloutEngine, vocab: int, device: torch.device) -> dict[str, Any]:
    """Greedy parity with HF (bf16: reported, not asserted) and seeded reproducibility."""
    prompts = random_prompts(4, 16, vocab, seed=1)
    n = min(32, engine.max_seq_len - 16)
    greedy = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=n, stop_token_ids=[]))
    ids = torch.tensor(prompts, device=device)
    with torch.no_grad():
        ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, eos_token_id=None, pad_token_id=0)[:, 16:].tolist()
    prefix = []
    for a, b in zip(greedy.completion_ids, ref):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)
        prefix.append(k)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=n, stop_token_ids=[])
    a = engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(3)).completion_ids
    b = engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(3)).completion_ids
    c = engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(4)).completion_ids
    d = engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(3)).completion_ids
    with torch.no_grad():  # the engine's logits against HF's forward on the same tokens
        full = torch.tensor([p + g for p, g in zip(prompts, greedy.completion_ids)], device=device)
        hf_logits = model(full).logits[:, 15:-1].float()
        from lightning_tlt.core.kv_cache import KVCache
        from lightning_tlt.core.runner import ModelRunner

        runner = ModelRunner(model)
        s = runner.spec
        cache = KVCache.allocate(s.num_layers, 4, full.shape[1], s.num_kv_heads, s.head_dim,
                                 device=device, dtype=engine.dtype)
        pos = torch.arange(full.shape[1], device=device)[None].expand(4, -1)
        ours = runner.forward(full, pos, cache.k, cache.v).logits[:, 15:-1].float()
    return {
        "greedy_match_prefix_tokens": prefix,
        "greedy_tokens": n,
        "same_seed_same_rollouts": a == b == d,
        "different_seed_differs": a != c,
        "logits_max_abs_diff_vs_hf": float((hf_logits - ours).abs().max()),
        "logits_argmax_agreement": float((hf_logits.argmax(-1) == ours.argmax(-1)).float().mean()),
    }


def bench_batch(
    engine: RolloutEngine, model: Any, batch: int, args: argparse.Namespace, device: torch.device, floor_ms: float
) -> dict[str, Any]:
    """Engine and HF figures at one batch size."""
    prompts = random_prompts(batch, args.prompt_len, args.vocab_size, seed=batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cap0 = engine.graph_stats.get("capture_time_s", 0.0)
    warm_wall, _ = engine_generate(engine, prompts, 4, seed=0)  # compile + capture this bucket
    row: dict[str, Any] = {"batch": batch, "first_call_s": warm_wall,
                           "capture_s": engine.graph_stats.get("capture_time_s", 0.0) - cap0}
    wall, stats = engine_generate(engine, prompts, args.new_tokens, seed=1)
    steps = args.new_tokens
    row.update({
        "engine_ms_per_step": wall / steps * 1e3,
        "engine_tokens_per_s": batch * steps / wall,
        "engine_prefill_s": stats.get("time_prefill_s", 0.0),
        "floor_ratio": wall / steps * 1e3 / floor_ms,
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    })
    row["graph_replay_ms"] = graph_replay_ms(engine, batch)
    if not args.skip_hf and batch in args.hf_batch_list:
        hf_trl_generate(model, prompts, 4, device)  # warm-up
        hf_wall = hf_trl_generate(model, prompts, args.hf_new_tokens, device)
        row.update({
            "hf_ms_per_step": hf_wall / args.hf_new_tokens * 1e3,
            "hf_tokens_per_s": batch * args.hf_new_tokens / hf_wall,
        })
        row["speedup_vs_hf"] = row["hf_ms_per_step"] / row["engine_ms_per_step"]
    print(
        f"batch {batch:4d} | engine {row['engine_ms_per_step']:7.3f} ms/step {row['engine_tokens_per_s']:10.0f} tok/s"
        + (f" | HF {row['hf_ms_per_step']:7.2f} ms/step {row['hf_tokens_per_s']:8.0f} tok/s"
           f" | x{row['speedup_vs_hf']:.1f}" if "hf_ms_per_step" in row else "")
        + f" | graph {row['graph_replay_ms'] or 0:.3f} ms | capture {row['capture_s']:.1f} s,"
        f" first call {row['first_call_s']:.1f} s",
        flush=True,
    )
    return row


def verify_cost(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Decode vs 5-token verify graph replay at batch 1, 8 and 32 on Qwen2.5-0.5B shapes (vocab 151,936)."""
    from lightning_tlt.core.types import SpeculativeConfig

    model = build_model(args.arch, args.size, vocab_size=args.verify_vocab, seed=0).to(device=device, dtype=dtype)
    model.eval()
    out: dict[str, Any] = {"vocab_size": args.verify_vocab, "params": sum(p.numel() for p in model.parameters())}
    spec = SpeculativeConfig(method="suffix", num_draft_tokens=4, threshold=32, hysteresis_steps=1)
    engine = RolloutEngine(model, max_batch_size=32, max_seq_len=args.prompt_len + 1600, speculative=spec,
                           use_cuda_graphs=False if args.no_graphs else None,
                           compile=False if args.no_compile else None)
    plain = RolloutEngine(model, max_batch_size=32, max_seq_len=args.prompt_len + 1600,
                          use_cuda_graphs=False if args.no_graphs else None,
                          compile=False if args.no_compile else None)
    for batch in (1, 8, 32):
        # a long prompt then a few steps, rows at ~1,500 positions as in the notes; the same rows
        # through the plain engine (decode graph) and the speculating one (its 5-token verify graph)
        prompts = random_prompts(batch, min(1500, args.prompt_len * 24), model.config.vocab_size, seed=batch)
        cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, stop_token_ids=[])
        engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(0))
        plain.generate(prompts, cfg, generator=torch.Generator().manual_seed(0))
        decode = graph_replay_ms(plain, batch, "decode", 1)
        verify = graph_replay_ms(engine, batch, "verify", 5)
        out[f"b{batch}"] = {"decode_ms": decode, "verify5_ms": verify,
                            "ratio": None if not decode or not verify else verify / decode}
        print(f"0.5B shapes, batch {batch:3d}: decode {decode or 0:.3f} ms, verify of 5 {verify or 0:.3f} ms"
              f" -> {out[f'b{batch}']['ratio'] or 0:.2f}x", flush=True)
    out["graphs"] = engine.graph_stats
    del engine, plain, model
    return out


def long_context(args: argparse.Namespace, model: Any, device: torch.device) -> dict[str, Any]:
    """Decode step at batch 32, rows at ~1,000 tokens, in an 8,192- vs a 1,024-token cache."""
    out: dict[str, Any] = {}
    prompts = random_prompts(32, 960, args.vocab_size, seed=7)
    for cache in (8192, 1024):
        engine = RolloutEngine(model, max_batch_size=32, max_seq_len=cache,
                               use_cuda_graphs=False if args.no_graphs else None,
                               compile=False if args.no_compile else None)
        wall, _ = engine_generate(engine, prompts, 40, seed=0)
        replay = graph_replay_ms(engine, 32)
        out[f"cache{cache}"] = {"ms_per_step": wall / 40 * 1e3, "graph_replay_ms": replay}
        print(f"long context: batch 32, rows ~1000 tokens, cache {cache}: graph {replay or 0:.3f} ms/step", flush=True)
        del engine
    a, b = out["cache8192"]["graph_replay_ms"], out["cache1024"]["graph_replay_ms"]
    out["ratio"] = None if not a or not b else a / b
    return out


def graph_budget(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """The graph cache under a memory budget on the device: captures, evictions, bytes held vs budget."""
    probe = RolloutEngine(model, max_batch_size=8, max_seq_len=256,
                          use_cuda_graphs=False if args.no_graphs else None, compile=False if args.no_compile else None)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=4, stop_token_ids=[])
    probe.generate(random_prompts(8, 16, args.vocab_size, seed=1), cfg)
    one = probe.graph_stats.get("bytes", 0.0)  # one decode graph of batch 8
    budget = int(2.5 * max(one, 1.0))
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=256, graph_memory_budget_bytes=budget,
                           use_cuda_graphs=False if args.no_graphs else None, compile=False if args.no_compile else None)
    for batch in (8, 4, 2, 1, 8):
        engine.generate(random_prompts(batch, 16, args.vocab_size, seed=batch), cfg)
    stats = engine.graph_stats
    out = {"one_graph_bytes": one, "budget_bytes": budget, **stats,
           "within_budget": stats.get("bytes", 0.0) <= budget}
    print(f"graph budget {budget / 2**20:.1f} MiB: {stats.get('captures', 0):.0f} captures, "
          f"{stats.get('evictions', 0):.0f} evictions, {stats.get('bytes', 0) / 2**20:.1f} MiB held", flush=True)
    return out


def kernel_profile(engine: RolloutEngine, args: argparse.Namespace, batch: int = 1, steps: int = 64) -> dict[str, Any]:
    """Where a decode step's time goes at ``batch``: kernels (CUDA) or ops (CPU) per step, largest first.

    Profiles one ``generate`` of ``steps`` tokens after a warm one (graphs captured, so on the GPU the
    kernels are those a graph replays; CUPTI reports each kernel of a replay). Prefill is in the
    window too, once: its share over 64 steps is small and is named by its own kernels.
    """
    from torch.profiler import ProfilerActivity, profile

    steps = min(steps, args.new_tokens)
    prompts = random_prompts(batch, args.prompt_len, args.vocab_size, seed=7)
    engine_generate(engine, prompts, 4, seed=0)
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        wall, _ = engine_generate(engine, prompts, steps, seed=1)
    kernels = kernel_totals(prof, cuda)
    return {
        "batch": batch, "steps": steps, "wall_ms_per_step": wall / steps * 1e3,
        "busy_ms_per_step": kernels["busy_us"] / steps / 1e3, "what": kernels["what"],
        "top": [{"name": k["name"], "us_per_step": k["us"] / steps, "calls_per_step": k["calls"] / steps,
                 "share": k["share"]} for k in kernels["top"]],
    }


def summary_of(result: dict[str, Any]) -> dict[str, Any]:
    """The issue's summary keys, from the rows measured in this run."""
    rows = {r["batch"]: r for r in result["rows"] if "error" not in r}
    unfused = {r["batch"]: r for r in result.get("unfused_rows", []) if "error" not in r}
    verify = result.get("verify_cost", {})
    ratio = lambda b: (verify.get(f"b{b}") or {}).get("ratio")  # noqa: E731
    cold = result.get("cold_start", {}).get("summary", {})
    return {
        "first_call_s_b1": cold.get("first_call_s_b1"),
        "warm_restart_s": cold.get("warm_restart_s"),
        "capture_s_per_graph": cold.get("capture_s_per_graph"),
        "ms_per_step_b1": rows.get(1, {}).get("engine_ms_per_step"),
        "tok_s_b128": rows.get(128, {}).get("engine_tokens_per_s"),
        "verify5_over_decode_b1": ratio(1),
        "verify5_over_decode_b8": ratio(8),
        "long_context_ratio_b32": result.get("long_context", {}).get("ratio"),
        "hf_ratio_b1": rows.get(1, {}).get("speedup_vs_hf"),
        "hf_ratio_b128": rows.get(128, {}).get("speedup_vs_hf"),
        # the default is fuse_projections=True; the unfused engine measured in the same run ("fused" part)
        "unfused_ms_per_step_b1": unfused.get(1, {}).get("engine_ms_per_step"),
        "unfused_tok_s_b128": unfused.get(128, {}).get("engine_tokens_per_s"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--size", default="400m")
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--batches", default="1,8,32,128,256")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--hf-new-tokens", type=int, default=128)
    parser.add_argument("--hf-batches", default="1,128", help="batches HF generate is run at (it is slow)")
    parser.add_argument("--verify-vocab", type=int, default=151936, help="vocabulary of the verify-cost model")
    parser.add_argument(
        "--parts", default="coldstart,rows,fused,profile,verify,long,budget",
        help="which parts to run (coldstart: build to first token at batch 1 in a fresh process on an empty "
        "compile cache, then a warm restart, and one more graph's capture, see cold_start.py; fused: batches 1 "
        "and 128 with fuse_projections=False, the baseline of the default fused engine; profile: the kernels "
        "of a batch-1 decode step, it needs rows' batch 1)",
    )
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    add_common_flags(parser, out="JSON path (default: benchmarks/results/engine_<card>_<date>.json)",
                     smoke="tiny sizes for a CPU check in seconds")
    args = parser.parse_args()
    if args.smoke:
        args.batches, args.new_tokens, args.hf_new_tokens, args.prompt_len = "1,4", 16, 8, 8
        args.vocab_size = min(args.vocab_size, 128)
        args.verify_vocab, args.hf_batches, args.parts = 128, "1,4", "rows,fused,profile,verify"
    args.hf_batch_list = [int(b) for b in args.hf_batches.split(",")]
    parts = set(args.parts.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    t0 = time.perf_counter()
    model = build_model(args.arch, args.size, vocab_size=args.vocab_size, seed=0).to(device=device, dtype=dtype)
    model.eval()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device, 2**31 if device.type == "cuda" else 2**26)
    floor_ms = param_bytes / bandwidth * 1e3
    max_seq = args.prompt_len + args.new_tokens
    engine = RolloutEngine(
        model, max_batch_size=max(batches), max_seq_len=max_seq,
        use_cuda_graphs=False if args.no_graphs else None, compile=False if args.no_compile else None,
    )
    stamp = dt.datetime.now(dt.timezone.utc)
    out_path = Path(args.out) if args.out else Path(__file__).parent / "results" / ("smoke" if args.smoke else "") / (
        f"engine_{card.replace(' ', '_')}_{stamp:%Y%m%d_%H%M}{'_smoke' if args.smoke else ''}.json"
    )
    result: dict[str, Any] = {
        "card": card, "torch": torch.__version__, "transformers": transformers.__version__,
        "date": stamp.isoformat(timespec="seconds"), "device": str(device), "dtype": str(dtype),
        "model": {"arch": args.arch, "size": args.size, "vocab_size": args.vocab_size, "params": params,
                  "param_bytes": param_bytes, "build_s": build_s},
        "settings": {"prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                     "hf_new_tokens": args.hf_new_tokens, "batches": batches, "smoke": args.smoke,
                     "compile": not args.no_compile, "cuda_graphs": not args.no_graphs},
        "copy_bandwidth_GBps": bandwidth / 1e9, "weight_read_floor_ms": floor_ms,
        "kv_cache_bytes": None, "rows": [],
    }

    def dump() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2))
        extra = os.environ.get("OUT")
        if extra:
            Path(extra, out_path.name).write_text(json.dumps(result, indent=2))

    print(f"{card} | {params / 1e6:.0f} M params, floor {floor_ms:.3f} ms/step at {bandwidth / 1e9:.0f} GB/s")
    if "coldstart" in parts:  # first: fresh processes, nothing of this one's compiling to lean on
        import cold_start

        cold_args = cold_start.parse_args([  # its own parser: every flag it reads, with its defaults
            "--configs=b1", "--arms=regions", f"--size={args.size}", f"--slots={min(128, max(batches))}", "--rows=1",
            "--samples=1", "--threshold=32", "--new-tokens=1", f"--max-seq-len={args.prompt_len + args.new_tokens}",
            *([f"--vocab-size={args.vocab_size}"] if args.vocab_size is not None else []),
            *(["--smoke"] if args.smoke else []),
            f"--out={out_path.with_name(out_path.stem + '_cold_start.json')}",  # never over a cold_start.py report
        ])
        result["cold_start"] = cold_start.measure(cold_args)
        dump()
    for batch in batches if "rows" in parts else []:
        try:
            row = bench_batch(engine, model, batch, args, device, floor_ms)
        except Exception as err:  # record and go on: one failed size must not lose the others
            row = {"batch": batch, "error": repr(err)}
            print(f"batch {batch}: FAILED {err!r}", flush=True)
        result["rows"].append(row)
        result["graphs"] = engine.graph_stats
        result["kv_cache_bytes"] = engine._cache.nbytes if engine._cache is not None else None
        dump()
    if "fused" in parts:  # the same rows with q|k|v and gate|up as one GEMM each, side by side
        unfused_engine = RolloutEngine(
            model, max_batch_size=max(batches), max_seq_len=max_seq, fuse_projections=False,
            use_cuda_graphs=False if args.no_graphs else None, compile=False if args.no_compile else None,
        )
        quiet = argparse.Namespace(**{**vars(args), "skip_hf": True})
        print("fuse_projections=False (the baseline of the default, fused engine above):", flush=True)
        result["unfused_rows"] = []
        for batch in [b for b in batches if b in (1, 128)] or batches[:1]:
            try:
                row = bench_batch(unfused_engine, model, batch, quiet, device, floor_ms)
            except Exception as err:  # record and go on
                row = {"batch": batch, "error": repr(err)}
                print(f"unfused, batch {batch}: FAILED {err!r}", flush=True)
            result["unfused_rows"].append(row)
            dump()
        result["fused_bytes"] = engine._runner.fused_bytes if engine._runner is not None else 0
        del unfused_engine
    if "profile" in parts and 1 in batches:
        try:
            result["profile_b1"] = prof = kernel_profile(engine, args)
            print(f"batch 1 profile: {prof['busy_ms_per_step']:.3f} ms of {prof['what']} per step "
                  f"(wall {prof['wall_ms_per_step']:.3f} ms under the profiler)")
            for item in prof["top"][:12]:
                print(f"  {item['us_per_step']:8.1f} us  {item['calls_per_step']:5.1f}x  {item['share']:6.1%}  "
                      f"{item['name'][:90]}")
        except Exception as err:  # report, do not lose the figures above
            print(f"profile: FAILED {err!r}", flush=True)
            result["profile_error"] = repr(err)
        dump()
    try:
        result["sanity"] = sanity(model, engine, args.vocab_size, device) if "rows" in parts else {}
    except Exception as err:  # report, do not lose the figures above
        result["sanity"] = {"error": repr(err)}
    result["graphs"] = engine.graph_stats
    result["attention"] = engine.attention
    del engine
    for part, fn in (("long", lambda: long_context(args, model, device)), ("budget", lambda: graph_budget(args, model)),
                     ("verify", lambda: verify_cost(args, device, dtype))):
        if part in parts:
            try:
                result[{"long": "long_context", "budget": "graph_budget", "verify": "verify_cost"}[part]] = fn()
            except Exception as err:  # one failed part must not lose the others
                print(f"{part}: FAILED {err!r}", flush=True)
                result[part + "_error"] = repr(err)
            dump()
    result["summary"] = summary_of(result)
    dump()
    print("summary:", json.dumps(result["summary"], indent=1))
    print("sanity:", json.dumps(result["sanity"]))
    print("graphs:", json.dumps(result["graphs"]))
    print("wrote", out_path)


if __name__ == "__main__":
    main()
