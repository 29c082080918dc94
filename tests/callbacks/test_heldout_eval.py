"""EvalCallback: held-out prompts never trained on, hand-computed intervals, training undisturbed, resumed exactly."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_tlt.callbacks.drafter_cotrain import DrafterCoTrainCallback, DrafterCoTrainConfig
from lightning_tlt.callbacks.heldout_eval import EvalCallback, EvalConfig
from lightning_tlt.callbacks.rollout_metrics import RolloutMetricsCallback
from lightning_tlt.core.types import SpeculativeConfig
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.data.heldout import HeldOutScores, cluster_interval, heldout_metrics, wilson_interval
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.tasks import get_task, split_of


def has_digit(completions: list[str], **kwargs: object) -> list[float]:
    """1 when the completion holds a digit: a tiny random policy gets a mix of both."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


# ----------------------------------------------------------------------------- the figures, by hand
def test_wilson_interval_is_the_textbook_one() -> None:
    # 5 of 10, z = 1.96: centre 0.5, half-width 1.96 * sqrt(0.025 + 0.0096) / 1.384 = 0.2634
    low, high = wilson_interval(5, 10)
    assert (low, high) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    low, high = wilson_interval(0, 20)  # never 0-width at 0 (the Wald interval would be [0, 0])
    assert low == 0.0 and high == pytest.approx(3.8415 / (20 + 3.8415), abs=1e-4)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(3, 2)


def test_the_sampled_interval_treats_a_prompts_samples_as_one_cluster() -> None:
    values = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # per-prompt means 1, .5, .5, 0
    mean, low, high = cluster_interval(values)
    se = math.sqrt((0.25 + 0 + 0 + 0.25) / 3) / 2  # sd of the 4 means over sqrt(4)
    assert mean == 0.5 and (low, high) == pytest.approx((0.5 - 1.959964 * se, 0.5 + 1.959964 * se))
    # the same 8 completions as 8 independent trials would give a narrower interval than 4 clusters
    assert high - low > 2 * 1.959964 * math.sqrt(0.25 / 8)
    # a prompt always right and one always wrong are 2 clusters, not 2 x 10 trials
    mean, low, high = cluster_interval(torch.tensor([[1.0] * 10, [0.0] * 10]))
    assert mean == 0.5 and (low, high) == (0.0, 1.0)
    # every prompt wrong every time: no spread to estimate, so Wilson's interval over the 4 prompts, not [0, 0]
    assert cluster_interval(torch.zeros(4, 3)) == (0.0, *wilson_interval(0, 4))


def test_heldout_metrics_by_hand() -> None:
    scores = HeldOutScores(
        greedy=torch.tensor([1.0, 0.0, 1.0, 1.0]),
        sampled=torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]),
        lengths=torch.tensor([[10.0, 20.0], [30.0, 40.0], [50.0, 60.0], [70.0, 80.0]]),
        clipped=torch.tensor([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1.0]]),
    )
    m = heldout_metrics(scores, temperature=1.0)
    assert m["eval/correctness_greedy"] == 0.75
    assert (m["eval/correctness_greedy_low"], m["eval/correctness_greedy_high"]) == pytest.approx(wilson_interval(3, 4))
    assert m["eval/correctness_t1"] == 0.5 and m["eval/correctness_t1_low"] == pytest.approx(0.5 - 0.40010, abs=1e-4)
    # lengths 10..80: mean 45; linear quantiles at 3.5, 6.3 and 6.93 of the sorted 8
    assert (m["eval/len_mean"], m["eval/len_p50"], m["eval/len_p90"], m["eval/len_p99"]) == pytest.approx(
        (45.0, 45.0, 73.0, 79.3))
    assert m["eval/clipped_ratio"] == 0.125 and m["eval/num_prompts"] == 4 and m["eval/num_samples"] == 2
    assert "eval/correctness_t0.7" in heldout_metrics(scores, temperature=0.7)


# ----------------------------------------------------------------------------- the prompts
def test_heldout_prompts_are_the_test_split_distinct_and_never_trained_on(tmp_path: Path) -> None:
    data = RolloutDataModule("countdown_search", difficulty=3, task_size=512, seed=0)
    data.prepare()
    rows = data.heldout_dataset(256).to_list()
    statements = [r["prompt"].rstrip("\n") for r in rows]
    assert len(set(statements)) == 256  # the test split repeats itself (227 distinct in its first 256): drawn on
    assert all(split_of(s) == "test" for s in statements)  # the task's own split, by the statement's hash
    assert not set(r["prompt"] for r in rows) & set(data.train_data["prompt"])  # type: ignore[index]
    # the first of them are the validation prompts' (same seed), and a second call gives the same set
    assert rows[0]["prompt"] == get_task("countdown_search").make_dataset(1, difficulty=3, seed=0, split="test")[0]["prompt"]
    assert data.heldout_dataset(256).to_list() == rows
    # a held-out file that shares a prompt with training is refused; one too small is too
    train = data.train_data.to_list()[:3]  # type: ignore[union-attr]
    leaky = RolloutDataModule(train * 2, [has_digit], eval_dataset=train[:1] + rows[:5], prompts_per_step=2)
    leaky.prepare()
    with pytest.raises(ValueError, match="1 of the 4 held-out prompts are training prompts too"):
        leaky.heldout_dataset(4)
    with pytest.raises(ValueError, match="asked for 10 held-out prompts, the held-out source has 6 distinct ones"):
        leaky.heldout_dataset(10)
    with pytest.raises(ValueError, match="no held-out prompts"):
        bare = RolloutDataModule(train * 2, [has_digit], prompts_per_step=2)
        bare.prepare()
        bare.heldout_dataset(2)


# ----------------------------------------------------------------------------- with a real Trainer
SPEC = SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=1, num_draft_tokens=None,
                         draft_candidates=(2, 4), deterministic=True)


def make() -> tuple[GRPOModule, RolloutDataModule]:
    module = GRPOModule(build_model("qwen2", "tiny", seed=0), GRPOConfig(
        num_generations=4, max_completion_length=8, learning_rate=1e-3, lr_scheduler_type="constant"))
    return module, RolloutDataModule("arithmetic", [has_digit], prompts_per_step=2, task_size=32, seed=0,
                                     speculative=SPEC)


def drafter() -> DrafterCoTrainCallback:
    return DrafterCoTrainCallback(DrafterCoTrainConfig(
        stall_threshold=8, max_steps_per_event=2, max_decode_slowdown=0.05, batch_size=4, max_len=16,
        heldout_fraction=0.25, eval_every_n_steps=1, buffer_tokens=1024, deterministic=True, drafter_step_cost=0.15))


def evaluator() -> EvalCallback:
    return EvalCallback(EvalConfig(num_prompts=6, every_n_steps=2, num_samples=2))


def fit(root: Path, max_steps: int, callbacks: list[Callback], ckpt_path: Path | None = None) -> pl.Trainer:
    trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=CSVLogger(root, name="csv"),
                         log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root, callbacks=callbacks)
    module, data = make()
    trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return trainer


def weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_training_with_the_evaluation_ends_with_the_weights_of_training_without_it(tmp_path: Path) -> None:
    """Same seed, with and without EvalCallback (evaluating at steps 0, 2 and 3 through the training engine, which
    speculates with a deterministic tuner while a drafter co-trains in the stalls): the same policy and drafter,
    bit for bit; the evaluation logged its figures at its steps and kept them out of the step times."""
    plain_drafter, seen_drafter, evaluation, metrics = drafter(), drafter(), evaluator(), RolloutMetricsCallback()
    plain = fit(tmp_path / "plain", 3, [plain_drafter])
    seen = fit(tmp_path / "seen", 3, [seen_drafter, evaluation, metrics])
    for name, value in weights(plain.lightning_module).items():
        assert torch.equal(weights(seen.lightning_module)[name], value), name
    assert plain_drafter.drafter is not None and seen_drafter.drafter is not None
    for name, value in weights(plain_drafter.drafter).items():
        assert torch.equal(weights(seen_drafter.drafter)[name], value), name
    assert plain_drafter.learner.steps_enqueued == seen_drafter.learner.steps_enqueued > 0  # type: ignore[union-attr]
    assert [h["step"] for h in evaluation.history] == [0.0, 2.0, 3.0]  # the control, every 2 steps, the last
    with open(next((tmp_path / "seen").glob("csv/version_*/metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("eval/correctness_t1")]
    assert [int(r["step"]) for r in rows] == [0, 2, 3]
    for row, entry in zip(rows, evaluation.history):
        for key in ("eval/correctness_greedy", "eval/correctness_greedy_low", "eval/correctness_t1_high",
                    "eval/len_p99", "eval/seconds"):
            assert float(row[key]) == pytest.approx(entry[key])
        assert entry["eval/correctness_greedy_low"] <= entry["eval/correctness_greedy"] <= entry["eval/correctness_greedy_high"]
        assert entry["eval/num_prompts"] == 6 and entry["eval/len_p50"] <= entry["eval/len_p90"] <= entry["eval/len_p99"]


def test_a_resumed_run_continues_the_history_and_the_next_evaluation(tmp_path: Path) -> None:
    """Resumed from the checkpoint of an evaluation step (2) and of a step between two (3): the history and the
    next evaluation's step come back, and the run ends as the unbroken one, history and weights alike."""
    straight = evaluator()
    every = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1)
    full = fit(tmp_path / "full", 4, [straight, every])
    assert [h["step"] for h in straight.history] == [0.0, 2.0, 4.0]
    for step in (2, 3):
        (path,) = (tmp_path / "ckpt").glob(f"*step={step}.ckpt")
        state = next(v for k, v in torch.load(path, weights_only=False)["callbacks"].items() if "EvalCallback" in k)
        assert [h["step"] for h in state["history"]] == [0.0, 2.0] and state["next_step"] == 4
        resumed = evaluator()
        again = fit(tmp_path / f"from{step}", 4, [resumed], ckpt_path=path)
        assert resumed.history == straight.history[:2] + resumed.history[2:]  # restored, not re-measured
        assert [h["step"] for h in resumed.history] == [0.0, 2.0, 4.0]
        for key, value in straight.history[2].items():
            if key != "eval/seconds":
                assert resumed.history[2][key] == value, key
        for name, value in weights(full.lightning_module).items():
            assert torch.equal(weights(again.lightning_module)[name], value), name


def test_config_is_checked_and_another_heldout_set_is_refused_on_resume(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_prompts must be >= 1"):
        EvalConfig(num_prompts=0)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        EvalConfig(temperature=0.0)
    with pytest.raises(ValueError, match=r"unknown EvalConfig fields \['prompts'\]"):
        EvalCallback(prompts=3)
    with pytest.raises(ValueError, match="format 1"):
        EvalCallback().load_state_dict({"format": 0})
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
    fit(tmp_path / "first", 1, [EvalCallback(num_prompts=3, num_samples=1, greedy=False), ckpt])
    with pytest.raises(ValueError, match="measured on another held-out set"):
        fit(tmp_path / "second", 2, [EvalCallback(num_prompts=4, num_samples=1, greedy=False)],
            ckpt_path=tmp_path / "ckpt" / "last.ckpt")
