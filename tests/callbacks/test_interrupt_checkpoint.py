"""`InterruptCheckpoint`: a real signal mid-run writes last.ckpt and exits 130/143; resuming equals the unbroken run."""

from __future__ import annotations

import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger

from lightning_tlt.callbacks.interrupt_checkpoint import InterruptCheckpoint
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.data.rewards import RewardFunctionError
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule

ROOT = Path(__file__).parent.parent.parent
ITERATIONS = 2  # optimizer steps per RL step


def digits(completions: list[str], **kwargs: object) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def make(reward: object = digits) -> tuple[GRPOModule, RolloutDataModule]:
    module = GRPOModule(build_model("qwen2", "tiny", seed=2), GRPOConfig(
        num_generations=4, max_completion_length=10, learning_rate=3e-3, num_iterations=ITERATIONS))
    return module, RolloutDataModule("arithmetic", [reward], prompts_per_step=2, task_size=32, seed=2)


def trainer(root: Path, max_steps: int, *callbacks: Callback) -> pl.Trainer:
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root,
                      callbacks=[InterruptCheckpoint(), *callbacks])


class SignalAt(Callback):
    """Send this process ``signum`` when RL step ``batch`` starts (a real signal, handled between bytecodes)."""

    def __init__(self, signum: int, batch: int) -> None:
        self.signum, self.batch = signum, batch

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if args[-1] == self.batch:
            os.kill(os.getpid(), self.signum)


def weights(module: pl.LightningModule) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_saves_last_and_the_resumed_run_equals_the_unbroken_one(
    tmp_path: Path, signum: int
) -> None:
    steps = 4 * ITERATIONS
    module, data = make()
    trainer(tmp_path / "straight", steps).fit(module, data)
    straight = weights(module)

    module, data = make()
    handler = signal.getsignal(signum)
    with pytest.raises(SystemExit) as stop:
        trainer(tmp_path / "run", steps, SignalAt(signum, batch=1)).fit(module, data)
    assert stop.value.code == 128 + signum  # 143 for SIGTERM, 130 for SIGINT
    assert signal.getsignal(signum) is handler  # the previous handler is back
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 2 * ITERATIONS  # the RL step in flight (batch 1) finished, no further
    assert not torch.equal(saved["state_dict"]["policy.lm_head.weight"], straight["policy.lm_head.weight"])

    module, data = make()
    trainer(tmp_path / "run", steps).fit(module, data, ckpt_path=last)
    resumed = weights(module)
    assert resumed.keys() == straight.keys()
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), name  # bit for bit


class StepCounter(Callback):
    """Counts the ends of RL steps it saw, in its checkpointed state (as the drafter's and the evaluation's are)."""

    def __init__(self) -> None:
        self.ends = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.ends += 1

    def state_dict(self) -> dict[str, int]:
        return {"ends": self.ends}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.ends = state_dict["ends"]


def test_the_interrupted_step_is_whole_in_the_checkpoint_and_in_the_logged_metrics(tmp_path: Path) -> None:
    """Listed first, the callback still ends the step after every other one (a callback after it in the list has
    its end of the interrupted step in last.ckpt), and the step's metrics reach the logger before the exit."""
    module, data = make()
    counter = StepCounter()
    run = pl.Trainer(max_steps=4 * ITERATIONS, accelerator="cpu", logger=CSVLogger(tmp_path, name="csv"),
                     log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, default_root_dir=tmp_path,
                     callbacks=[InterruptCheckpoint(), counter, SignalAt(signal.SIGTERM, batch=1)])  # fmt: skip
    with pytest.raises(SystemExit):
        run.fit(module, data)
    saved = torch.load(next(tmp_path.rglob("last.ckpt")), weights_only=False)
    assert saved["global_step"] == 2 * ITERATIONS and counter.ends == 2
    assert saved["callbacks"]["StepCounter"] == {"ends": 2}  # the interrupted step's end is in it
    with open(next(tmp_path.glob("csv/version_0/metrics.csv"))) as f:
        logged = [int(r["step"]) for r in csv.DictReader(f) if r.get("loss")]
    assert logged == [ITERATIONS, 2 * ITERATIONS]  # both RL steps' metrics, the interrupted one's too


def test_an_exception_writes_a_resumable_checkpoint(tmp_path: Path) -> None:
    calls = {"n": 0}

    def fails_on_the_third_step(completions: list[str], **kwargs: object) -> list[float]:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("grader down")
        return digits(completions)

    module, data = make(fails_on_the_third_step)
    with pytest.raises(RewardFunctionError, match="grader down"):
        trainer(tmp_path, 4 * ITERATIONS).fit(module, data)
    path = tmp_path / "checkpoints" / "on_exception.ckpt"
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == 2 * ITERATIONS and "lightning_tlt_checksums" in saved
    assert not (tmp_path / "checkpoints" / "last.ckpt").exists()
    module, data = make()
    resumed = trainer(tmp_path / "resumed", 4 * ITERATIONS)
    resumed.fit(module, data, ckpt_path=path)
    assert resumed.global_step == 4 * ITERATIONS


def test_a_signal_before_the_first_step_stops_at_once(tmp_path: Path) -> None:
    class SignalAtFitStart(Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            os.kill(os.getpid(), signal.SIGTERM)

    module, data = make()
    with pytest.raises(SystemExit) as stop:
        trainer(tmp_path, 4, SignalAtFitStart()).fit(module, data)
    assert stop.value.code == 143
    assert not list(tmp_path.rglob("*.ckpt"))  # nothing was trained: nothing to save


def test_unknown_signal_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"signals must be among \['SIGINT', 'SIGTERM'\], got \['SIGHUP'\]"):
        InterruptCheckpoint(signals=("SIGHUP",))


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_the_cli_interrupted_by_a_real_signal_exits_with_its_code_and_leaves_last_ckpt(
    tmp_path: Path, signum: int, code: int
) -> None:
    config = yaml.safe_load((ROOT / "configs" / "demo_cpu.yaml").read_text())
    callbacks = [c for c in config["trainer"]["callbacks"] if "drafter_cotrain" not in c["class_path"]]
    assert any(c["class_path"].endswith("InterruptCheckpoint") for c in callbacks)
    config["trainer"].update(callbacks=callbacks, max_steps=400, default_root_dir=str(tmp_path),
                             logger={"class_path": "lightning.pytorch.loggers.CSVLogger",
                                     "init_args": {"save_dir": str(tmp_path), "name": "run"}})
    config["model"]["init_args"]["policy"].update(warm_start=None)
    config["model"]["init_args"]["config"]["max_completion_length"] = 12
    config["data"].update(dataset="arithmetic", prompts_per_step=2, task_size=16)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "lightning_tlt.cli", "fit", "--config", str(path)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    assert proc.stdout is not None
    lines = []
    deadline = time.monotonic() + 240
    for line in proc.stdout:  # wait until the second RL step has been logged
        lines.append(line)
        if "step 4/400" in line or time.monotonic() > deadline:
            break
    proc.send_signal(signum)
    rest, _ = proc.communicate(timeout=240)
    output = "".join(lines) + rest
    assert proc.returncode == code, output[-3000:]
    (last,) = tmp_path.glob("run/version_0/checkpoints/last.ckpt")
    step = torch.load(last, weights_only=False)["global_step"]
    assert step >= 4 and step % ITERATIONS == 0, step  # a whole RL step, at least the one logged
    assert f"resume with --ckpt_path {last}" in output


DDP_SCRIPT = '''
import os, signal, sys
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning_tlt.callbacks.interrupt_checkpoint import InterruptCheckpoint
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule


def digits(completions, **kw):
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


class SignalRankOne(Callback):  # a SIGTERM that reaches rank 1 only, as RL step 1 starts
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 1 and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        print(f"REPORT {trainer.global_rank} {trainer.global_step}", flush=True)


if __name__ == "__main__":
    module = GRPOModule(build_model("qwen2", "tiny", seed=0),
                        GRPOConfig(num_generations=4, max_completion_length=8, learning_rate=1e-2))
    data = RolloutDataModule("arithmetic", [digits], prompts_per_step=2, task_size=16)
    pl.Trainer(max_steps=6, accelerator="cpu", devices=2, strategy="ddp", logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
               default_root_dir=sys.argv[1], callbacks=[SignalRankOne(), InterruptCheckpoint()]).fit(module, data)
'''


def run_ddp(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    """Run a two-rank script (this checkout first on the path) with ``tmp_path`` as its root folder."""
    script = tmp_path / "ddp.py"
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=env)


def test_under_ddp_a_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    proc = run_ddp(tmp_path, DDP_SCRIPT)
    assert proc.returncode == 143, proc.stderr[-3000:]
    reports = sorted(re.findall(r"REPORT (\d) (\d+)", proc.stdout))
    assert reports == [("0", "1"), ("0", "2"), ("1", "1"), ("1", "2")], proc.stdout  # both ranks ran steps 1 and 2
    saved = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 2


DDP_EXCEPTION_SCRIPT = DDP_SCRIPT.replace(
    "class SignalRankOne(Callback):", '''calls = []


def fails_on_rank_one(completions, **kw):  # a grader that fails on rank 1's second RL step
    calls.append(1)
    if os.environ.get("LOCAL_RANK", "0") == "1" and len(calls) == 2:
        raise RuntimeError("grader down")
    return digits(completions)


class SignalRankOne(Callback):''').replace("[digits]", "[fails_on_rank_one]").replace(
    "os.kill(os.getpid(), signal.SIGTERM)", "pass")


def test_under_ddp_the_failing_rank_writes_its_own_exception_checkpoint(tmp_path: Path) -> None:
    proc = run_ddp(tmp_path, DDP_EXCEPTION_SCRIPT)
    assert proc.returncode != 0
    assert "grader down" in proc.stderr
    path = tmp_path / "checkpoints" / "on_exception-rank1.ckpt"
    assert f"saved to {path}" in proc.stderr, proc.stderr[-3000:]
    from lightning_tlt.core.checksums import load_checkpoint

    saved = load_checkpoint(path)  # whole, and every tensor passes its checksum
    assert saved["global_step"] == 1
    module, data = make()
    resumed = trainer(tmp_path / "resumed", 3)
    resumed.fit(module, data, ckpt_path=path)  # resumable on one process
    assert resumed.global_step == 3
