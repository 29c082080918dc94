"""One GRPO update on a long-tail batch: micro-batches of a fixed number of rows vs packed by a token budget.

In the 0.5 B end-to-end run on the H200 (`e2e_h200_20261203_d3.json`) the RL update took 2.3-2.7 s
of every step, a third of TLT's, and no speculation makes it faster. A profile of one update
(`train_step_profile_h200_20261203.json`) found the GPU busy for 0.74 s of its 1.34 s: 64 rows cut
into 16 micro-batches of 4 rows, 12 of them under 200 tokens a row, each a whole forward and
backward of 24 layers of kernels too small to hide their launches. `GRPOConfig.micro_batch_tokens`
packs the short rows into few forwards under the same memory bound.

Both arms run the kit's own code (`GRPOModule.micro_batches`, `GRPOModule.compute_loss`, backward,
clipping, AdamW) on the same batch, side by side in one process: the row lengths of a measured
step of that run (speculation off, step 16: 64 rows, p50 88, max 4,096 tokens), random tokens and
advantages, the zoo's ``0.5b`` policy (random weights: the time does not depend on them). Before
timing, the two arms' gradients are compared (they are the same gradient, cut differently).

Prints a table and writes JSON under ``benchmarks/results/`` with ``"summary"`` (per arm:
``update_s``, ``forwards``, ``gpu_s``, ``padded_tokens``, ``peak_gb``) and ``"ratios"``:
``tokens_over_rows_update`` (how many times faster the packed update is) and
``cudnn_attention_speedup`` (the packed update with cuDNN's attention allowed over without: what
keeping off its NaN-prone backward, pytorch/pytorch#196678, costs).

GPU: ``python benchmarks/train_step.py``; CPU smoke check: ``python benchmarks/train_step.py --smoke``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import statistics
import time
from typing import Any

import torch
from _common import add_common_flags, write_results
from lightning.fabric.utilities.apply_func import move_data_to_device

from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.batch import RolloutBatch
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule

STEP_LENGTHS = [
    64, 1129, 62, 64, 129, 4096, 75, 253, 61, 61, 317, 73, 240, 113, 61, 41, 2509, 64, 238, 64, 64, 64, 64, 64, 61,
    399, 463, 73, 61, 61, 88, 61, 398, 133, 624, 634, 88, 521, 133, 61, 77, 146, 260, 284, 64, 64, 64, 3502, 1112,
    2807, 91, 79, 62, 351, 75, 2452, 277, 59, 339, 226, 72, 87, 59, 72,
]  # fmt: skip
"""Completion lengths of one measured RL step (e2e_h200_20261203_d3.json, speculation off, step 16)."""


def long_tail_batch(lengths: list[int], vocab: int, device: str, seed: int = 0) -> RolloutBatch:
    """A rollout batch with the given completion lengths, prompts of 40-63 tokens, random tokens and advantages."""
    g = torch.Generator().manual_seed(seed)
    rows, p, c = len(lengths), 64, max(lengths)
    prompt_mask = (torch.arange(p)[None] >= p - torch.randint(40, 64, (rows,), generator=g)[:, None]).long()
    completion_mask = (torch.arange(c)[None] < torch.tensor(lengths)[:, None]).long()
    high = min(30_000, vocab)
    batch = RolloutBatch(
        prompt_ids=torch.randint(10, high, (rows, p), generator=g) * prompt_mask, prompt_mask=prompt_mask,
        completion_ids=torch.randint(10, high, (rows, c), generator=g) * completion_mask,
        completion_mask=completion_mask, sampling_logprobs=torch.zeros(rows, c), rewards=torch.zeros(rows),
        rewards_per_func=torch.zeros(rows, 1), advantages=torch.randn(rows, generator=g),
        is_truncated=torch.zeros(rows, dtype=torch.bool), num_generations=8,
    )  # fmt: skip
    return move_data_to_device(batch, device)  # as Lightning moves a batch


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Arm:
    """One way of cutting the update: the module (its config says how), the optimizer, the update."""

    def __init__(self, name: str, model: torch.nn.Module, config: GRPOConfig, batch: RolloutBatch) -> None:
        self.name, self.batch = name, batch
        self.module = GRPOModule(model, config)
        self.pairs = self.module.micro_batches(batch)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate)

    @property
    def padded_tokens(self) -> int:
        return sum(int(chunk.input_ids.numel()) for _, chunk in self.pairs)

    def gradients(self) -> None:
        """Forward and backward of every micro-batch, accumulating the whole batch's gradient."""
        whole = len(self.pairs) == 1
        num_items = None if whole else self.module.loss_mask(self.batch).sum()
        for _, chunk in self.pairs:
            loss, _, _ = self.module.compute_loss(
                chunk, None, None, num_sequences=None if whole else len(self.batch), num_items=num_items
            )
            loss.backward()

    def update(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.gradients()
        torch.nn.utils.clip_grad_norm_(self.module.policy.parameters(), 1.0)
        self.optimizer.step()


def timed(arm: Arm, device: str, repeats: int) -> dict[str, Any]:
    """Wall time of ``repeats`` updates after two warm-ups, and the GPU time of one (CUDA events)."""
    for _ in range(2):
        arm.update()
    _sync(device)
    walls = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        arm.update()
        _sync(device)
        walls.append(time.perf_counter() - t0)
    gpu_s = None
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            arm.update()
            _sync(device)
        gpu_s = sum(e.self_device_time_total for e in prof.key_averages()) / 1e6
    return {
        "update_s": statistics.median(walls),
        "update_s_all": walls,
        "forwards": len(arm.pairs),
        "rows_per_forward": [len(rows) for rows, _ in arm.pairs],
        "padded_tokens": arm.padded_tokens,
        "gpu_s": gpu_s,
        "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None,
    }


def gradient_gap(model: torch.nn.Module, arms: list[Arm]) -> float:
    """Largest relative difference between the arms' gradients of the same batch (same weights)."""
    grads = []
    for arm in arms:
        model.zero_grad(set_to_none=True)
        arm.gradients()
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    ref = grads[0]
    return max(float((g - ref).norm() / ref.norm().clamp_min(1e-30)) for g in grads[1:])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="0.5b", help="zoo size")
    p.add_argument("--rows", type=int, default=4, help="the rows arm: GRPOConfig.micro_batch_size")
    p.add_argument("--tokens", type=int, default=16384, help="the tokens arm: GRPOConfig.micro_batch_tokens")
    p.add_argument("--repeats", type=int, default=5)
    add_common_flags(p, smoke="the tiny model on the CPU, lengths cut to 60: a check of the script")
    args = p.parse_args(argv)
    if args.rows < 1 or args.tokens < 1 or args.repeats < 1:
        raise ValueError(f"--rows, --tokens and --repeats must be >= 1, got {args.rows}, {args.tokens}, {args.repeats}")
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    lengths = STEP_LENGTHS
    if args.smoke:
        args.size, args.tokens, args.repeats = "tiny", 1024, 2
        lengths = [min(n, 60) for n in STEP_LENGTHS][:16]
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model("qwen2", args.size, seed=0, dtype=dtype).to(device)
    batch = long_tail_batch(lengths, int(model.config.vocab_size), device)
    settings = dict(num_generations=8, max_completion_length=max(lengths), temperature=1.0, learning_rate=1e-5,
                    lr_scheduler_type="constant", loss_type="dapo", beta=0.0)  # e2e's (grpo_settings)
    arms = [
        Arm("rows", model, GRPOConfig(**settings, micro_batch_size=args.rows), batch),  # type: ignore[arg-type]
        Arm("tokens", model, GRPOConfig(**settings, micro_batch_tokens=args.tokens), batch),  # type: ignore[arg-type]
        # what keeping off cuDNN's attention (pytorch#196678) costs: the same packing with it allowed
        Arm("tokens_cudnn", model, GRPOConfig(**settings, micro_batch_tokens=args.tokens,  # type: ignore[arg-type]
                                               cudnn_attention=True), batch),
    ]
    gap = gradient_gap(model, arms)  # before any update: the same weights
    print(f"[train_step] {len(lengths)} rows, max {max(lengths)} tokens; largest gradient gap from the rows arm {gap:.2e}")
    summary = {}
    for arm in arms:
        summary[arm.name] = timed(arm, device, args.repeats)
        s = summary[arm.name]
        print(f"[train_step] {arm.name:6s}: {s['update_s']:.3f} s an update, {s['forwards']} forwards, "
              f"{s['padded_tokens']:,} padded tokens, GPU {s['gpu_s'] or float('nan'):.3f} s", flush=True)  # fmt: skip
    ratio = summary["rows"]["update_s"] / summary["tokens"]["update_s"]
    cudnn = summary["tokens"]["update_s"] / summary["tokens_cudnn"]["update_s"]
    print("\n| arm | update | forwards | padded tokens | GPU busy |\n|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['update_s']:.3f} s | {s['forwards']} | {s['padded_tokens']:,} | "
              f"{s['gpu_s'] or float('nan'):.3f} s |")  # fmt: skip
    print(f"tokens_over_rows_update: {ratio:.2f}x; cudnn_attention_speedup: {cudnn:.2f}x")
    import lightning
    import transformers

    results = {
        "benchmark": "train_step",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "card": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "lightning": lightning.__version__, "python": platform.python_version()},  # fmt: skip
        "args": vars(args),
        "lengths": {"rows": len(lengths), "max": max(lengths), "tokens": sum(lengths),
                    "p50": sorted(lengths)[len(lengths) // 2]},  # fmt: skip
        "gradient_gap": gap,
        "summary": summary,
        "ratios": {"tokens_over_rows_update": ratio, "cudnn_attention_speedup": cudnn},
    }
    write_results(results, "train_step", smoke=args.smoke, cuda=cuda, out=args.out)
    return results


if __name__ == "__main__":
    main()
