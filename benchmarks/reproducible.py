"""Reproducible rollouts (issue 35): speculation on vs off token for token, and what determinism costs.

On the e2e's workload (its warm-started policy, task and difficulty; held-out requests, its prompts x
samples on as many slots, up to ``--max-new`` tokens, temperature 1), one fresh engine per arm, each
once as a warm-up (compiling and capturing) and then timed, all with the same seed:

- ``off``: speculation off (the reference);
- ``coupled``: the suffix drafter, `SpeculativeConfig(verification="coupled")`, the tuner on measured time;
- ``rejection``: the same with rejection sampling (the default);
- ``coupled_deterministic``: coupled, the tuner on its fixed cost model (`SpeculativeConfig.deterministic`).

Per arm: wall time, tokens, tokens/s, acceptance length, and against ``off``: the share of rollouts
that are token-identical and, for the others, where they first differ (the completion position)
and the exponential race's margin there, ``(log p(a) - log E_a) - (log p(b) - log E_b)`` in nats for
``off``'s token ``a`` and the arm's ``b`` (each logprob as its own run reported it, ``E`` the keyed
noise both drew): a near-tie of the race, which different kernels' rounding can flip, has a margin
near 0. With float32 on the CPU a coupled arm is token-identical (tested); the figure that matters
is bf16 on the GPU. ``summary``: ``identical_share`` per arm, ``coupled_over_rejection_tokens_per_s``,
``deterministic_over_measured_tokens_per_s``.

GPU: ``python benchmarks/reproducible.py``; CPU smoke check: ``python benchmarks/reproducible.py --smoke``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import platform
import statistics
import time
from typing import Any

import torch
from _common import add_common_flags, add_workload_flags, smoke_workload, workload_policy, write_results
from e2e.options import E2EOptions

from lightning_tlt.core.sampling import NOISE_SAMPLE, call_seed, keyed_exponential, row_keys
from lightning_tlt.core.types import RolloutOutput, SamplingConfig, SpeculativeConfig
from lightning_tlt.models.tokenizer import encode_prompt
from lightning_tlt.rollout.engine import RolloutEngine
from lightning_tlt.tasks import get_task

ARMS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "coupled": {"verification": "coupled"},
    "rejection": {"verification": "rejection"},
    "coupled_deterministic": {"verification": "coupled", "deterministic": True},
}


def call_keys(seed: int, prompts: list[list[int]], samples: int) -> list[int]:
    """The rows' noise keys of ``engine.generate(prompts, num_samples=samples, generator=manual_seed(seed))``."""
    return row_keys(call_seed(torch.Generator().manual_seed(seed)), prompts, samples)


def divergence(ref: RolloutOutput, out: RolloutOutput, keys: list[int]) -> dict[str, Any]:
    """How ``out``'s rollouts differ from ``ref``'s, row for row (same prompts, samples and seed).

    Returns the share of identical rows and, per differing row, the first position where they differ
    and the race's margin there (see the module docstring; NaN where one row ended before the other).
    """
    first, margins = [], []
    for row, (a, b) in enumerate(zip(ref.completion_ids, out.completion_ids)):
        if a == b:
            continue
        t = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        first.append(t)
        if t >= min(len(a), len(b)):
            margins.append(float("nan"))
            continue
        noise = keyed_exponential(torch.tensor([keys[row]]), torch.tensor([t]), NOISE_SAMPLE,
                                  torch.tensor([a[t], b[t]]))[0]
        margins.append((ref.logprobs[row][t] - math.log(float(noise[0])))
                       - (out.logprobs[row][t] - math.log(float(noise[1]))))
    rows = len(ref.completion_ids)
    finite = [abs(m) for m in margins if m == m]
    return {
        "rows": rows,
        "identical_share": (rows - len(first)) / rows if rows else float("nan"),
        "first_difference": first,
        "first_difference_median": statistics.median(first) if first else None,
        "race_margin_nats": margins,
        "race_margin_abs_median": statistics.median(finite) if finite else None,
    }


def timed(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingConfig, samples: int,
          seed: int) -> tuple[RolloutOutput, float, float]:
    """A warm-up call (another seed: it compiles and captures), then the timed one; (output, wall, warm-up wall)."""
    def call(s: int) -> tuple[RolloutOutput, float]:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = engine.generate(prompts, sampling, num_samples=samples, generator=torch.Generator().manual_seed(s))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    _, warm = call(seed + 1000)
    out, wall = call(seed)
    return out, wall, warm


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    e2e = E2EOptions()  # the e2e's workload and warm start: a warm machine's cached policy is reused
    add_workload_flags(p)
    p.add_argument("--prompts", type=int, default=e2e.prompts)
    p.add_argument("--samples", type=int, default=e2e.generations)
    p.add_argument("--max-new", type=int, default=e2e.max_new)
    p.add_argument("--threshold", type=int, default=e2e.threshold)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    add_common_flags(p, seed=7)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if "off" not in arms or set(arms) - set(ARMS):
        raise SystemExit(f"--arms takes 'off' and any of {', '.join(ARMS)}, got {args.arms!r}")
    if args.smoke:
        smoke_workload(args)
        args.prompts, args.samples, args.max_new, args.threshold = 4, 2, 48, 4
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    results: dict[str, Any] = {"benchmark": "reproducible", "args": vars(args),
                               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                               "card": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                               "dtype": str(dtype), "versions": {"torch": torch.__version__}}
    policy, tokenizer = workload_policy(args, device, dtype)
    test = get_task(args.task).make_dataset(args.prompts, difficulty=args.difficulty, seed=2, split="test")
    prompts = [encode_prompt(tokenizer, x) for x in test["prompt"]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new)
    longest = max(len(x) for x in prompts) + args.max_new
    slots = args.prompts * args.samples
    keys = call_keys(args.seed, prompts, args.samples)
    outs: dict[str, RolloutOutput] = {}
    table: dict[str, Any] = {}
    for name in arms:
        spec = ARMS[name]
        config = None if spec is None else SpeculativeConfig(method="suffix", threshold=args.threshold, **spec)
        engine = RolloutEngine(policy, max_batch_size=slots, max_seq_len=longest, speculative=config)
        out, wall, warm = timed(engine, prompts, sampling, args.samples, args.seed)
        tokens = sum(len(c) for c in out.completion_ids)
        outs[name] = out
        table[name] = {"wall_s": wall, "warmup_wall_s": warm, "tokens": tokens, "tokens_per_s": tokens / wall,
                       "accept_len": out.stats.get("spec/acceptance_length"),
                       "speculative_step_share": out.stats.get("spec/speculative_step_share"),
                       "compile_failures": engine.compile_failures}
        if name != "off":
            table[name]["vs_off"] = divergence(outs["off"], out, keys)
        print(f"[reproducible] {name}: {wall:.2f} s, {tokens} tokens, accept {table[name]['accept_len']}, "
              f"identical {table[name].get('vs_off', {}).get('identical_share', 1.0)}", flush=True)
        del engine
    results["runs"] = table

    def ratio(a: str, b: str) -> float | None:
        return table[a]["tokens_per_s"] / table[b]["tokens_per_s"] if a in table and b in table else None

    results["summary"] = {
        "identical_share": {n: t["vs_off"]["identical_share"] for n, t in table.items() if "vs_off" in t},
        "coupled_over_rejection_tokens_per_s": ratio("coupled", "rejection"),
        "deterministic_over_measured_tokens_per_s": ratio("coupled_deterministic", "coupled"),
    }
    print(f"{'arm':<24}{'wall s':>9}{'tokens':>9}{'tok/s':>10}{'accept':>8}{'identical':>11}{'1st diff p50':>14}")
    for name, t in table.items():
        vs = t.get("vs_off", {})
        print(f"{name:<24}{t['wall_s']:>9.2f}{t['tokens']:>9}{t['tokens_per_s']:>10.1f}"
              f"{t['accept_len'] or float('nan'):>8.2f}{vs.get('identical_share', 1.0):>11.3f}"
              f"{str(vs.get('first_difference_median', '-')):>14}")
    write_results(results, "reproducible", smoke=args.smoke, cuda=cuda, out=args.out)
    return results


if __name__ == "__main__":
    main()
