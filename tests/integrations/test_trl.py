"""The engine as TRL 1.16 GRPOTrainer's rollout_func, with a real GRPOTrainer on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.integrations.trl import group_repeats, rollout_func
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")


def digits(completions: list[str], **kwargs: object) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]


def test_group_repeats() -> None:
    assert group_repeats(["a", "a", "b", "b"]) == (["a", "b"], 2)
    assert group_repeats(["a", "a", "a"]) == (["a"], 3)
    assert group_repeats(["a", "b", "a"]) == (["a", "b", "a"], 1)
    assert group_repeats(["a", "a", "b"]) == (["a", "a", "b"], 1)
    msgs = [[{"role": "user", "content": "x"}]] * 2
    assert group_repeats(msgs) == ([msgs[0]], 2)


def test_real_grpo_trainer_two_steps(tmp_path: Path, tokenizer) -> None:  # noqa: ANN001
    from trl import GRPOConfig, GRPOTrainer

    model = build_model("qwen2", "tiny", seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=64)
    f = rollout_func(engine, tokenizer)
    calls: list[int] = []

    def counting(prompts, trainer):  # noqa: ANN001
        out = f(prompts, trainer)
        calls.append(len(prompts))
        assert len(out["completion_ids"]) == len(prompts)
        assert all(1 <= len(c) <= 8 for c in out["completion_ids"])
        assert [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]
        encoded = [tokenizer(p)["input_ids"] for p in prompts]  # <bos> + text, as TRL encodes plain prompts
        assert out["prompt_ids"] == encoded
        return out

    args = GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, max_steps=2, learning_rate=1e-2, logging_steps=1, report_to="none",
        save_strategy="no", seed=0, dataloader_num_workers=0,
    )
    data = Dataset.from_list([{"prompt": f"Q{i}: 1+{i}=\n"} for i in range(8)])
    trainer = GRPOTrainer(
        model=model, reward_funcs=[digits], args=args, train_dataset=data, processing_class=tokenizer,
        rollout_func=counting,
    )
    trainer.train()
    assert calls == [8, 8]  # two steps, 2 prompts x 4 generations each
    moved = max((before[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert moved > 1e-4
    logged = {k for entry in trainer.state.log_history for k in entry}
    assert {"reward", "completions/mean_length", "rollout/tokens_per_s", "spec/fraction"} <= logged


def test_sampling_follows_trainer_args_and_engine_is_created_lazily(tokenizer) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    model = build_model("qwen2", "tiny", seed=0)
    args = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_completion_length=5, seed=3)
    trainer = SimpleNamespace(args=args, model=model, processing_class=tokenizer)
    f = rollout_func(sampling=SamplingConfig(temperature=0.0, max_new_tokens=5))
    out = f(["ab", "ab", "cd", "cd"], trainer)
    assert isinstance(f.state["engine"], RolloutEngine)
    assert all(1 <= len(c) <= 5 for c in out["completion_ids"])
    # greedy: both samples of one prompt are the same
    assert out["completion_ids"][0] == out["completion_ids"][1]
    assert out["completion_ids"][2] == out["completion_ids"][3]
    # greedy logprobs are log 1 = 0 under the (one-hot) sampling distribution
    assert torch.tensor(out["logprobs"][0]).abs().max().item() == pytest.approx(0.0, abs=1e-5)


def test_with_trl_bf16_a_float32_model_rolls_out_in_bf16(tokenizer) -> None:  # noqa: ANN001
    from types import SimpleNamespace

    model = build_model("qwen2", "tiny", seed=0)  # float32 weights, as TRL keeps them under bf16=True
    args = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, max_completion_length=5, seed=3, bf16=True)
    f = rollout_func(sampling=SamplingConfig(temperature=0.0, max_new_tokens=5))
    f(["ab", "ab"], SimpleNamespace(args=args, model=model, processing_class=tokenizer))
    engine = f.state["engine"]
    assert engine.dtype == torch.bfloat16 and engine.inference_copy is not None
    assert next(model.parameters()).dtype == torch.float32  # the model itself untouched
