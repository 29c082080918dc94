"""DrafterCoTrainCallback under a real Lightning DDP strategy: two CPU processes over gloo.

The test runs this file as a script (Lightning's DDP launcher re-runs the script for rank 1); each
rank writes what it saw to JSON. Rank 1 is made to finish generating later (a listener sleeps on
its "done" event), so rank 0 must train while waiting for it; at every step boundary the drafter
weights are averaged, so both ranks end with identical drafters although they trained on
different rollouts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the files also run as scripts, where conftest is not on the path
    from conftest import TwoRanks

RANK1_DELAY_S = 1.5


@pytest.mark.slow
def test_two_process_ddp_averages_and_trains_while_waiting(tmp_path: Path, two_ranks: TwoRanks) -> None:
    r0, r1 = two_ranks(__file__, tmp_path)
    assert (r0["world_size"], r1["world_size"]) == (2, 2)
    # each rank harvested its own, different rollouts
    assert r0["buffer_token_sum"] != r1["buffer_token_sum"]
    assert r0["buffer_added"] > 0 and r1["buffer_added"] > 0
    # both trained in their own stalls; rank 0 also while rank 1 was still generating
    assert r0["stall_steps"] > 0 and r1["stall_steps"] > 0
    assert r0["wait_steps"] > 0
    # averaged at the step boundary: identical drafters and publications on both ranks
    assert r0["drafter"] == r1["drafter"]
    assert r0["version"] == r1["version"] == 2  # cold version 0; nothing trained in step 1; then 1 and 2
    assert r0["published"] == r1["published"] == r0["drafter"]


def main(out_dir: str) -> None:
    import lightning.pytorch as pl
    import torch

    from lightning_tlt.callbacks.drafter_cotrain import DrafterCoTrainCallback, DrafterCoTrainConfig
    from lightning_tlt.data.datamodule import RolloutDataModule
    from lightning_tlt.models.zoo import build_model
    from lightning_tlt.rl.config import GRPOConfig
    from lightning_tlt.rl.grpo import GRPOModule

    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(1)

    def digits(completions: list[str], **kwargs: object) -> list[float]:
        return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

    config = GRPOConfig(
        num_generations=4, max_completion_length=10, learning_rate=1e-3, lr_scheduler_type="constant"
    )
    module = GRPOModule(build_model("qwen2", "tiny", seed=0), config)
    # each rank its own prompts (different seeds): different rollouts, different drafter gradients
    data = RolloutDataModule("arithmetic", [digits], prompts_per_step=2, task_size=32, seed=10 + rank)
    if rank == 1:  # registered before the callback's listener: rank 1 reaches the wait late
        data.add_listener(lambda event: time.sleep(RANK1_DELAY_S) if event.phase == "done" else None)
    cb = DrafterCoTrainCallback(
        DrafterCoTrainConfig(
            stall_threshold=8, max_steps_per_event=1, max_decode_slowdown=None, batch_size=4, max_len=24,
            learning_rate=1e-3, heldout_fraction=0.25, wait_max_steps=50, wait_budget_s=30.0, buffer_tokens=2048,
            seed=0,
        )
    )  # fmt: skip
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[cb],
    )  # fmt: skip
    trainer.fit(module, datamodule=data)
    assert cb.drafter is not None and cb.published is not None

    def checksum(module: torch.nn.Module) -> list[float]:
        return [round(float(v.double().sum()), 6) for v in module.state_dict().values()]

    assert cb.buffer.tokens is not None
    tokens = sum(int(cb.buffer.tokens[s.offset : s.offset + s.length].sum()) for s in cb.buffer.sequences)
    result = {
        "world_size": trainer.world_size,
        "drafter": checksum(cb.drafter),
        "published": checksum(cb.published),
        "version": cb.version,
        "stall_steps": sum(n for reason, _, n in cb.step_log if reason == "stall"),
        "wait_steps": sum(n for reason, _, n in cb.step_log if reason == "wait"),
        "buffer_added": cb.buffer.summary()["added"],
        "buffer_token_sum": tokens,
    }
    Path(out_dir, f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
