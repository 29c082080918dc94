"""TRL's own GRPOTrainer with the kit's engine as its ``rollout_func`` (speculative rollouts for TRL users).

    python examples/trl_grpo_trainer.py --steps 4

TRL keeps its rewards, advantages, loss and logging; generation goes through `RolloutEngine`
(prefill once per prompt, KV copied to the G samples, speculation in the long tail), and the
engine's figures (``rollout/tokens_per_s``, ``spec/*``) join TRL's logs.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def main() -> None:
    from trl import GRPOConfig, GRPOTrainer

    from lightning_tlt.core.types import SpeculativeConfig
    from lightning_tlt.integrations.trl import rollout_func
    from lightning_tlt.rl.warmstart import WarmStartConfig, warm_start
    from lightning_tlt.rollout.engine import RolloutEngine
    from lightning_tlt.tasks import get_task

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    task = get_task("arithmetic")
    model, tokenizer = warm_start(WarmStartConfig("arithmetic", "qwen2", "tiny", steps=300))
    engine = RolloutEngine(
        model, max_batch_size=32, max_seq_len=160, speculative=SpeculativeConfig(method="suffix", threshold=16)
    )
    config = GRPOConfig(
        output_dir="runs/trl_grpo_trainer", use_cpu=True, bf16=False, per_device_train_batch_size=32,
        num_generations=8, max_completion_length=96, learning_rate=2e-4, max_steps=args.steps,
        logging_steps=1, report_to="none", save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=task.reward_funcs,
        args=config,
        train_dataset=task.make_dataset(256, difficulty=1, seed=0),
        processing_class=tokenizer,
        rollout_func=rollout_func(engine, tokenizer),
    )
    trainer.train()
    for entry in trainer.state.log_history:
        if "reward" in entry:
            print({k: round(v, 4) for k, v in entry.items() if k in ("step", "reward", "rollout/tokens_per_s",
                                                                       "completions/mean_length", "spec/fraction")})


if __name__ == "__main__":
    main()
