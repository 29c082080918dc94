"""RolloutEngine(dtype=...): float32 master weights decoded from a copy in bf16, refreshed at every generate."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine
from lightning_tlt.rollout.inference_copy import resolve_dtype

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=12, stop_token_ids=[])


def bf16_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The policy with its parameters cast to bf16 (buffers, RoPE's frequencies among them, as they are)."""
    twin = copy.deepcopy(model)
    for p in twin.parameters():
        p.data = p.data.to(torch.bfloat16)
    return twin


def test_a_float32_policy_decodes_as_its_bf16_cast_and_follows_its_updates() -> None:
    policy = build_model("qwen2", "tiny", seed=0)  # float32, as under bf16-mixed
    engine = RolloutEngine(policy, max_seq_len=32, max_batch_size=4, dtype="bfloat16")
    out = engine.generate(PROMPTS, GREEDY, num_samples=2)
    twin = RolloutEngine(bf16_twin(policy), max_seq_len=32, max_batch_size=4).generate(PROMPTS, GREEDY, num_samples=2)
    assert out.completion_ids == twin.completion_ids and out.logprobs == twin.logprobs
    assert engine.dtype == torch.bfloat16 and engine.inference_copy is not None
    assert all(p.dtype == torch.float32 and p.requires_grad for p in policy.parameters())  # untouched
    params = list(engine.inference_copy.module.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in params)
    assert engine.inference_copy.nbytes * 2 == sum(p.numel() * 4 for p in policy.parameters())
    ptrs = [p.data_ptr() for p in params]
    with torch.no_grad():  # an optimizer step, in place
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = engine.generate(PROMPTS, GREEDY, num_samples=2)
    twin = RolloutEngine(bf16_twin(policy), max_seq_len=32, max_batch_size=4).generate(PROMPTS, GREEDY, num_samples=2)
    assert after.completion_ids == twin.completion_ids and after.completion_ids != out.completion_ids
    assert [p.data_ptr() for p in engine.inference_copy.module.parameters()] == ptrs  # captured graphs stay valid


def test_an_eagle_drafter_drafts_against_the_copy_as_on_a_bf16_policy() -> None:
    """The co-trained drafter (float32, sharing the float32 policy's embedding and head) drafts in the
    engine's bf16 against the copy: the same tokens, step for step, as an engine over a bf16 policy
    with the same drafter weights (bf16 verify and decode logits differ in the last bit, so greedy
    speculation is compared with greedy speculation, not with plain decoding)."""
    policy = build_model("llama", "tiny", seed=0)
    config = SpeculativeConfig(method="eagle", num_draft_tokens=3, threshold=4, hysteresis_steps=1)
    engine = RolloutEngine(policy, max_seq_len=40, max_batch_size=4, speculative=config, dtype=torch.bfloat16)
    trained = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0))  # float32, trains
    assert engine.set_drafter(trained)
    assert engine.drafter.fc.weight.dtype == torch.bfloat16  # drafts in the engine's dtype
    twin_policy = bf16_twin(policy)
    twin = RolloutEngine(twin_policy, max_seq_len=40, max_batch_size=4, speculative=config)
    twin_drafter = EagleDrafter.from_target(twin_policy)
    twin_drafter.load_state_dict(trained.state_dict())
    assert twin.set_drafter(twin_drafter)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=16, stop_token_ids=[])
    out = engine.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(3))
    ref = twin.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(3))
    assert out.completion_ids == ref.completion_ids and out.logprobs == ref.logprobs
    assert out.stats["spec/steps"] > 0


def test_dtype_of_the_policy_reads_it_in_place_and_bad_names_are_refused() -> None:
    policy = build_model("qwen2", "tiny", seed=0)
    assert RolloutEngine(policy, max_seq_len=16, dtype="float32").inference_copy is None
    assert resolve_dtype("float16") == torch.float16 and resolve_dtype(None) is None
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\].*'int8'"):
        RolloutEngine(policy, max_seq_len=16, dtype="int8")
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype(torch.int64)
