"""Sequences to warm-start a drafter on, from a zoo task, and ``lightning-tlt train-drafter``.

Two sources (`lightning_tlt.drafters.offline.train_drafter` trains on either):

- ``"rollouts"``: completions the policy samples itself with the kit's engine, the distribution a
  drafter must imitate during RL (`rollout_sequences`);
- ``"sft"``: the task's worked solutions, the data a zoo policy was warm-started on
  (`lightning_tlt.rl.warmstart`), teacher-forced through the policy (`sft_sequences`; no
  generation, so it is cheap).

Command line (writes the ``save_pretrained`` directory vLLM loads, and prints the held-out
acceptance before and after)::

    lightning-tlt train-drafter --task countdown --size 100m --warm-start --steps 400 --out-dir drafter/
"""

from __future__ import annotations

import json
import time
from argparse import Namespace
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_tlt.core.cli_options import OptionParser
from lightning_tlt.core.types import RolloutBackend, SamplingConfig
from lightning_tlt.drafters.offline import train_drafter
from lightning_tlt.drafters.trainer import DrafterTrainConfig
from lightning_tlt.models.tokenizer import build_tokenizer, encode_prompt
from lightning_tlt.rl.sft import IGNORE_INDEX, SFTCollator
from lightning_tlt.tasks import get_task


def sft_sequences(
    task: str, n: int, *, tokenizer: Any = None, difficulty: int = 1, seed: int = 0, max_length: int = 4096
) -> tuple[list[list[int]], list[int]]:
    """``n`` worked solutions of ``task`` (train split) tokenized as SFT sees them: ``(sequences, prompt_lengths)``."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    collator = SFTCollator(tokenizer if tokenizer is not None else build_tokenizer(), max_length)
    sequences, prompt_lengths = [], []
    for problem in get_task(task).problems(n, difficulty=difficulty, seed=seed):
        ids, labels = collator.encode({"prompt": problem.prompt, "completion": problem.solution})
        sequences.append(ids)
        prompt_lengths.append(labels.count(IGNORE_INDEX))
    return sequences, prompt_lengths


def rollout_sequences(
    engine: RolloutBackend,
    prompts: Sequence[Sequence[int]],
    sampling: SamplingConfig,
    *,
    num_samples: int = 8,
    generator: torch.Generator | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Completions the policy samples for ``prompts`` (``num_samples`` each): ``(sequences, prompt_lengths)``."""
    out = engine.generate(prompts, sampling, num_samples=num_samples, generator=generator)
    sequences = [list(p) + list(c) for p, c in zip(out.prompt_ids, out.completion_ids)]
    return sequences, [len(p) for p in out.prompt_ids]


def task_prompts(task: str, n: int, *, tokenizer: Any = None, difficulty: int = 1, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``task`` (train split) as token ids."""
    tokenizer = tokenizer if tokenizer is not None else build_tokenizer()
    return [encode_prompt(tokenizer, p.prompt) for p in get_task(task).problems(n, difficulty=difficulty, seed=seed)]


def _policy(args: Namespace) -> nn.Module:
    if args.policy_path:
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(args.policy_path)
    if args.warm_start:
        from lightning_tlt.rl.warmstart import WarmStartConfig, warm_start

        return warm_start(WarmStartConfig(args.task, args.arch, args.size, difficulty=args.difficulty, seed=args.seed,
                                          steps=args.sft_steps, device=args.device, progress=False))[0]  # fmt: skip
    from lightning_tlt.models.zoo import build_model

    return build_model(args.arch, args.size, seed=args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-tlt train-drafter``: train an EAGLE drafter for a policy on a task, save it for vLLM."""
    p = OptionParser("lightning-tlt train-drafter", "Train an EAGLE drafter for a policy on a task's rollouts (or its "
                     "worked solutions) and save it as a vLLM EAGLE draft directory.")
    p.add_option("out_dir", required=True, help="where EagleDrafter.save_pretrained writes the drafter")
    p.add_option("task", default="arithmetic", help="zoo task whose prompts (or worked solutions) to use")
    p.add_option("difficulty", type=int, default=1)
    p.add_option("source", choices=["rollouts", "sft"], default="rollouts")
    p.add_option("policy_path", default=None, help="an HF model directory (else a zoo policy)")
    p.add_option("arch", default="qwen2")
    p.add_option("size", default="tiny")
    p.add_option("warm_start", action="store_true", help="SFT-warm-start the zoo policy first (cached)")
    p.add_option("sft_steps", type=int, default=1000)
    p.add_option("prompts", type=int, default=64, help="prompts (rollouts) or worked solutions (sft)")
    p.add_option("generations", type=int, default=8, help="rollouts per prompt")
    p.add_option("max_new_tokens", type=int, default=512)
    p.add_option("temperature", type=float, default=1.0)
    p.add_option("steps", type=int, default=400, help="drafter updates")
    p.add_option("batch_size", type=int, default=8)
    p.add_option("max_len", type=int, default=512)
    p.add_option("learning_rate", type=float, default=3e-4)
    p.add_option("device", default=None, help="default: cuda when a GPU is found, else cpu")
    p.add_option("dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA")
    p.add_option("seed", type=int, default=0)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:  # what would otherwise fail after the policy is built, as one line
        get_task(args.task).check_difficulty(args.difficulty)
    except ValueError as err:
        p.error(f"--task/--difficulty: {err}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device: no GPU found (torch.cuda.is_available() is False), but --device {args.device} asks "
                "for one; give --device cpu")
    start = time.perf_counter()
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    policy = _policy(args).to(device=args.device, dtype=dtype).eval()
    if args.source == "sft":
        sequences, prompt_lengths = sft_sequences(args.task, args.prompts, difficulty=args.difficulty, seed=args.seed)
    else:
        from lightning_tlt.rollout.engine import RolloutEngine

        prompts = task_prompts(args.task, args.prompts, difficulty=args.difficulty, seed=args.seed)
        engine = RolloutEngine(policy, max_seq_len=max(map(len, prompts)) + args.max_new_tokens,
                               max_batch_size=args.prompts * args.generations)  # fmt: skip
        sampling = SamplingConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
        generator = torch.Generator(device=args.device).manual_seed(args.seed)
        sequences, prompt_lengths = rollout_sequences(engine, prompts, sampling, num_samples=args.generations,
                                                      generator=generator)  # fmt: skip
    config = DrafterTrainConfig(batch_size=args.batch_size, max_len=args.max_len, learning_rate=args.learning_rate)
    result = train_drafter(policy, sequences, prompt_lengths, steps=args.steps, config=config, seed=args.seed)
    result.drafter.inference_copy().save_pretrained(args.out_dir)  # in the policy's dtype, as the engine drafts
    summary = {
        "out_dir": args.out_dir, "sequences": result.sequences, "steps": result.steps,
        "heldout_accept_rate_before": result.heldout_before, "heldout_accept_rate_after": result.heldout_after,
        "seconds": round(time.perf_counter() - start, 2),
    }  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
