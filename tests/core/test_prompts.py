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
