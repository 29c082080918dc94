"""FSDP at world size 1 (as configs/grpo_gpu_0.5b_fsdp.yaml on one GPU), in this process, and the errors
that name what to write instead: FSDP1, tensor parallelism, an unsharded trainable parameter, a drafter
co-trained on an engine that keeps no whole copy of a sharded policy."""

from __future__ import annotations

import copy
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.device_mesh import init_device_mesh

from lightning_tlt.callbacks.drafter_cotrain import (
    DrafterCoTrainCallback,
    DrafterCoTrainConfig,
    shared_weights,
)
from lightning_tlt.core.sharding import is_sharded
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.config import GRPOConfig
from lightning_tlt.rl.fsdp import check_sharded_training, check_strategy, shard_module
from lightning_tlt.rl.grpo import GRPOModule
from lightning_tlt.rollout.engine import RolloutEngine


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A process group of one rank (gloo), taken down afterwards."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp1_and_tensor_parallelism_are_refused_with_what_to_write() -> None:
    with pytest.raises(ValueError, match=r"not FSDPStrategy \(FSDP1.*ModelParallelStrategy.*tensor_parallel_size: 1"):
        check_strategy(SimpleNamespace(strategy=FSDPStrategy()))  # type: ignore[arg-type]
    strategy = ModelParallelStrategy()
    sizes = {"data_parallel": 1, "tensor_parallel": 2}
    strategy._device_mesh = {k: SimpleNamespace(size=lambda v=v: v) for k, v in sizes.items()}  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: .*data-parallel ranks only"):
        check_strategy(SimpleNamespace(strategy=strategy))  # type: ignore[arg-type]
    assert check_strategy(SimpleNamespace(strategy="ddp")) is None  # type: ignore[arg-type]


def test_an_unsharded_trainable_parameter_and_a_copyless_engine_are_refused(one_rank: None) -> None:
    policy = shard_module(build_model("qwen2", "tiny", seed=0), init_device_mesh("cpu", (1,)))
    assert is_sharded(policy)
    head = torch.nn.Linear(4, 1)
    with pytest.raises(ValueError, match=r"2 trainable parameters are not sharded \(first: 'weight'\)"):
        check_sharded_training(list(head.parameters()), head)
    engine = RolloutEngine(policy, max_seq_len=16, max_batch_size=2, dtype="bfloat16")
    assert engine.inference_copy is not None and shared_weights(policy, engine) is engine.inference_copy.module
    vllm_like = SimpleNamespace(inference_copy=None)
    with pytest.raises(ValueError, match=r"the SimpleNamespace backend keeps none. Use RolloutDataModule\(engine='native'\)"):
        shared_weights(policy, vllm_like)  # type: ignore[arg-type]
    assert shared_weights(build_model("qwen2", "tiny"), vllm_like) is None  # type: ignore[arg-type]


def test_grpo_with_the_drafter_on_one_sharded_rank(tmp_path: Path) -> None:
    """The one-GPU config's path on the CPU: ModelParallelStrategy(1, 1), bf16-mixed, the drafter co-trained
    against the engine's gathered copy; a sharded checkpoint directory that resumes."""
    def run(steps: int, ckpt_path: Path | None = None) -> tuple[GRPOModule, DrafterCoTrainCallback, Any]:
        module = GRPOModule(build_model("qwen2", "tiny", seed=0),
                            GRPOConfig(num_generations=4, max_completion_length=10, learning_rate=1e-2))
        data = RolloutDataModule("arithmetic", prompts_per_step=2, task_size=16, seed=0)
        cb = DrafterCoTrainCallback(DrafterCoTrainConfig(
            stall_threshold=8, max_steps_per_event=1, max_decode_slowdown=None, batch_size=4, max_len=24,
            heldout_fraction=0.25, buffer_tokens=2048, deterministic=True,
        ))  # fmt: skip
        ckpt = pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
        trainer = pl.Trainer(
            strategy=ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), accelerator="cpu", devices=1,
            precision="bf16-mixed", max_steps=steps, logger=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, callbacks=[cb, ckpt],
        )  # fmt: skip
        # Lightning's launcher writes MASTER_PORT, LOCAL_RANK, WORLD_SIZE, ... into this process's environment:
        # put it back, or a later test's subprocess would take itself for an externally launched rank
        with mock.patch.dict(os.environ):
            try:
                trainer.fit(module, datamodule=data, ckpt_path=ckpt_path)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group()
        return module, cb, data

    module, cb, data = run(3)
    assert is_sharded(module.policy) and data.engine.inference_copy.sharded
    assert cb.drafter is not None and cb.drafter.embed_weight.data_ptr() == (
        data.engine.inference_copy.module.model.embed_tokens.weight.data_ptr()
    )  # the drafter reads the gathered bf16 copy's embedding, whole
    assert cb.drafter.fc.weight.dtype == torch.float32 and cb.drafter.embed_weight.dtype == torch.bfloat16
    assert cb.learner is not None and cb.learner.steps_enqueued > 0 and cb.version == 2
    assert data.engine.last_stats["gather/bytes"] == data.engine.inference_copy.nbytes
    resumed, resumed_cb, _ = run(3, tmp_path / "ckpt" / "epoch=0-step=2.ckpt")
    for (name, a), (_, b) in zip(module.policy.named_parameters(), resumed.policy.named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    assert resumed_cb.drafter is not None
    for name, value in cb.drafter.state_dict().items():
        assert torch.equal(resumed_cb.drafter.state_dict()[name], value), name


def _whole(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each gradient gathered from its shards (a sharded parameter's gradient is a DTensor)."""
    return {name: g.full_tensor() if hasattr(g, "full_tensor") else g for name, g in grads.items()}


@pytest.mark.parametrize("tied", [False, True])
def test_a_sharded_policy_chunks_its_log_probs_and_matches_the_unsharded_full_path(
    one_rank: None, tied: bool
) -> None:
    # measured on an H100 (issue 37): FSDP2's wrapper class was not a known plain-head architecture, so a
    # sharded policy built the full (B, C, V) float32 logits and its first backward at 16,384 micro-batch
    # tokens ran out of memory. Sharded and chunked, the log-probs, the entropies, the features and every
    # parameter's gradient (gathered from its shards) equal the unsharded model's full path.
    from test_logprobs import assert_grads_close, batch_for, forward_and_grads, tied_qwen2

    from lightning_tlt.rl.logprobs import plain_lm_head, sharded_plain_lm_head

    reference = (tied_qwen2() if tied else build_model("qwen2", "tiny", seed=0)).train()
    sharded = shard_module(copy.deepcopy(reference), init_device_mesh("cpu", (1,)))
    assert isinstance(plain_lm_head(sharded), str) and sharded_plain_lm_head(sharded) is None
    batch = batch_for(reference.config.vocab_size)
    full, full_grads = forward_and_grads(reference, batch, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fwd, grads = forward_and_grads(sharded, batch, 4)
    assert not [w for w in caught if "logprob_chunk_tokens" in str(w.message)]  # chunked, not the full path
    torch.testing.assert_close(fwd.logps, full.logps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fwd.entropies, full.entropies, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fwd.hidden_states, full.hidden_states, rtol=0, atol=0)
    assert_grads_close(_whole(grads), full_grads, 1e-5)
    assert sharded_plain_lm_head(build_model("qwen2", "tiny", seed=0)) == "not sharded by FSDP2"


def test_checkpointed_and_sharded_layers_match_the_plain_model(one_rank: None) -> None:
    # issue 37: gradient_checkpointing for the sharded policy (the FSDP config's): the layers checkpointed,
    # then sharded, recompute under FSDP2 to the unsharded plain model's log-probs and gradients
    from test_logprobs import assert_grads_close, batch_for, forward_and_grads

    from lightning_tlt.rl.fsdp import checkpoint_layers

    reference = build_model("qwen2", "tiny", seed=0).train()
    model = copy.deepcopy(reference)
    checkpoint_layers(model)
    sharded = shard_module(model, init_device_mesh("cpu", (1,)))
    batch = batch_for(reference.config.vocab_size)
    want, want_grads = forward_and_grads(reference, batch, 4)
    got, grads = forward_and_grads(sharded, batch, 4)
    torch.testing.assert_close(got.logps, want.logps, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=0)
    assert_grads_close(_whole(grads), want_grads, 1e-5)
