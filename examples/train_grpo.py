"""GRPO in plain Python: a Lightning Trainer, the kit's modules and callbacks, a TRL-format dataset.

    python examples/train_grpo.py --steps 20

Warm-starts a tiny zoo policy on the arithmetic task (SFT, cached on disk), then runs GRPO with
speculative rollouts (model-free suffix drafter in the long tail), printing one line per RL step.
Any TRL reward function works: here the task's own (correctness, format) plus a custom one.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from lightning_tlt.callbacks.rollout_metrics import RolloutMetricsCallback
from lightning_tlt.callbacks.rollout_progress import RolloutProgressCallback
from lightning_tlt.core.types import SpeculativeConfig
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.rl.warmstart import WarmStartConfig, warm_start
from lightning_tlt.tasks import get_task


def brevity(completions: list[str], **kwargs: object) -> list[float]:
    """A TRL-signature reward: a small bonus for answers under 80 characters."""
    return [0.1 if len(c) < 80 else 0.0 for c in completions]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--warm-start-steps", type=int, default=300)
    args = parser.parse_args()

    task = get_task("arithmetic")
    policy, tokenizer = warm_start(WarmStartConfig("arithmetic", "qwen2", args.size, steps=args.warm_start_steps))
    module = GRPOModule(
        policy,
        GRPOConfig(num_generations=8, max_completion_length=96, learning_rate=2e-4, lr_scheduler_type="constant",
                   epsilon_high=0.28),
    )
    data = RolloutDataModule(
        task.make_dataset(512, difficulty=1, seed=0),  # a TRL prompt-only dataset: prompt, answer, ...
        [*task.reward_funcs, brevity],
        tokenizer=tokenizer,
        prompts_per_step=8,
        reward_weights=[1.0, 0.5, 1.0],
        speculative=SpeculativeConfig(method="suffix", threshold=16, num_draft_tokens=4),
        seed=0,
    )
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="auto",
        devices=1,
        log_every_n_steps=1,
        logger=CSVLogger("runs", name="train_grpo"),
        callbacks=[RolloutMetricsCallback(), RolloutProgressCallback()],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
