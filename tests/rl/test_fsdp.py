"""GRPO and PPO under Lightning's FSDP (``ModelParallelStrategy``, FSDP2): two CPU processes over gloo.

The tests run this file as a script (Lightning's launcher re-runs it for rank 1); each rank writes
what it saw at every RL step to JSON: the policy's whole weights (gathered), its gradient norm, the
rollouts, the co-trained drafter and its replay buffer. Against the same run under DDP (unsharded,
the gradient all-reduced), the sharded steps train the same weights within float32 rounding, from the
same rollouts; a run resumed from the sharded checkpoint of step 2 (Lightning's distributed
checkpoint: one file per rank) continues exactly as the uninterrupted run, on both ranks.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

if TYPE_CHECKING:  # the files also run as scripts, where conftest is not on the path
    from conftest import TwoRanks

STEPS = 4


def launch(two_ranks: TwoRanks, tmp_path: Path, name: str, *args: str) -> list[list[dict[str, Any]]]:
    """Run this file on two ranks; every rank's reports, by step."""
    out = tmp_path / name
    out.mkdir()
    return two_ranks(__file__, out, *args, cwd=tmp_path)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory: pytest.TempPathFactory, two_ranks: TwoRanks) -> tuple[Path, list[list[dict[str, Any]]]]:
    """GRPO with the co-trained drafter under bf16-mixed (as configs/grpo_gpu_0.5b_fsdp.yaml): 4 steps, a
    sharded checkpoint at step 2."""
    tmp = tmp_path_factory.mktemp("fsdp")
    return tmp, launch(two_ranks, tmp, "full", "grpo", "fsdp", "bf16-mixed", str(STEPS), str(tmp / "ckpt"), "-")


def assert_same_weights(mine: dict[str, Any], theirs: dict[str, Any], suffix: str = ".pt") -> None:
    """Every tensor within float32 rounding (a reduce-scatter sums in another order than an all-reduce).

    Adam divides each step by the gradient's own scale, so an element whose gradient is near zero moves by
    its rounding noise scaled up (PPO at a learning rate of 1e-2, AMD EPYC, 2026-12-06: a q_proj weight
    1.4e-6 apart after two steps, varying from run to run): atol 1e-5, far below the 1e-2 a missed or
    doubled gradient shard moves an element. The keys' biases, looser still: their exact gradient is zero
    (a bias on every key adds one constant to a query's scores, which the softmax ignores), so all of it
    is noise (up to 6.3e-6 apart)."""
    a, b = (torch.load(r["weight_file"].replace(".pt", suffix)) for r in (mine, theirs))
    assert a.keys() == b.keys()
    for name in b:
        atol = 1e-4 if name.endswith("k_proj.bias") else 1e-5
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.slow
def test_sharded_grpo_steps_equal_ddp_steps(tmp_path: Path, two_ranks: TwoRanks) -> None:
    """Float32 (32-true), so that Adam's normalised step does not amplify bf16 rounding: the sharded
    run and the DDP run train the same weights and drafter, from the same rollouts, step for step."""
    fsdp = launch(two_ranks, tmp_path, "fsdp", "grpo", "fsdp", "32-true", "2", "-", "-")
    ddp = launch(two_ranks, tmp_path, "ddp", "grpo", "ddp", "32-true", "2", "-", "-")
    for rank in (0, 1):
        assert fsdp[rank][0]["sharded"] and fsdp[rank][0]["local_share"] == pytest.approx(0.5, abs=0.01)
        for mine, theirs in zip(fsdp[rank], ddp[rank]):
            assert mine["rollouts"] == theirs["rollouts"]  # from the gathered copy (float32 here) as from the policy
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
            assert_same_weights(mine, theirs)
            assert_same_weights(mine, theirs, "_drafter.pt")
            assert mine["version"] == theirs["version"] and mine["drafter_steps"] == theirs["drafter_steps"]
        assert ddp[rank][0]["gather"] == {}  # nothing gathered under DDP
    assert fsdp[0][1]["drafter_steps"] > 0


@pytest.mark.slow
def test_bf16_mixed_sharded_grpo_rolls_out_from_the_gather_and_averages_the_drafter(sharded_run: Any) -> None:
    _, fsdp = sharded_run
    for rank in (0, 1):
        first = fsdp[rank][0]
        # the gather's time and memory are logged with the rollout's metrics: the bf16 copy, one piece at a time
        assert first["gather"]["rollout/gather_time_s"] > 0
        assert first["gather"]["rollout/gather_buffer_mib"] * 2**20 == first["largest_param_bytes"]
        assert first["gather"]["rollout/gather_mib"] * 2**20 == first["policy_bytes"] // 2
    assert fsdp[0][0]["rollouts"] != fsdp[1][0]["rollouts"]  # each rank its own prompts
    # the drafter trained in both ranks' stalls and was averaged: one drafter, published to both engines
    for step in range(STEPS):
        for key in ("weights", "drafter", "published", "version"):
            assert fsdp[0][step][key] == fsdp[1][step][key], key
    assert fsdp[0][-1]["drafter_steps"] > 0 and fsdp[1][-1]["drafter_steps"] > 0 and fsdp[0][-1]["version"] == 3
    assert fsdp[0][-1]["buffer"] != fsdp[1][-1]["buffer"]  # each rank harvested its own features


@pytest.mark.slow
def test_resuming_the_sharded_checkpoint_continues_exactly_on_every_rank(sharded_run: Any, two_ranks: TwoRanks) -> None:
    tmp, full = sharded_run
    checkpoint = tmp / "ckpt" / "epoch=0-step=2.ckpt"
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    resumed = launch(two_ranks, tmp, "resumed", "grpo", "fsdp", "bf16-mixed", str(STEPS), "-", str(checkpoint))
    # ModelParallelStrategy restores callbacks after on_fit_start: the co-training callback must hand the
    # engine the restored published drafter then (it drafted with the cold one; with rejection sampling the
    # first resumed rollout differed wherever a near-tie went the other way: on rank 0 on an AMD EPYC)
    for rank in (0, 1):
        assert [r["step"] for r in resumed[rank]] == [3, 4]
        for mine, theirs in zip(resumed[rank], full[rank][2:]):
            for key in ("weights", "rollouts", "drafter", "published", "buffer", "drafter_steps", "version"):
                assert mine[key] == theirs[key], (rank, mine["step"], key)


@pytest.mark.slow
def test_sharded_ppo_steps_equal_ddp_steps(tmp_path: Path, two_ranks: TwoRanks) -> None:
    fsdp = launch(two_ranks, tmp_path, "fsdp", "ppo", "fsdp", "32-true", "2", "-", "-")
    ddp = launch(two_ranks, tmp_path, "ddp", "ppo", "ddp", "32-true", "2", "-", "-")
    for rank in (0, 1):
        assert fsdp[rank][0]["sharded"]
        for mine, theirs in zip(fsdp[rank], ddp[rank]):
            assert mine["rollouts"] == theirs["rollouts"]
            assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5)
            assert_same_weights(mine, theirs)  # the value head's too


# ---------------------------------------------------------------------------- the script
def digest(tensors: Any) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(out: str, algo: str, kind: str, precision: str, steps: str, ckpt_dir: str, resume: str) -> None:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_tlt.callbacks.drafter_cotrain import DrafterCoTrainCallback, DrafterCoTrainConfig
    from lightning_tlt.core.types import SpeculativeConfig
    from lightning_tlt.data.datamodule import RolloutDataModule
    from lightning_tlt.models.zoo import build_model
    from lightning_tlt.rl.config import GRPOConfig, PPOConfig
    from lightning_tlt.rl.grpo import GRPOModule
    from lightning_tlt.rl.ppo import PPOModule

    torch.set_num_threads(1)

    def digits(completions: list[str], **kwargs: object) -> list[float]:
        return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

    policy = build_model("qwen2", "tiny", seed=0)
    policy_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    largest = max(p.numel() * p.element_size() for p in policy.parameters())
    callbacks: list[Callback] = []
    cotrain: DrafterCoTrainCallback | None = None
    # one log-prob path on both sides, so that only the sharding differs: GRPO chunked (a sharded policy applies
    # its gathered head after its forward, test_fsdp_one_rank.py), PPO the full path
    if algo == "grpo":
        module: GRPOModule | PPOModule = GRPOModule(
            policy, GRPOConfig(num_generations=4, max_completion_length=10, learning_rate=1e-2,
                               lr_scheduler_type="constant", logprob_chunk_tokens=8),
        )  # fmt: skip
        speculative = SpeculativeConfig(method="eagle", threshold=8, hysteresis_steps=1, num_draft_tokens=3)
        cotrain = DrafterCoTrainCallback(DrafterCoTrainConfig(
            stall_threshold=8, max_steps_per_event=1, max_decode_slowdown=None, batch_size=4, max_len=24,
            learning_rate=1e-3, heldout_fraction=0.25, eval_every_n_steps=1, buffer_tokens=2048, seed=0,
            deterministic=True,
        ))  # fmt: skip
        callbacks.append(cotrain)
    else:
        module = PPOModule(policy, PPOConfig(response_length=10, learning_rate=1e-2, num_mini_batches=2,
                                             lr_scheduler_type="constant", kl_coef=0.05,
                                             logprob_chunk_tokens=0))  # fmt: skip
        speculative = None
    data = RolloutDataModule("arithmetic", [digits], prompts_per_step=2, task_size=32, seed=0, speculative=speculative)
    reports: list[dict[str, Any]] = []

    class Report(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            named = [(n, p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in pl_module.named_parameters()
                     if not n.startswith("ref_model.")]  # fmt: skip
            report: dict[str, Any] = {
                "step": trainer.global_step,
                "sharded": any(hasattr(p, "full_tensor") for p in pl_module.policy.parameters()),
                "local_share": sum(
                    (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in pl_module.policy.parameters()
                ) / policy_bytes,
                "weights": digest(t for _, t in named),
                "weight_file": str(Path(out, f"rank{trainer.global_rank}_step{trainer.global_step}.pt")),
                "grad_norm": pl_module._grad_norm,
                "rollouts": digest([batch.completion_ids]),
                "gather": {k: v for k, v in batch.metrics.items() if k.startswith("rollout/gather")},
                "largest_param_bytes": largest,
                "policy_bytes": policy_bytes,
            }
            if cotrain is not None:
                assert cotrain.drafter is not None and cotrain.published is not None and cotrain.learner is not None
                assert cotrain.buffer.features is not None
                report.update({
                    "drafter": digest(cotrain.drafter.state_dict().values()),
                    "published": digest(cotrain.published.state_dict().values()),
                    "buffer": digest([cotrain.buffer.features.float(), cotrain.buffer.tokens]),
                    "drafter_steps": cotrain.learner.steps_enqueued,
                    "version": cotrain.version,
                })
            torch.save({n.removeprefix("policy."): t.detach().clone() for n, t in named}, report["weight_file"])
            if cotrain is not None:
                torch.save(cotrain.drafter.state_dict(), report["weight_file"].replace(".pt", "_drafter.pt"))
            reports.append(report)

    callbacks.append(Report())
    if ckpt_dir != "-":
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1))
    strategy: Any = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1) if kind == "fsdp" else "ddp"
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=2, max_steps=int(steps), precision=precision, logger=False,
        enable_checkpointing=ckpt_dir != "-", enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=callbacks,
    )  # fmt: skip
    trainer.fit(module, datamodule=data, ckpt_path=None if resume == "-" else resume)
    Path(out, f"rank{trainer.global_rank}.json").write_text(json.dumps(reports))


if __name__ == "__main__":
    main(*sys.argv[1:])
