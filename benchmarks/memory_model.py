"""Per-rank memory of GRPO with TLT under FSDP, on paper: what each part needs, for Qwen2.5 shapes.

A model, not a measurement (issue 37, part 5): parameter counts from the architecture, bytes from
the precisions the kit trains and rolls out in, and a rank's share of each part under full sharding
(FSDP2 ``fully_shard`` of the policy over ``--ranks`` GPUs). The parts:

- ``train_state``: float32 master weights, float32 gradients and AdamW's two float32 moments, all
  sharded: 16 bytes a parameter over the ranks.
- ``inference_copy``: the bf16 copy the native engine decodes from, whole on every rank (the engine
  reads unsharded weights; the gather writes it layer by layer, never a second float32 copy).
- ``gather_buffer``: the one parameter gathered whole in float32 while the copy is written
  (`lightning_tlt.rollout.inference_copy.gathered_parameters`: one at a time, so the largest, the
  embedding, sets it; logged per step as ``rollout/gather_buffer_mib``, on CUDA with the measured
  ``rollout/gather_peak_mib``).
- ``fsdp_buffers``: what FSDP2 holds whole during the training forward and backward
  (`lightning_tlt.rl.fsdp`: each decoder layer one unit, the rest the root unit): the root unit
  (embedding, final norm, head unless tied) in float32 from the forward's start to the backward's
  end, and about three layers in float32 (the one computing, the one prefetched, and one layer's
  gradient before its reduce-scatter).
- ``kv_cache``: bf16 K and V of every layer for the rank's rollout rows at their longest.
- ``activations``: the training forward under activation checkpointing (``GRPOConfig.gradient_checkpointing``,
  on in ``configs/grpo_gpu_0.5b_fsdp.yaml``), at ``--micro-batch-tokens``: one bf16 hidden state per layer
  per token kept, one layer's full working set recomputed, and the float32 logits of the loss's chunk
  (``--logit-chunk-tokens``); with ``--no-gradient-checkpointing``, every layer's working set.
- ``drafter``: the EAGLE layer (an ``fc`` of 2H -> H, one decoder layer) replicated: float32
  weights, gradients, AdamW moments and a bf16 published copy; it shares the policy's embedding
  and head through the inference copy; and its replay buffer of ``--buffer-tokens`` bf16 features
  (each rank its own).

It prints a table and writes JSON (``benchmarks/results/memory_model.json``). The 0.5 B row is the
zoo's ``0.5b`` policy: its parameter count is checked against the built model by the tests, and
its total can be checked against a one-GPU run's measured peak.

    python benchmarks/memory_model.py [--ranks 8] [--gpu-gib 139.8] [--rollout-tp 1]
"""

from __future__ import annotations

import argparse
import datetime as dt
from dataclasses import asdict, dataclass
from typing import Any

from _common import ROOT, add_common_flags, write_results

GIB = 1024**3


@dataclass(frozen=True)
class Shape:
    """A Qwen2-architecture decoder's shape (the fields of its HF config)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def layer_params(self) -> int:
        """One decoder layer: q, k, v (with biases), o, gate, up, down, two norms."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attention = (h * h + h) + 2 * (h * kv + kv) + h * h
        return attention + 3 * h * self.intermediate + 2 * h

    def params(self) -> int:
        """Every parameter: embedding, layers, final norm, and the head unless tied."""
        embed = self.vocab * self.hidden
        return embed * (1 if self.tied else 2) + self.layers * self.layer_params() + self.hidden

    def largest_param(self) -> int:
        """The largest single parameter: the embedding (or the untied head), else an MLP matrix."""
        return max(self.vocab * self.hidden, self.hidden * self.intermediate)

    def root_params(self) -> int:
        """What stays outside the decoder layers (FSDP2's root unit): embedding, final norm, untied head."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


SHAPES: dict[str, Shape] = {
    # Qwen2.5 configs (hidden, layers, heads, KV heads, MLP, vocabulary, tied)
    "0.5b": Shape(896, 24, 14, 2, 4864, 151_936, True),
    "1.5b": Shape(1536, 28, 12, 2, 8960, 151_936, True),
    "7b": Shape(3584, 28, 28, 4, 18944, 152_064, False),
    "32b": Shape(5120, 64, 40, 8, 27648, 152_064, False),
}


def per_rank_bytes(shape: Shape, *, ranks: int, rows: int, max_tokens: int, micro_batch_tokens: int,
                   logit_chunk_tokens: int, rollout_tp: int = 1, buffer_tokens: int = 65536,
                   gradient_checkpointing: bool = True) -> dict[str, float]:
    """Bytes each part of one RL step needs on one rank (see the module's docstring); ``rollout_tp``:
    rollouts tensor-parallel over that many ranks (vLLM's ``tensor_parallel_size``), which splits the
    inference copy and the KV cache of their rows; ``buffer_tokens``: the drafter's replay buffer."""
    counts = dict(ranks=ranks, rows=rows, max_tokens=max_tokens, micro_batch_tokens=micro_batch_tokens,
                  logit_chunk_tokens=logit_chunk_tokens, rollout_tp=rollout_tp, buffer_tokens=buffer_tokens)
    if any(v < 1 for v in counts.values()):
        raise ValueError("every count must be >= 1: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    if ranks % rollout_tp:
        raise ValueError(f"rollout_tp={rollout_tp} must divide ranks={ranks}")
    p, h = shape.params(), shape.hidden
    layer_working = micro_batch_tokens * (10 * h + 3 * shape.intermediate) * 2  # one layer recomputed, bf16
    drafter = 2 * h * h + shape.layer_params()
    return {
        "train_state": 16 * p / ranks,
        "inference_copy": 2 * p / rollout_tp,
        "gather_buffer": 4 * shape.largest_param(),
        "fsdp_buffers": (4 * (shape.root_params() + 3 * shape.layer_params()) if ranks > 1 else 0),
        "kv_cache": rows * max_tokens * shape.kv_bytes_per_token() / rollout_tp,
        "activations": (micro_batch_tokens * shape.layers * h * 2 + layer_working if gradient_checkpointing
                        else shape.layers * layer_working) + logit_chunk_tokens * shape.vocab * 4,
        "drafter": 18 * drafter + buffer_tokens * h * 2,
    }


def model(args: argparse.Namespace) -> dict[str, Any]:
    rows_per_rank = -(-args.rows // args.ranks)
    table: dict[str, Any] = {}
    for name, shape in SHAPES.items():
        parts = per_rank_bytes(shape, ranks=args.ranks, rows=rows_per_rank, max_tokens=args.max_tokens,
                               micro_batch_tokens=args.micro_batch_tokens, logit_chunk_tokens=args.logit_chunk_tokens,
                               rollout_tp=args.rollout_tp, buffer_tokens=args.buffer_tokens,
                               gradient_checkpointing=args.gradient_checkpointing)
        total = sum(parts.values())
        table[name] = {
            "params": shape.params(),
            "parts_gib": {k: v / GIB for k, v in parts.items()},
            "total_gib": total / GIB,
            "fits": total / GIB <= args.gpu_gib,
            "inference_copy_share": parts["inference_copy"] / total,
        }
    return {
        "benchmark": "memory_model",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "kind": "model on paper (not measured)",
        "settings": vars(args) | {"rows_per_rank": rows_per_rank},
        "shapes": {k: asdict(v) for k, v in SHAPES.items()},
        "per_rank": table,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="GPUs the policy is sharded over")
    p.add_argument("--gpu-gib", type=float, default=139.8, help="memory of one GPU (an H200: 139.8 GiB usable)")
    p.add_argument("--rows", type=int, default=512, help="rollout rows of one RL step, over all ranks")
    p.add_argument("--max-tokens", type=int, default=4224, help="prompt + completion, at the longest")
    p.add_argument("--micro-batch-tokens", type=int, default=16384)
    p.add_argument("--logit-chunk-tokens", type=int, default=4096)
    p.add_argument("--rollout-tp", type=int, default=1, help="rollouts tensor-parallel over this many ranks (vLLM)")
    p.add_argument("--buffer-tokens", type=int, default=65536, help="the drafter's replay buffer (DrafterCoTrainConfig)")
    p.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                   help="the training forward keeps every layer's working set (GRPOConfig.gradient_checkpointing off)")
    add_common_flags(p, out_default=str(ROOT / "benchmarks" / "results" / "memory_model.json"), smoke=False)
    args = p.parse_args(argv)
    out = args.out
    del args.out
    results = model(args)
    parts = list(next(iter(results["per_rank"].values()))["parts_gib"])
    print(f"per rank, {args.ranks} ranks, {results['settings']['rows_per_rank']} rows of {args.max_tokens} tokens "
          f"each, rollouts tensor-parallel over {args.rollout_tp}, GiB (a model, not measured)")
    print(f"{'policy':>7} {'params':>8} " + " ".join(f"{k:>14}" for k in parts) + f" {'total':>8}  fits")
    for name, row in results["per_rank"].items():
        print(f"{name:>7} {row['params'] / 1e9:7.2f}B " + " ".join(f"{row['parts_gib'][k]:14.2f}" for k in parts)
              + f" {row['total_gib']:8.1f}  {'yes' if row['fits'] else 'NO'}")
    write_results(results, "memory_model", smoke=False, cuda=False, out=out)
    return results


if __name__ == "__main__":
    main()
