"""FeatureReplayBuffer.place: where the features go is said before the first add, and never changed after."""

from __future__ import annotations

import pytest
import torch

from lightning_tlt.drafters.buffer import FeatureReplayBuffer


def test_place_sets_the_storage_before_the_first_add_only() -> None:
    buffer = FeatureReplayBuffer(capacity_tokens=64)
    buffer.place("cpu", torch.bfloat16)
    ones = torch.ones(1, 6, dtype=torch.long)
    completion = torch.tensor([[0, 0, 1, 1, 1, 1]])
    assert buffer.add(torch.randn(1, 6, 8), torch.arange(6)[None], ones, completion, step=0) == 1
    assert buffer.features is not None and buffer.features.dtype == torch.bfloat16 and buffer.device == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"allocated already \(on cpu\); place it before the first add"):
        buffer.place("cpu", torch.float32)
    assert buffer.features.dtype == torch.bfloat16
