"""`validate_prompts`: integers of every kind pass as ints; floats, strings and bad shapes are named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from lightning_tlt.core.prompts import validate_prompts
from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.rollout.engine import RolloutEngine


def test_integers_of_every_kind_become_python_ints() -> None:
    out = validate_prompts(
        [[1, 2], (np.int64(3), np.int32(4)), torch.tensor([5, 6]), [torch.tensor(7)]], vocab_size=8
    )
    assert out == [(1, 2), (3, 4), (5, 6), (7,)]
    assert all(type(t) is int for ids in out for t in ids)


@pytest.mark.parametrize(
    ("prompts", "error", "match"),
    [
        ([[1, 2], [3, 4.0]], TypeError, r"prompt 1 has 4\.0 \(float\) at position 1; token ids must be integers"),
        ([[1, "7"]], TypeError, r"prompt 0 has '7' \(str\) at position 1"),
        ([[1, True]], TypeError, r"prompt 0 has True \(bool\) at position 1"),
        ([torch.tensor([1.0, 2.0])], TypeError, r"prompt 0 has tensor\(1\.\) \(Tensor\) at position 0"),
        ([[1], "hello"], TypeError, r"prompt 1 is a str \('hello'\); the engine takes token ids"),
        ([torch.ones(2, 2, dtype=torch.long)], TypeError, r"prompt 0 is a tensor of shape \(2, 2\)"),
        ([[1], 5], TypeError, r"prompt 1 is a int, not a sequence of token ids"),
        ("12", TypeError, r"prompts must be a list of token-id lists, got str"),
        ([[1], []], ValueError, r"prompt 1 is empty"),
        ([[1, 8]], ValueError, r"prompt 0 has token id 8 outside the vocabulary \[0, 8\)"),
        ([[1, -1]], ValueError, r"token id -1 outside the vocabulary"),
    ],
)
def test_bad_prompts_name_the_prompt_and_element(prompts: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        validate_prompts(prompts, vocab_size=8)  # type: ignore[arg-type]


def test_length_is_checked_against_the_context() -> None:
    assert validate_prompts([[1] * 4], 8, max_new_tokens=4, max_seq_len=8) == [(1, 1, 1, 1)]
    with pytest.raises(ValueError, match=r"prompt 0 has 5 tokens; with max_new_tokens=4 that is 9 > max_seq_len=8"):
        validate_prompts([[1] * 5], 8, max_new_tokens=4, max_seq_len=8)


def test_the_engine_refuses_float_ids_before_generating(tiny_qwen2: PreTrainedModel) -> None:
    engine = RolloutEngine(tiny_qwen2, max_seq_len=32, max_batch_size=2)
    with pytest.raises(TypeError, match=r"prompt 0 has 3\.7 \(float\) at position 2"):
        engine.generate([[1, 2, 3.7]], SamplingConfig(max_new_tokens=4))  # type: ignore[list-item]


def test_prompts_past_the_policys_positions_are_refused_or_warned_about() -> None:
    from lightning_tlt.core.prompts import PositionLimit

    plain, scaled = PositionLimit(16, None), PositionLimit(16, "yarn")
    assert validate_prompts([[1] * 12], 8, max_new_tokens=4, max_seq_len=64, positions=plain) == [(1,) * 12]
    with pytest.raises(ValueError, match=r"^prompt 1 has 13 tokens; with max_new_tokens=4 that is 17 > the policy's "
                                         r"max_position_embeddings=16: positions past it were never trained"):
        validate_prompts([[1] * 3, [1] * 13], 8, max_new_tokens=4, max_seq_len=64, positions=plain)
    with pytest.warns(UserWarning, match=r"17 > the policy's max_position_embeddings=16; its RoPE scaling \('yarn'\)"):
        validate_prompts([[1] * 13], 8, max_new_tokens=4, max_seq_len=64, positions=scaled)


def test_policy_positions_reads_the_config_and_its_rope_scaling(tiny_qwen2: PreTrainedModel) -> None:
    from transformers import Qwen2Config

    from lightning_tlt.core.prompts import PositionLimit, policy_positions

    assert policy_positions(tiny_qwen2) == PositionLimit(tiny_qwen2.config.max_position_embeddings, None)
    yarn = Qwen2Config(max_position_embeddings=4096,
                       rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096})
    assert policy_positions(yarn) == PositionLimit(4096, "yarn")
    assert policy_positions(object()) is None


def test_the_engine_refuses_long_prompts_oov_stop_ids_and_infinite_temperature() -> None:
    from lightning_tlt.models.zoo import build_model

    policy = build_model("qwen2", "tiny", seed=0)
    policy.config.max_position_embeddings = 24  # a short-context policy in an engine whose cache holds more
    engine = RolloutEngine(policy, max_seq_len=64, max_batch_size=2)
    with pytest.raises(ValueError, match=r"prompt 0 has 30 tokens; with max_new_tokens=4 that is 34 > the policy's "
                                         r"max_position_embeddings=24"):
        engine.generate([[1] * 30], SamplingConfig(max_new_tokens=4))
    vocab = engine.vocab_size
    with pytest.raises(ValueError, match=rf"stop token id {vocab} is outside the vocabulary \[0, {vocab}\): it could "
                                         r"never end a completion"):
        engine.generate([[1, 2]], SamplingConfig(max_new_tokens=4, stop_token_ids=[3, vocab]))
    out = engine.generate([[1, 2]], SamplingConfig(max_new_tokens=4, stop_token_ids=[vocab - 1]))
    assert len(out.completion_ids) == 1


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), -0.5])
def test_temperature_must_be_finite_and_non_negative(temperature: float) -> None:
    with pytest.raises(ValueError, match=r"temperature must be finite and >= 0 \(0 means greedy\), got"):
        SamplingConfig(temperature=temperature)
