"""Tail throughput with speculation on vs off on a Qwen2.5-0.5B-shaped policy, and the speculative step's cost.

Issue 13's benchmark, in one process on one GPU:

1. warm-start (SFT) the zoo's ``0.5b`` policy (Qwen2.5-0.5B's shapes, its tied head of 151,936 rows)
   on a task (cached), so every per-token cost (head, sampling, drafter head) is the real model's.
   The SFT itself teaches the policy that the rows the kit's tokenizer never uses are never next:
   an earlier version widened a 32 K-row model with zero head rows instead, and its 120 K rows of
   logit 0 took most of the probability at temperature 1 (every rollout ran to the cap on junk ids,
   and no drafter could predict them: acceptance length 1.28 on the H200);
2. sample the policy's own rollouts and train an EAGLE drafter on them offline (the captured
   drafter train step of `DrafterCoTrainCallback`, back to back instead of in stalls);
3. generate the same held-out requests of the e2e's task and difficulty (``countdown_search`` d3, its
   8 prompts x 8 samples on 64 slots, up to 4,096 tokens: one RL step's rollout) at temperature 1 with
   speculation off, with the trained EAGLE drafter and with an untrained one (the tuner choosing k,
   k = 0 included), each once as a warm-up (a fresh engine's first call: compiling and capturing),
   then timed; every engine step is binned by its active rows (1, 2-4, 5-8, 9-16, 17-32, 33+):
   tokens/s per bin, acceptance, k. A step whose time held a graph capture is tallied apart in its
   bin (``captured_tokens``, ``captured_s``), never dropped: ``summary.capture_s`` per arm (warm-up
   and timed pass), and the tail speedup with and without those steps;
4. the speculative step's cost: CUDA-graph replay of one EAGLE step with k = 4 (draft chain and
   verify) over one plain decode step, at batch 1 and 8.

Prints a table and writes JSON under ``benchmarks/results/`` with ``"summary"``:
``spec_step_cost_k4_b1``, ``tail_speedup_rows_1_8`` (and ``_with_captures``), ``capture_s``,
``first_call_speedup``, ``accept_len``, ``cold_drafter_tail_ratio``. The policy is the e2e's warm start
(the same SFT settings and cache), so on a machine that ran the e2e it is loaded, not trained.

GPU: ``python benchmarks/speculative.py``; CPU smoke check: ``python benchmarks/speculative.py --smoke``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path
from typing import Any

import torch
from _common import add_common_flags, add_workload_flags, graph_replay_ms, smoke_workload, workload_policy
from e2e.options import E2EOptions

from lightning_tlt.callbacks.drafter_cotrain import DrafterCoTrainCallback, DrafterCoTrainConfig
from lightning_tlt.core.types import RolloutOutput, SamplingConfig, SpeculativeConfig, StepEvent
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.models.tokenizer import encode_prompt
from lightning_tlt.rollout.engine import RolloutEngine
from lightning_tlt.tasks import get_task

ROOT = Path(__file__).resolve().parent.parent
BINS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 32), (33, 1 << 30))


def bin_name(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else (f"{lo}+" if hi >= 1 << 30 else f"{lo}-{hi}")


class RowBinner:
    """Engine listener: tokens and step time per bin of active rows (the rows the step ran on), the steps
    that held a one-time graph capture (and the compiling inside it) tallied apart, never dropped."""

    def __init__(self) -> None:
        self.tokens = {b: 0 for b in BINS}
        self.seconds = {b: 0.0 for b in BINS}
        self.captured_tokens = {b: 0 for b in BINS}
        self.captured_seconds = {b: 0.0 for b in BINS}
        self._rows_before = 0

    @property
    def captured_s(self) -> float:
        return sum(self.captured_seconds.values())

    def __call__(self, event: StepEvent) -> None:
        if event.phase in ("decode", "speculative"):
            rows = self._rows_before or event.active_rows  # rows the step ran on
            tokens, seconds = (self.captured_tokens, self.captured_seconds) if event.captured else (
                self.tokens, self.seconds)  # a capture's step is no measure of the step's rate: apart
            for b in BINS:
                if b[0] <= rows <= b[1]:
                    tokens[b] += event.new_tokens
                    seconds[b] += event.step_time_s
        self._rows_before = event.active_rows if event.phase != "done" else 0

    def rates(self) -> dict[str, dict[str, float]]:
        return {
            bin_name(*b): {"tokens": self.tokens[b], "seconds": self.seconds[b],
                           "tokens_per_s": self.tokens[b] / self.seconds[b] if self.seconds[b] > 0 else float("nan"),
                           "captured_tokens": self.captured_tokens[b], "captured_s": self.captured_seconds[b]}
            for b in BINS
        }


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _binned(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingConfig, samples: int,
            seed: int) -> tuple[RolloutOutput, RowBinner, float]:
    binner = RowBinner()
    engine.add_listener(binner)
    _sync()
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling, num_samples=samples, generator=torch.Generator().manual_seed(seed))
    _sync()
    wall = time.perf_counter() - t0
    engine.remove_listener(binner)
    return out, binner, wall


def timed_generate(engine: RolloutEngine, prompts: list[list[int]], sampling: SamplingConfig, samples: int,
                   seed: int) -> tuple[RolloutOutput, RowBinner, float, dict[str, float]]:
    """Generate ``prompts`` once as a warm-up (it captures the graph profiles the timed pass meets: row
    buckets, the draft lengths the tuner tries), then once timed with step events binned by active rows.
    Returns the timed pass (output, bins, wall time) and the warm-up's wall and capture seconds: the
    one-time cost a short run pays, reported apart, not dropped."""
    _, warm, warm_s = _binned(engine, prompts, sampling, samples, seed + 1000)
    out, binner, wall = _binned(engine, prompts, sampling, samples, seed)
    return out, binner, wall, {"wall_s": warm_s, "capture_s": warm.captured_s}


@torch.no_grad()
def harvest(policy: torch.nn.Module, out: RolloutOutput, pad_id: int, device: str) -> dict[str, torch.Tensor]:
    """The policy's last hidden states over prompt + completion (what co-training harvests)."""
    seqs = [p + c for p, c in zip(out.prompt_ids, out.completion_ids)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    comp = torch.zeros_like(ids)
    for i, (p, s) in enumerate(zip(out.prompt_ids, seqs)):
        ids[i, : len(s)] = torch.tensor(s)
        attn[i, : len(s)] = 1
        comp[i, len(p) : len(s)] = 1
    feats = []
    for start in range(0, len(seqs), 16):
        sl = slice(start, start + 16)
        hs = policy(input_ids=ids[sl].to(device), attention_mask=attn[sl].to(device), output_hidden_states=True)
        feats.append(hs.hidden_states[-1])
    return {"features": torch.cat(feats), "input_ids": ids.to(device), "attention_mask": attn.to(device),
            "completion_mask": comp.to(device)}


def tail_rate(binner_rates: dict[str, dict[str, float]], bins: tuple[str, ...] = ("1", "2-4", "5-8"),
              captures: bool = False) -> float:
    """Tokens per second over the steps of ``bins`` (1 to 8 active rows), with the capture steps if ``captures``."""
    tokens = sum(binner_rates[b]["tokens"] + (binner_rates[b]["captured_tokens"] if captures else 0) for b in bins)
    seconds = sum(binner_rates[b]["seconds"] + (binner_rates[b]["captured_s"] if captures else 0) for b in bins)
    return tokens / seconds if seconds > 0 else float("nan")


def step_cost(policy: Any, drafter: Any, prompt: list[int], longest: int, batches: tuple[int, ...], k: int,
              into: dict[str, Any] | None = None, on_batch: Any = None,
              verification: str = "rejection") -> dict[str, Any]:
    """Replay times of one plain decode step, one EAGLE step of k drafts and one k + 1-token verify
    (the policy's forward alone, a suffix engine's), on the same rows: ``batch`` samples of ``prompt``.
    Each batch's figures go into ``into`` (returned) as they land, then ``on_batch()`` runs."""
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=48, stop_token_ids=[])
    most = max(batches)
    plain = RolloutEngine(policy, max_batch_size=most, max_seq_len=longest)
    fixed = RolloutEngine(policy, max_batch_size=most, max_seq_len=longest, speculative=SpeculativeConfig(
        method="eagle", num_draft_tokens=k, threshold=most, hysteresis_steps=1,
        verification=verification))  # type: ignore[arg-type]
    fixed.drafter = drafter
    suffix = RolloutEngine(policy, max_batch_size=most, max_seq_len=longest, speculative=SpeculativeConfig(
        method="suffix", num_draft_tokens=k, threshold=most, hysteresis_steps=1,
        verification=verification))  # type: ignore[arg-type]
    out: dict[str, Any] = {} if into is None else into
    for batch in batches:
        for engine in (plain, fixed, suffix):
            engine.generate([prompt], sampling, num_samples=batch, generator=torch.Generator().manual_seed(0))
        decode = graph_replay_ms(plain, batch, "decode", 1)
        speculative = graph_replay_ms(fixed, batch, "spec", k + 1)
        verify = graph_replay_ms(suffix, batch, "verify", k + 1)  # the policy's forward of k + 1 tokens alone
        out[f"b{batch}"] = {"decode_ms": decode, f"spec_k{k}_ms": speculative, f"verify{k + 1}_ms": verify,
                            "ratio": speculative / decode if decode and speculative else None,
                            "verify_ratio": verify / decode if decode and verify else None}
        print(f"[speculative] step cost at batch {batch}: {out[f'b{batch}']}", flush=True)
        if on_batch is not None:
            on_batch()
    return out


def parser() -> argparse.ArgumentParser:
    """The benchmark's flags (defaults: the e2e's workload)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    e2e = E2EOptions()  # the e2e's workload and warm start: a warm machine's cached policy is reused
    add_workload_flags(p)
    p.add_argument("--train-prompts", type=int, default=32, help="prompts (x4 samples) of drafter training data")
    p.add_argument("--drafter-steps", type=int, default=600)
    p.add_argument("--drafter-lr", type=float, default=1e-3)
    p.add_argument("--prompts", type=int, default=e2e.prompts, help="held-out requests per measured generate")
    p.add_argument("--samples", type=int, default=e2e.generations, help="samples of each request (the e2e's G)")
    p.add_argument("--slots", type=int, default=e2e.prompts * e2e.generations,
                   help="engine slots: the bulk phase runs at this batch (the e2e's: every row at once)")
    p.add_argument("--max-new", type=int, default=e2e.max_new)
    p.add_argument("--threshold", type=int, default=e2e.threshold)
    p.add_argument("--verification", choices=("rejection", "coupled"), default=e2e.verification,
                   help="how drafts are verified (SpeculativeConfig.verification): both lossless; coupled emits "
                        "the tokens of speculation off for the same seed")
    p.add_argument("--deterministic", action="store_true",
                   help="the tuner scores draft lengths on a fixed cost model, not measured time "
                        "(SpeculativeConfig.deterministic)")
    add_common_flags(p)
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    if args.smoke:
        smoke_workload(args)
        args.train_prompts, args.drafter_steps = 4, 20
        args.prompts, args.samples, args.slots, args.max_new, args.threshold = 4, 2, 4, 48, 4
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    task = get_task(args.task)
    results: dict[str, Any] = {"benchmark": "speculative", "args": vars(args),
                               "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                               "card": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
                               "versions": {"torch": torch.__version__}}
    out_path = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / ("smoke" if args.smoke else "") / (
        f"speculative_{'smoke' if args.smoke else device}_{dt.date.today():%Y%m%d}.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def dump() -> None:
        out_path.write_text(json.dumps(results, indent=1, default=float))

    t0 = time.perf_counter()
    policy, tokenizer = workload_policy(args, device, dtype)
    results["policy"] = {"params": sum(p.numel() for p in policy.parameters()),
                         "vocab_size": policy.config.vocab_size, "warm_start_s": time.perf_counter() - t0}
    print(f"[speculative] policy {results['policy']}", flush=True)
    train = task.make_dataset(args.train_prompts, difficulty=args.difficulty, seed=1, split="train")
    test = task.make_dataset(args.prompts, difficulty=args.difficulty, seed=2, split="test")
    train_ids = [encode_prompt(tokenizer, x) for x in train["prompt"]]
    test_ids = [encode_prompt(tokenizer, x) for x in test["prompt"]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=args.max_new)
    longest = max(len(x) for x in train_ids + test_ids) + args.max_new

    # --- speculation off (also the data for the drafter)
    off = RolloutEngine(policy, max_batch_size=args.slots, max_seq_len=longest)
    t0 = time.perf_counter()
    data_out = off.generate(train_ids, sampling, num_samples=4, generator=torch.Generator().manual_seed(0))
    results["data_s"] = time.perf_counter() - t0
    runs: dict[str, Any] = {"off": timed_generate(off, test_ids, sampling, args.samples, seed=7)}
    print(f"[speculative] off: {runs['off'][2]:.2f} s", flush=True)

    # --- train an EAGLE drafter offline on the policy's own rollouts
    cb = DrafterCoTrainCallback(DrafterCoTrainConfig(learning_rate=args.drafter_lr, batch_size=16, max_len=512,
                                                     buffer_tokens=4 * args.train_prompts * longest, warmup_steps=20,
                                                     heldout_fraction=0.0))
    drafter = cb.setup_drafter(policy)  # on the policy's device, float32 master weights
    assert cb.learner is not None
    h = harvest(policy, data_out, tokenizer.pad_token_id, device)
    cb.buffer.add(h["features"], h["input_ids"], h["attention_mask"], h["completion_mask"], step=0)
    _sync()
    t0 = time.perf_counter()
    steps = cb.learner.enqueue(args.drafter_steps, block=True)  # the captured step, replayed back to back
    cb.learner.wait()
    _sync()
    results["drafter_train"] = {"steps": steps, "seconds": time.perf_counter() - t0, "sequences": len(cb.buffer)}
    print(f"[speculative] drafter: {results['drafter_train']}", flush=True)
    trained = drafter.inference_copy().to(dtype)
    cold = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(1)).inference_copy()
    dump()

    # --- speculation on: the trained drafter, then an untrained one (the tuner picks k, 0 included)
    spec = SpeculativeConfig(method="eagle", threshold=args.threshold, hysteresis_steps=1,
                             verification=args.verification, deterministic=args.deterministic)
    for name, d in (("eagle", trained), ("cold", cold)):
        on = RolloutEngine(policy, max_batch_size=args.slots, max_seq_len=longest, speculative=spec)
        on.drafter = d
        runs[name] = timed_generate(on, test_ids, sampling, args.samples, seed=7)
        tuner = on.tuner
        results.setdefault("chosen_k", {})[name] = {
            str(b): tuner.best(r) for b, r in zip(range(4), (1, 4, 20, 21))} if tuner is not None else None
        results.setdefault("graphs", {})[name] = on.graph_stats
        results.setdefault("compile_failures", {})[name] = on.compile_failures  # non-empty: timed uncompiled
        print(f"[speculative] {name}: {runs[name][2]:.2f} s, {runs[name][0].stats.get('spec/acceptance_length')}",
              flush=True)
        del on
    table = {}
    for name, (out, binner, wall, warmup) in runs.items():
        tokens = sum(len(c) for c in out.completion_ids)
        lengths = sorted(len(c) for c in out.completion_ids)
        table[name] = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "bins": binner.rates(),
                       "captured_s": binner.captured_s, "warmup": warmup,
                       "spec": {k: v for k, v in out.stats.items() if k.startswith(("spec/", "tuner/"))},
                       "lengths_p50_p99_max": [lengths[len(lengths) // 2], lengths[(len(lengths) * 99) // 100],
                                               lengths[-1]]}
    results["runs"] = table
    costs: dict[str, Any] = {}
    results["step_cost"] = costs

    def summarize() -> None:
        off_tail = tail_rate(table["off"]["bins"])
        results["summary"] = {
            "spec_step_cost_k4_b1": costs.get("b1", {}).get("ratio"),
            "spec_step_cost_k4_b8": costs.get("b8", {}).get("ratio"),
            "verify5_over_decode_b1": costs.get("b1", {}).get("verify_ratio"),
            "verify5_over_decode_b8": costs.get("b8", {}).get("verify_ratio"),
            "tail_speedup_rows_1_8": tail_rate(table["eagle"]["bins"]) / off_tail,
            # the same rows and prompts with the timed pass's capture steps counted in their bins
            "tail_speedup_rows_1_8_with_captures": tail_rate(table["eagle"]["bins"], captures=True)
            / tail_rate(table["off"]["bins"], captures=True),
            # the seconds of steps that held a one-time graph capture (and the compiling inside it), per arm:
            # the warm-up pass's (the first generate of a fresh engine) plus the timed pass's
            "capture_s": {n: t["warmup"]["capture_s"] + t["captured_s"] for n, t in table.items()},
            # the first generate of each engine, its compiling and capturing included: what a short run sees
            "first_call_speedup": table["off"]["warmup"]["wall_s"] / table["eagle"]["warmup"]["wall_s"],
            "accept_len": table["eagle"]["spec"].get("spec/acceptance_length"),
            "cold_drafter_tail_ratio": tail_rate(table["cold"]["bins"]) / off_tail,
            "rollout_speedup": table["off"]["wall_s"] / table["eagle"]["wall_s"],
            # the same, less the steps that held a one-time graph capture (a draft length the warm pass
            # had not met): what a long run, whose graphs are all captured, sees
            "rollout_speedup_without_captures": (table["off"]["wall_s"] - table["off"]["captured_s"])
            / (table["eagle"]["wall_s"] - table["eagle"]["captured_s"]),
        }
        dump()

    summarize()  # the arms' figures are kept even if the step costs below do not finish

    # --- the speculative step's cost, graph replays of the same rows, each batch kept as it lands
    try:
        step_cost(policy, trained, test_ids[0], longest, (1, 8), 4, into=costs, on_batch=summarize,
                  verification=args.verification)
    except Exception as err:  # report, keep the rest
        costs["error"] = repr(err)
    summarize()
    print_table(results)
    print(f"[speculative] wrote {out_path}")
    return results


def print_table(results: dict[str, Any]) -> None:
    runs = results["runs"]
    names = list(runs)
    print(f"\n{'active rows':>11} " + " ".join(f"{n + ' tok/s':>20}" for n in names))
    for b in runs["off"]["bins"]:
        cells = []
        for n in names:
            r = runs[n]["bins"][b]
            ratio = r["tokens_per_s"] / runs["off"]["bins"][b]["tokens_per_s"] if n != "off" and r["tokens"] else None
            cells.append(f"{r['tokens_per_s']:12.0f}" + (f" ({ratio:4.2f}x)" if ratio else "       "))
        print(f"{b:>11} " + " ".join(f"{c:>20}" for c in cells))
    print(f"{'whole call':>11} " + " ".join(
        f"{runs[n]['wall_s']:10.2f} s" + (f" ({runs['off']['wall_s'] / runs[n]['wall_s']:4.2f}x)" if n != "off" else "")
        for n in names))
    for n in names:
        spec = runs[n]["spec"]
        if spec:
            print(f"  {n}: acceptance length {spec.get('spec/acceptance_length', float('nan')):.2f}, "
                  f"speculative share {spec.get('spec/speculative_step_share', float('nan')):.2f}")
    print(f"  drafter: {results['drafter_train']}")
    print(f"  chosen k by bucket (1, 2-4, 5-20, 21+): {results.get('chosen_k')}")
    print(f"  step cost: {results.get('step_cost')}")
    print("summary:", json.dumps(results["summary"], indent=1))


if __name__ == "__main__":
    main()
