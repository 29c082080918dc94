"""The drafter's train step at 0.5 B: its GPU time by precision and head rows, and what it costs decode beside it.

In the 0.5 B end-to-end run on the H200 (`e2e_h200_20261203_d3_fp32.json`) a co-trained drafter step
took about 100 ms of GPU time, and TLT's speculative steps in the tail took about 4.9 ms against
1.6 ms for a plain step (least squares over the run's steps), so speculation at an acceptance
length of 3.7 barely shortened the tail. With float32 master weights the drafter's step computed
in float32 (it took the policy's dtype), and its loss forms two logits of the whole 151,936-row head
for every token. This script measures, side by side on one GPU and the zoo's ``0.5b`` policy
(random weights: the times do not depend on them, float32 master weights as the e2e trains them):

- the drafter step (`DrafterTrainer`, captured and replayed on its side stream, GPU time from CUDA
  events) in three arms: ``fp32_full`` (what the e2e ran), ``bf16_full`` (``compute_dtype``
  bf16, as `DrafterCoTrainCallback` now passes under ``bf16-mixed``) and ``bf16_vocab`` (bf16, the
  loss over the engine's draft vocabulary of 32,768 rows: `DrafterTrainer.set_vocabulary`);
- one replay of the engine's captured EAGLE step (k = 4) and of its plain decode step at one active
  row, alone and while drafter steps of each arm run on the side stream (the tail's situation).

- with ``--side-sms 16,32``, the ``bf16_vocab`` step again on a side stream of a CUDA green context of
  that many SMs (``DrafterTrainConfig.side_stream_sms``; arms ``bf16_vocab_sms16``, ...): the step
  takes longer on fewer SMs, and the question is how much of decode's time it then leaves alone.

Prints a table and writes JSON under ``benchmarks/results/`` with ``"summary"`` (per arm:
``step_ms``, ``spec_step_ms_beside``, ``decode_step_ms_beside``; and ``spec_step_ms_alone``,
``decode_step_ms_alone``) and ``"ratios"``: ``bf16_over_fp32_step`` and ``vocab_over_full_step`` (how
many times faster the step gets), ``spec_slowdown_<arm>`` (the EAGLE step's time beside the arm's
drafter steps over alone).

GPU: ``python benchmarks/drafter_step.py``; CPU smoke check: ``python benchmarks/drafter_step.py --smoke``
(tiny model, eager steps, no side stream: the contention figures are null).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import platform
import statistics
from typing import Any

import torch
from _common import add_common_flags, graph_replay_ms, write_results

from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.drafters.buffer import FeatureReplayBuffer
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.offline import add_policy_features
from lightning_tlt.drafters.trainer import DrafterTrainConfig, DrafterTrainer
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine

ARMS = {"fp32_full": (torch.float32, False), "bf16_full": (torch.bfloat16, False), "bf16_vocab": (torch.bfloat16, True)}


def replay_beside(
    engine: RolloutEngine, phase: str, width: int, trainer: DrafterTrainer, rounds: int = 3, priority: bool = False
) -> float | None:
    """GPU time of one replay of ``engine``'s ``phase`` graph at one row while ``trainer``'s steps run
    on its side stream (median of ``rounds``; each queues the trainer's full queue, then times 20 replays:
    the queue must outlast them, ``--queue``, or replays alone dilute the figure; each arm's row says
    whether it did, ``covered``); ``priority``: the replays go to a stream of the highest priority (CUDA
    maps -100 to it)."""
    if graph_replay_ms(engine, 1, phase, width) is None:
        return None
    stream = torch.cuda.Stream(priority=-100) if priority else None
    times = []
    for _ in range(rounds):
        trainer.enqueue(trainer.config.max_queued, block=True)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            times.append(graph_replay_ms(engine, 1, phase, width, replays=20, warmup=0))
        trainer.wait()
        torch.cuda.synchronize()
    return statistics.median(t for t in times if t is not None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="0.5b")
    p.add_argument("--vocab-rows", type=int, default=32768, help="rows of the bf16_vocab arm's head (the engine's default)")
    p.add_argument("--steps", type=int, default=20, help="timed drafter steps per arm")
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of {', '.join(ARMS)}")
    p.add_argument("--side-sms", default="", help="comma-separated SM counts: bf16_vocab on a green context of each")
    p.add_argument("--queue", type=int, default=32,
                   help="drafter steps queued before the timed replays: their work must outlast the replays")
    add_common_flags(p, smoke="tiny model on the CPU: a check of the script")
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - set(ARMS):
        raise SystemExit(f"--arms takes some of {', '.join(ARMS)}, got {args.arms!r}")
    try:
        side_sms = [int(n) for n in args.side_sms.split(",") if n.strip()]
    except ValueError:
        raise SystemExit(f"--side-sms takes comma-separated SM counts, got {args.side_sms!r}") from None
    if any(n < 1 for n in side_sms):
        raise SystemExit(f"--side-sms counts must be >= 1, got {args.side_sms!r}")
    if args.smoke:
        args.size, args.vocab_rows, args.steps, side_sms = "tiny", 64, 2, []
    if args.queue < 1:
        raise SystemExit(f"--queue must be >= 1, got {args.queue}")
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    total_sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else None
    if total_sms is not None and side_sms and max(side_sms) > total_sms:  # before any arm (the trainer checks too)
        raise SystemExit(f"--side-sms counts must be at most the device's {total_sms} SMs, got {args.side_sms!r}")
    policy = build_model("qwen2", args.size, seed=0).to(device)  # float32 master weights, as the e2e trains
    vocab = int(policy.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, min(vocab, 30_000), (int(n),), generator=gen).tolist()
            for n in torch.randint(300, 1200, (32,), generator=gen)]  # fmt: skip
    buffer = FeatureReplayBuffer(1 << 16, heldout_fraction=0.0, seed=0, device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        add_policy_features(buffer, policy, seqs, [40] * len(seqs), batch_size=8)
    # the co-training callback's batch shape (8 rows of 512 tokens); a deep queue, so that drafter work
    # outlasts the timed decode replays beside it at every SM count
    config = DrafterTrainConfig(max_queued=args.queue)
    summary: dict[str, Any] = {}
    engines: dict[str, RolloutEngine] = {}
    if cuda:
        # one active row, k = 4 fixed; eager code captured as graphs (what speculation costs relative
        # to a plain step, and what drafter work beside it adds; the e2e's compiled steps are faster)
        prompt = seqs[0][:40]
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=64, stop_token_ids=[])
        for name, spec in (("decode", None), ("spec", SpeculativeConfig(method="eagle", num_draft_tokens=4,
                                                                        threshold=8, hysteresis_steps=1))):
            engine = RolloutEngine(policy, max_batch_size=1, max_seq_len=256, dtype=torch.bfloat16, compile=False,
                                   speculative=spec)  # fmt: skip
            if spec is not None:
                engine.set_drafter(EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(1)))
            engine.generate([prompt], sampling, generator=torch.Generator(device=device).manual_seed(0))
            engines[name] = engine
        summary["spec_step_ms_alone"] = graph_replay_ms(engines["spec"], 1, "spec", 5)
        summary["decode_step_ms_alone"] = graph_replay_ms(engines["decode"], 1, "decode", 1)
    runs = [(arm, *ARMS[arm], None) for arm in arms] + [(f"bf16_vocab_sms{n}", *ARMS["bf16_vocab"], n) for n in side_sms]
    for arm, dtype, restricted, sms in runs:
        drafter = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0))
        arm_config = dataclasses.replace(config, side_stream_sms=sms)
        trainer = DrafterTrainer(drafter, buffer, arm_config, compute_dtype=dtype)
        if restricted:
            trainer.set_vocabulary(torch.arange(min(args.vocab_rows, vocab)))
        trainer.enqueue(3, block=True)  # capture and warm up
        trainer.wait()
        if cuda:
            torch.cuda.synchronize()
        trainer.take_stats()
        trainer.enqueue(args.steps, block=True)
        trainer.wait()
        if cuda:
            torch.cuda.synchronize()
        stats = trainer.take_stats()
        row: dict[str, Any] = {"step_ms": 1000 * stats["train_time_s"] / args.steps, "compute_dtype": str(dtype),
                               "head_rows": min(args.vocab_rows, vocab) if restricted else vocab,
                               "loss": stats.get("loss"), "execution": trainer.execution,
                               "side_stream_sms": sms}  # fmt: skip
        if cuda:
            row["spec_step_ms_beside"] = replay_beside(engines["spec"], "spec", 5, trainer)
            row["decode_step_ms_beside"] = replay_beside(engines["decode"], "decode", 1, trainer)
            row["spec_step_ms_beside_priority"] = replay_beside(engines["spec"], "spec", 5, trainer, priority=True)
            row["decode_step_ms_beside_priority"] = replay_beside(engines["decode"], "decode", 1, trainer, priority=True)
            widest = max([v for k, v in row.items() if "_beside" in k and v is not None], default=0.0)
            row["covered"] = args.queue * row["step_ms"] >= 20 * widest  # the queue outlasted the 20 replays
        summary[arm] = row
        print(f"[drafter_step] {arm}: {row}", flush=True)
        del trainer, drafter

    def over(x: Any, y: Any) -> float | None:
        return x / y if x and y else None

    def step_ms(arm: str) -> float | None:
        return summary[arm]["step_ms"] if arm in summary else None

    names = [r[0] for r in runs]
    ratios = {
        "bf16_over_fp32_step": over(step_ms("fp32_full"), step_ms("bf16_full")),
        "vocab_over_full_step": over(step_ms("bf16_full"), step_ms("bf16_vocab")),
        **{f"spec_slowdown_{arm}": over(summary[arm].get("spec_step_ms_beside"), summary.get("spec_step_ms_alone"))
           for arm in names},
    }  # fmt: skip
    results = {
        "benchmark": "drafter_step",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "card": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "args": vars(args),
        "summary": summary,
        "ratios": ratios,
    }
    print("\n| arm | step (ms) | EAGLE step beside (ms) | plain step beside (ms) |\n|---|---|---|---|")
    for arm in names:
        row = summary[arm]
        print(f"| {arm} | {row['step_ms']:.1f} | {row.get('spec_step_ms_beside')} | {row.get('decode_step_ms_beside')} |")
    print(f"alone: EAGLE step {summary.get('spec_step_ms_alone')} ms, plain step {summary.get('decode_step_ms_alone')} ms")
    print("; ".join(f"{k}: {v:.2f}x" if v else f"{k}: n/a" for k, v in ratios.items()))
    write_results(results, "drafter_step", smoke=args.smoke, cuda=cuda, out=args.out)
    return results


if __name__ == "__main__":
    main()
