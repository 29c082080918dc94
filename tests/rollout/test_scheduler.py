"""Continuous batching keeps every completion with its own request.

A toy policy whose next token is a function of the current token only (``t -> t + 1``, or
``t + 1`` / ``t + 2`` with equal probability) makes ownership checkable: a completion must start
just after its prompt's last token and climb from there to a stop token, so rows of very different
lengths, more requests than slots and several samples per prompt exercise every release order of
the scheduler (several rows finishing in one step, harvested one step late, slots reused).
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedModel

from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine
from lightning_tlt.rollout.scheduler import Request, SlotScheduler

STOPS = [50, 51, 100, 101]
"""Two lanes, ``(..., 51]`` and ``(51, 101]``, each ending in two stops in a row (a chain climbing by 1 or 2
cannot step over both): prompts of different lanes give completions of the same length."""


def lane_stops(last: int) -> list[int]:
    return STOPS[:2] if last < 50 else STOPS[2:]


def counting_policy(steps: tuple[int, ...] = (1,)) -> PreTrainedModel:
    """A tiny Llama whose next-token distribution is uniform over ``t + s`` for ``s`` in ``steps``.

    Every layer's output projections are zero (the residual stream stays the token's embedding), the
    embedding is the identity and the LM head maps token ``t`` to ``t + s``.
    """
    model = build_model("llama", "tiny", seed=0)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    assert hidden >= vocab
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif name.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        head = model.lm_head.weight
        head.fill_(0.0)
        for s in steps:
            head[(torch.arange(vocab) + s) % vocab, torch.arange(vocab)] = 2.0  # x 11.3 (RMSNorm of a one-hot)
    return model


def test_release_returns_requests_in_the_callers_order() -> None:
    reqs = [Request(i, i, (i,)) for i in range(6)]
    sched = SlotScheduler(4, reqs)
    sched.admit()
    done, moves = sched.release([3, 0])
    assert [r.index for r in done] == [3, 0]  # aligned with the slots asked for, whatever their order
    assert moves == [(2, 0)]
    assert [r.index for r in sched.active] == [2, 1]
    assert [(s, r.index) for s, r in sched.admit()] == [(2, 4), (3, 5)]
    with pytest.raises(ValueError, match="slots"):
        sched.release([1, 1])


@pytest.mark.parametrize(
    ("lasts", "num_samples", "slots"),
    [
        # slot 0 ends a step before slots 1 and 3 (harvested one step late, slot 3 moves into slot 0): the
        # second harvest asks for slots [1, 0]
        ([99, 98, 95, 48], 1, 4),
        ([99, 70, 94, 47, 90, 98, 35, 46, 44, 80, 43, 49], 2, 3),
        ([99, 70, 94, 47, 90, 98, 35, 46, 44, 80, 43, 49], 2, 5),
        ([99, 70, 94, 47, 90, 98, 35, 46, 44, 80, 43, 49], 3, 4),
    ],
)
def test_greedy_completions_stay_with_their_requests(lasts: list[int], num_samples: int, slots: int) -> None:
    """Lengths 1 to 16, fewer slots than rows: each completion is exactly its own prompt's chain."""
    model = counting_policy()
    prompts = [[5, last] for last in lasts]
    engine = RolloutEngine(model, max_seq_len=48, max_batch_size=slots)
    out = engine.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=40, stop_token_ids=STOPS),
                          num_samples=num_samples)
    for i, completion in enumerate(out.completion_ids):
        last = lasts[i // num_samples]
        assert out.prompt_ids[i] == prompts[i // num_samples]
        assert completion == list(range(last + 1, lane_stops(last)[0] + 1)), (i, last, completion)


@pytest.mark.parametrize(("slots", "seed"), [(3, 0), (3, 1), (4, 0), (4, 1), (5, 2)])
def test_sampled_completions_stay_with_their_requests(slots: int, seed: int) -> None:
    """Random lengths (steps of 1 or 2), 3 samples per prompt: every row is a chain from its own prompt
    (the prompts' last tokens are 3 apart, so a row's first token tells which prompt it continues)."""
    model = counting_policy((1, 2))
    lasts = [97, 70, 94, 47, 88, 91, 44, 76, 82, 41, 85, 79, 35, 38]
    prompts = [[5, last] for last in lasts]
    engine = RolloutEngine(model, max_seq_len=48, max_batch_size=slots)
    out = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=40, stop_token_ids=STOPS),
                          num_samples=3, generator=torch.Generator().manual_seed(seed))
    lengths = set()
    for i, completion in enumerate(out.completion_ids):
        chain = [lasts[i // 3], *completion]
        assert all(b - a in (1, 2) for a, b in zip(chain, chain[1:])), (i, chain)
        assert completion[-1] in lane_stops(chain[0]) and not set(completion[:-1]) & set(STOPS)
        lengths.add(len(completion))
    assert len(lengths) > 5  # the rows really had very different lengths


@pytest.mark.parametrize("method", ["suffix", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_steps_keep_completions_with_their_requests(method: str, temperature: float) -> None:
    """The same with speculation: rows advance by 1 to k + 1 tokens a step, so they finish in more orders."""
    from lightning_tlt.core.types import SpeculativeConfig
    from lightning_tlt.drafters.eagle import EagleDrafter

    model = counting_policy((1,) if temperature == 0.0 else (1, 2))
    lasts = [97, 70, 94, 47, 88, 91, 44, 76, 82, 41, 85, 79, 35, 38]
    prompts = [[5, last] for last in lasts]
    spec = SpeculativeConfig(method=method, num_draft_tokens=3, threshold=4, hysteresis_steps=1,  # type: ignore[arg-type]
                             draft_vocab_size=None)
    engine = RolloutEngine(model, max_seq_len=48, max_batch_size=4, speculative=spec)
    if method == "eagle":
        engine.drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    out = engine.generate(prompts, SamplingConfig(temperature=temperature, max_new_tokens=40, stop_token_ids=STOPS),
                          num_samples=3, generator=torch.Generator().manual_seed(1))
    assert engine.last_stats["spec/steps"] > 0
    for i, completion in enumerate(out.completion_ids):
        chain = [lasts[i // 3], *completion]
        if temperature == 0.0:
            assert completion == list(range(chain[0] + 1, lane_stops(chain[0])[0] + 1)), (i, chain)
        assert all(b - a in (1, 2) for a, b in zip(chain, chain[1:])), (i, chain)
        assert completion[-1] in lane_stops(chain[0]) and not set(completion[:-1]) & set(STOPS)
