"""Where a compiled engine's first rollout spends its seconds, cold and with its compile cache warm.

Each measurement is a fresh process (`--child`): it builds the e2e's policy shape (the ``0.5b`` zoo
model, bf16, random weights: compile and capture do not depend on the values), an engine of
``--slots`` rows with the suffix drafter speculating and an EAGLE drafter staged (the e2e's
configuration ``tlt``; ``--no-spec`` is ``nospec``), and runs a first ``generate`` whose rows fall
below the gate's threshold so speculation turns on, then a second, steady call of the same size and a
third (``steady_again``: a one-time cost in the second, such as a kernel's first launch, shows as their
difference).
It reports the first call's wall time split into Dynamo tracing, Inductor compiling, graph capture
and the rest, the number of graphs captured, and the steady call's time. The parent runs the child
twice on one compile cache directory: cold (empty) and warm (a restart of the same run), once per
arm of ``--arms``, side by side:

- ``regions`` (runs named ``<config>``): the engine's defaults: the policy's forward compiled by
  region (`lightning_tlt.rollout.steps.PolicyRegions`: one decoder layer compiled, which every layer
  runs) and every compiled version stored (`lightning_tlt.core.stored_compile`: a restart loads them
  and traces nothing);
- ``whole`` (``<config>_whole``): the forward compiled as one graph over every layer
  (``LIGHTNING_TLT_COMPILE_REGIONS=0``), stored;
- ``plain`` (``<config>_plain``): regions, with plain ``torch.compile`` over the run's Inductor cache
  (``LIGHTNING_TLT_COMPILE_AOT=0``: a restart traces again).

``ratios`` holds, per configuration, each other arm's first call over the ``regions`` arm's, cold and
warm (``<config>_cold_whole_over_regions``, ``<config>_warm_plain_over_regions``...); the b1
configuration also times steady decode steps at batch 1 and 64 (``steady_ms_per_step``), so a faster
compile is never bought with slower steps unseen. ``summary.<config>_tokens_equal`` says whether
every process of a configuration sampled the same tokens. The JSON is written after every process,
so a call cut short keeps what it measured.

GPU: ``python benchmarks/cold_start.py --configs b1,tlt`` (about 6-9 minutes). CPU smoke: ``--smoke``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from _common import add_common_flags, kernel_totals, write_results

from lightning_tlt.core import stored_compile
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine


def _compile_seconds() -> dict[str, float]:
    """Dynamo's and Inductor's cumulative compile times in this process (torch's own counters)."""
    from torch._dynamo.utils import compilation_time_metrics

    totals = {name: float(sum(times)) for name, times in compilation_time_metrics.items()}
    dynamo = totals.get("_compile.compile_inner", 0.0)
    backend = sum(v for k, v in totals.items() if "compile_fx" in k and "inner" in k) or totals.get(
        "OutputGraph.call_user_compiler", 0.0
    )
    return {"dynamo_total_s": dynamo, "backend_s": backend}


def child_b1(args: argparse.Namespace) -> dict[str, Any]:
    """The engine benchmark's cold start: build to first token at batch 1, then captures at larger batches.

    ``build_to_first_token_s``: the engine built and a one-token ``generate`` at batch 1 (prefill, and
    the first decode step's compile and capture). Then a few tokens at batches 4 to ``--slots``: each
    captures its bucket's graph with the step functions compiled already, so their seconds over
    their captures are what one more CUDA graph costs (``capture_s_per_graph``).
    """
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    size = "tiny" if args.smoke else args.size
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model("qwen2", size, vocab_size=args.vocab_size, seed=0).to(device=device, dtype=dtype).eval()
    vocab = model.config.vocab_size
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine = RolloutEngine(model, max_batch_size=args.slots, max_seq_len=args.max_seq_len, compile=True)
    one = SamplingConfig(temperature=1.0, max_new_tokens=1, stop_token_ids=[])
    engine.generate([[5, 6, 7, 8]], one, generator=torch.Generator().manual_seed(0))
    if device.type == "cuda":
        torch.cuda.synchronize()
    first = time.perf_counter() - start
    stats0 = dict(engine.graph_stats)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=4, stop_token_ids=[])
    batches = [b for b in (4, 8, 16, 32, 64, 128, 256) if b <= args.slots]
    t0 = time.perf_counter()
    for b in batches:
        prompts = torch.randint(3, vocab, (b, 8), generator=torch.Generator().manual_seed(b)).tolist()
        engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(1))
    more = time.perf_counter() - t0
    stats1 = dict(engine.graph_stats)
    captures = stats1["captures"] - stats0["captures"]
    pure = (stats1["capture_time_s"] - stats0["capture_time_s"]) - (stats1["compile_time_s"] - stats0["compile_time_s"])
    return {"build_to_first_token_s": first, "first_graphs": stats0, "more_batches": batches,
            "more_wall_s": more, "more_captures": captures,
            "capture_s_per_graph": pure / captures if captures else None,
            "compile_s_in_more": stats1["compile_time_s"] - stats0["compile_time_s"],
            "steady_ms_per_step": steady_steps(engine, vocab, [1, min(64, args.slots)], device, args.steady_tokens),
            "stored_compile": stored_compile.stats(), "compiled_by_function": stored_compile.stats_by_function(),
            **({"profile": profiled(engine, [[5, 6, 7, 8]], SamplingConfig(
                temperature=1.0, max_new_tokens=args.steady_tokens, stop_token_ids=[]), 1)} if args.profile else {})}


def profiled(engine: RolloutEngine, prompts: list[list[int]], cfg: SamplingConfig, samples: int) -> dict[str, Any]:
    """One more ``generate`` under ``torch.profiler``: its wall time and its kernels by GPU time (``--profile``:
    a process whose steady calls are slower shows which kernels are)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        engine.generate(prompts, cfg, num_samples=samples, generator=torch.Generator().manual_seed(1))
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    return {"wall_s": wall, **kernel_totals(prof, cuda)}


def steady_steps(engine: RolloutEngine, vocab: int, batches: list[int], device: torch.device,
                 tokens: int) -> dict[str, float]:
    """Milliseconds per decode step at each batch, once compiled and captured: a call of ``tokens`` new tokens
    a row run once to capture its profiles, then timed (its prefill of 8 tokens a row included)."""
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=tokens, stop_token_ids=[])
    out: dict[str, float] = {}
    for b in batches:
        prompts = torch.randint(3, vocab, (b, 8), generator=torch.Generator().manual_seed(100 + b)).tolist()
        times = []
        for _ in range(2):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(2))
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out[f"b{b}"] = 1000 * times[-1] / tokens
    return out


def child(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    t_build = time.perf_counter()
    size = "tiny" if args.smoke else args.size
    model = build_model("qwen2", size, seed=0, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    model.to(device).eval()
    spec = None if args.no_spec else SpeculativeConfig(method="suffix", threshold=args.threshold, hysteresis_steps=4)
    kwargs: dict[str, Any] = {"fuse_projections": True} if args.fused else {}
    engine = RolloutEngine(model, max_batch_size=args.slots, max_seq_len=args.max_seq_len, compile=True,
                           speculative=spec, **kwargs)  # fmt: skip
    if spec is not None:
        engine.stage_drafter(EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(1)).to(device))
    build_s = time.perf_counter() - t_build
    rows = args.rows
    prompts = torch.randint(3, min(200, engine.vocab_size), (rows // args.samples, 24), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=args.new_tokens, stop_token_ids=[])
    out: dict[str, Any] = {"build_s": build_s}
    for name in ("first", "steady", "steady_again"):  # a third call: a one-time cost in the second shows
        before = _compile_seconds()
        start = time.perf_counter()
        result = engine.generate(prompts, cfg, num_samples=args.samples, generator=torch.Generator().manual_seed(1))
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
        tokens = hashlib.sha256(json.dumps(result.completion_ids).encode()).hexdigest()[:16]
        after = _compile_seconds()
        stats = dict(engine.last_stats)
        out[name] = {
            "wall_s": wall,
            "dynamo_s": after["dynamo_total_s"] - before["dynamo_total_s"],
            "backend_s": after["backend_s"] - before["backend_s"],
            "compile": {k: v for k, v in stats.items() if k.startswith("compile/")},
            "spec_steps": stats.get("spec/steps", 0.0),
            "graph_stats": engine.graph_stats,
            "tokens_sha": tokens,
        }
    if args.profile:
        out["profile"] = profiled(engine, prompts, cfg, args.samples)
    out["stored_compile"] = stored_compile.stats()  # a version that fell back to plain torch.compile shows here
    out["compiled_by_function"] = stored_compile.stats_by_function()  # where a cold first call's compiling went
    out["cache"] = dict(engine.last_stats.get("compile_cache", {})) if isinstance(
        engine.last_stats.get("compile_cache"), dict) else {}
    return out


def child_flags(args: argparse.Namespace, *, spec: bool) -> list[str]:
    """The command line of a child measuring one configuration with the parent's settings."""
    names = ("size", "slots", "rows", "samples", "threshold", "new_tokens", "max_seq_len", "vocab_size")
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in names if getattr(args, name) is not None]
    flags += [f"--{name}" for name in ("fused", "smoke", "profile") if getattr(args, name)]
    return flags + ([] if spec else ["--no-spec"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's flags, checked (``engine.py --parts coldstart`` builds its settings here too)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="0.5b")
    parser.add_argument("--vocab-size", type=int, default=None, help="the b1 configuration's vocabulary")
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16, help="rows of each call (below --threshold: it speculates)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--threshold", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--max-seq-len", type=int, default=4224)
    parser.add_argument("--no-spec", action="store_true")
    parser.add_argument("--fused", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--configs", default="nospec,tlt", help="which of nospec,tlt,b1 to run")
    parser.add_argument("--b1", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arms", default="regions,whole",
                        help=f"which of {','.join(ARMS)} to measure side by side (see the module docstring)")
    parser.add_argument("--warm-arms", default=None,
                        help="the arms also restarted warm (default: every arm of --arms); the others run cold only")
    parser.add_argument("--resume", default=None, metavar="JSON",
                        help="a report of this script cut short: keep its runs, measure the ones it lacks")
    parser.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    parser.add_argument("--steady-tokens", type=int, default=128, help="tokens a row of b1's timed steady calls")
    parser.add_argument("--profile", action="store_true",
                        help="one more call per process under torch.profiler: its kernels by GPU time (`profile`)")
    add_common_flags(parser)
    args = parser.parse_args(argv)
    for flag in ("arms", "warm_arms"):
        unknown = [arm for arm in (getattr(args, flag) or "").split(",") if arm and arm not in ARMS]
        if unknown:
            parser.error(f"--{flag.replace('_', '-')}: unknown {unknown}; allowed: {list(ARMS)}")
    if args.resume is not None and not os.path.isfile(args.resume):
        parser.error(f"--resume: no such file {args.resume!r}")
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        print("RESULT " + json.dumps(child_b1(args) if args.b1 else child(args), default=float), flush=True)
        return
    results = measure(args)
    write_results(results, "cold_start", smoke=args.smoke, cuda=torch.cuda.is_available(), out=args.out)


ARMS = {
    "regions": ("", {"LIGHTNING_TLT_COMPILE_AOT": "1", "LIGHTNING_TLT_COMPILE_REGIONS": "1"}),
    "whole": ("_whole", {"LIGHTNING_TLT_COMPILE_AOT": "1", "LIGHTNING_TLT_COMPILE_REGIONS": "0"}),
    "plain": ("_plain", {"LIGHTNING_TLT_COMPILE_AOT": "0", "LIGHTNING_TLT_COMPILE_REGIONS": "1"}),
}
"""Each arm's run-name suffix and the settings its processes run under (see the module docstring)."""


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Each configuration twice in fresh processes on one empty compile cache per arm: cold, then a warm
    restart (``<config><suffix>_cold``, ``..._warm``); the JSON rewritten after every process."""
    card = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    settings_ = {k: v for k, v in vars(args).items() if k not in ("child", "out", "commit", "resume")}
    runs: dict[str, Any] = {}
    if args.resume is not None:  # the same card, versions and settings, or the runs are not side by side
        with open(args.resume) as f:
            earlier = json.load(f)
        for what, mine, theirs in (("card", card, earlier["card"]), ("torch", torch.__version__,
                                   earlier["versions"]["torch"])):  # fmt: skip
            if mine != theirs:
                raise SystemExit(f"--resume: {args.resume} measured {what} {theirs!r}, this run has {mine!r}")
        runs = earlier["runs"]
    results: dict[str, Any] = {
        "benchmark": "cold_start", "date": dt.datetime.now().isoformat(timespec="seconds"),
        "commit": args.commit or _git_head(), "card": card,
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "settings": settings_, "resumed_from": args.resume, "runs": runs,
    }
    warm_arms = (args.warm_arms or args.arms).split(",")
    for config in args.configs.split(","):
        for arm in args.arms.split(","):
            suffix, settings = ARMS[arm]
            name = config + suffix
            starts = ("cold", "warm") if arm in warm_arms else ("cold",)
            if all(f"{name}_{start}" in runs for start in starts):
                continue  # measured by the run resumed (a warm restart needs its own cold run's cache)
            with tempfile.TemporaryDirectory() as cache:
                env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "LIGHTNING_TLT_CACHE": cache, **settings}
                for start in starts:
                    results["runs"][f"{name}_{start}"] = run = run_child(args, config, env)
                    print(line_of(name, start, run), flush=True)
                    results["summary"] = summary_of(results["runs"])
                    results["ratios"] = ratios_of(results["runs"])
                    # what is measured so far, should the call be cut short
                    write_results(results, "cold_start", smoke=args.smoke, cuda=torch.cuda.is_available(),
                                  out=args.out, quiet=True)
    return results


def _git_head() -> str | None:
    done = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "HEAD"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip() or None


def run_child(args: argparse.Namespace, config: str, env: dict[str, str]) -> dict[str, Any]:
    """One fresh process measuring ``config``; its RESULT line, with the process's wall time."""
    flags = child_flags(args, spec=config != "nospec") + (["--b1"] if config == "b1" else [])
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", *flags], env=env, capture_output=True, text=True,
                          check=False)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        print(proc.stdout[-3000:], proc.stderr[-5000:], flush=True)
        raise SystemExit(f"{config}: child failed (exit {proc.returncode})")
    run: dict[str, Any] = json.loads(line[len("RESULT "):])
    run["process_s"] = time.perf_counter() - t0
    run["measured_at"] = dt.datetime.now().isoformat(timespec="seconds")  # a resumed report's runs differ here
    return run


def line_of(name: str, start: str, run: dict[str, Any]) -> str:
    """The table row of one measured process."""
    if "build_to_first_token_s" in run:
        return (f"{name:10s} {start:5s} | process {run['process_s']:6.1f} s | build to first token "
                f"{run['build_to_first_token_s']:6.2f} s | {run['more_captures']:.0f} more graphs, "
                f"{run['capture_s_per_graph'] or 0:.3f} s each | steady "
                + ", ".join(f"{b} {ms:.3f} ms" for b, ms in (run.get("steady_ms_per_step") or {}).items())
                + _stored_of(run) + _profile_of(run))
    first = run["first"]
    return (f"{name:10s} {start:5s} | process {run['process_s']:6.1f} s | build {run['build_s']:5.1f} s | "
            f"first call {first['wall_s']:6.1f} s (dynamo {first['dynamo_s']:5.1f}, backend "
            f"{first['backend_s']:5.1f}, captures {first['graph_stats'].get('captures', 0):.0f} in "
            f"{first['graph_stats'].get('capture_time_s', 0):5.1f} s) | steady call "
            f"{run['steady']['wall_s']:5.2f} s"
            + (f", again {run['steady_again']['wall_s']:5.2f} s" if "steady_again" in run else "")
            + f" | tokens {first['tokens_sha']}" + _stored_of(run) + _profile_of(run))


def _profile_of(run: dict[str, Any]) -> str:
    """The profiled call's busiest kernels (``--profile``), on lines of their own."""
    prof = run.get("profile")
    if not prof:
        return ""
    return (f"\n    profiled call {prof['wall_s']:.3f} s, {prof['what']} busy {prof['busy_us'] / 1e3:.1f} ms: "
            + "; ".join(f"{k['us'] / 1e3:.1f} ms x{k['calls']} {k['name'][:60]}" for k in prof["top"][:6]))


def _stored_of(run: dict[str, Any]) -> str:
    s = run.get("stored_compile") or {}
    return (f" | stored: {s.get('compiled', 0):.0f} compiled, {s.get('loaded', 0):.0f} loaded in "
            f"{s.get('load_s', 0):.1f} s, {s.get('fell_back', 0):.0f} fell back")


def _first_call_s(run: dict[str, Any]) -> float:
    return float(run["build_to_first_token_s"] if "build_to_first_token_s" in run else run["first"]["wall_s"])


def summary_of(runs: dict[str, Any]) -> dict[str, Any]:
    """Cold and warm figures of every run (b1: the engine benchmark's keys, for the default arm; the other
    arms' with their suffix), the steady steps, and whether each configuration's processes agreed."""
    out: dict[str, Any] = {}
    for suffix in ("", "_whole", "_plain"):
        if f"b1{suffix}_cold" in runs:
            cold = runs[f"b1{suffix}_cold"]
            out[f"first_call_s_b1{suffix}"] = cold["build_to_first_token_s"]
            out[f"capture_s_per_graph{suffix}"] = cold["capture_s_per_graph"]
            for batch, ms in (cold.get("steady_ms_per_step") or {}).items():
                out[f"steady_ms_per_step_{batch}{suffix}"] = ms
        if f"b1{suffix}_warm" in runs:
            out[f"warm_restart_s{suffix}"] = runs[f"b1{suffix}_warm"]["build_to_first_token_s"]
    for config in ("nospec", "tlt"):
        for suffix in ("", "_whole", "_plain"):
            for start in ("cold", "warm"):
                if f"{config}{suffix}_{start}" in runs:
                    run = runs[f"{config}{suffix}_{start}"]
                    out[f"{config}{suffix}_first_call_{start}_s"] = run["first"]["wall_s"]
                    out[f"{config}{suffix}_steady_call_{start}_s"] = run["steady"]["wall_s"]
                    if "steady_again" in run:
                        out[f"{config}{suffix}_steady_again_call_{start}_s"] = run["steady_again"]["wall_s"]
    # versions that fell back to plain torch.compile where stored ones were asked for (their restarts trace)
    out["stored_fell_back"] = sum((run.get("stored_compile") or {}).get("fell_back", 0)
                                  for name, run in runs.items() if "_plain" not in name)  # fmt: skip
    digests: dict[str, set[str]] = {}
    for name, run in runs.items():
        if "first" in run:
            digests.setdefault(name.split("_")[0], set()).add(run["first"]["tokens_sha"])
    for config, seen in digests.items():
        # a restart that loads stored compiled code, and every other arm, must sample what the cold process did
        out[f"{config}_tokens_equal"] = len(seen) == 1
    return out


def ratios_of(runs: dict[str, Any]) -> dict[str, float]:
    """Each arm's first call over the default arm's (``regions``), side by side in this run, cold and warm:
    ``<config>_<start>_<arm>_over_regions`` (> 1: the default starts faster)."""
    out: dict[str, float] = {}
    for config in ("b1", "nospec", "tlt"):
        for arm in ("whole", "plain"):
            for start in ("cold", "warm"):
                if f"{config}_{start}" in runs and f"{config}_{arm}_{start}" in runs:
                    out[f"{config}_{start}_{arm}_over_regions"] = _first_call_s(
                        runs[f"{config}_{arm}_{start}"]) / _first_call_s(runs[f"{config}_{start}"])
    return out


if __name__ == "__main__":
    main()
