"""GRPO under DDP (2 CPU processes, gloo): each rank rolls out its own prompts, the weights stay identical."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = '''
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule


def digits(completions, **kw):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


class Report(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        w = sum(p.double().sum().item() for p in pl_module.policy.parameters())
        print(f"REPORT {trainer.global_rank} {trainer.global_step} {w!r} {sorted(set(batch.prompts))!r}", flush=True)


if __name__ == "__main__":
    module = GRPOModule(build_model("qwen2", "tiny", seed=0),
                        GRPOConfig(num_generations=4, max_completion_length=8, learning_rate=1e-2))
    data = RolloutDataModule("arithmetic", [digits], prompts_per_step=2, task_size=16)
    pl.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               callbacks=[Report()]).fit(module, datamodule=data)
'''


def test_ddp_ranks_take_different_prompts_and_stay_in_sync(tmp_path: Path) -> None:
    script = tmp_path / "ddp_grpo.py"
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = re.findall(r"REPORT (\d) (\d) (\S+) (\[.*?\])", proc.stdout)
    by_step: dict[str, dict[str, tuple[float, set[str]]]] = {}
    for rank, step, weight, prompts in reports:
        by_step.setdefault(step, {})[rank] = (float(weight), set(eval(prompts)))  # noqa: S307 (our own output)
    assert set(by_step) == {"1", "2"}
    for ranks in by_step.values():
        assert set(ranks) == {"0", "1"}
        (w0, p0), (w1, p1) = ranks["0"], ranks["1"]
        assert w0 == w1  # gradients were all-reduced: identical weights on both ranks
        assert not p0 & p1  # disjoint prompts: no duplicated rollouts
    assert by_step["1"]["0"][0] != by_step["2"]["0"][0]
