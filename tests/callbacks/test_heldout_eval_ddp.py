"""EvalCallback under a real Lightning DDP strategy (two CPU processes over gloo): each rank evaluates every
second held-out prompt, and the gathered figures are those of one process evaluating them all.

The test runs this file as a script (Lightning's DDP launcher re-runs it for rank 1); each rank writes
its history to JSON. Five prompts: rank 1's shard is one shorter, padded for the gather and cut after.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the files also run as scripts, where conftest is not on the path
    from conftest import TwoRanks

PROMPTS = 5


@pytest.mark.slow
def test_two_ranks_gather_the_figures_of_one_process(tmp_path: Path, two_ranks: TwoRanks) -> None:
    r0, r1 = two_ranks(__file__, tmp_path)
    assert r0["world_size"] == r1["world_size"] == 2
    def figures(history: list[dict[str, float]]) -> list[dict[str, float]]:  # less each rank's own seconds
        return [{k: v for k, v in h.items() if k != "eval/seconds"} for h in history]

    assert figures(r0["history"]) == figures(r1["history"])  # every rank holds the same figures
    one = run(devices=1)["history"][0]  # the control (step 0), one process
    two = r0["history"][0]
    assert two["eval/num_prompts"] == PROMPTS
    for key, value in one.items():
        if key != "eval/seconds":
            assert two[key] == value, key


def run(devices: int) -> dict[str, object]:
    import lightning.pytorch as pl
    import torch

    from lightning_tlt.callbacks.heldout_eval import EvalCallback
    from lightning_tlt.data.datamodule import RolloutDataModule
    from lightning_tlt.models.zoo import build_model
    from lightning_tlt.rl.config import GRPOConfig
    from lightning_tlt.rl.grpo import GRPOModule

    torch.set_num_threads(1)

    def has_digit(completions: list[str], **kwargs: object) -> list[float]:
        return [float(any(ch.isdigit() for ch in c)) for c in completions]

    module = GRPOModule(build_model("qwen2", "tiny", seed=0), GRPOConfig(num_generations=2, max_completion_length=8))
    data = RolloutDataModule("arithmetic", [has_digit], prompts_per_step=2, task_size=16, seed=0)
    evaluation = EvalCallback(num_prompts=PROMPTS, every_n_steps=10, num_samples=3)
    trainer = pl.Trainer(
        strategy="ddp" if devices > 1 else "auto", accelerator="cpu", devices=devices, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, callbacks=[evaluation],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    return {"world_size": trainer.world_size, "rank": trainer.global_rank, "history": evaluation.history}


if __name__ == "__main__":
    result = run(devices=2)
    Path(sys.argv[1], f"rank{result['rank']}.json").write_text(json.dumps(result))
