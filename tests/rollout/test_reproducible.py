"""Reproducible rollouts: a row's tokens depend on the seed, its prompt and its sample index only.

The engine's noise is keyed (`lightning_tlt.core.sampling.row_keys`), so the number of slots, which
rows share a step, the order the prompts are given in and (with coupled verification) whether and how
the engine speculates change nothing a row draws.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from lightning_tlt.core.types import RolloutOutput, SamplingConfig, SpeculativeConfig
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [20, 21, 22], [9, 10]]
SAMPLED = SamplingConfig(temperature=1.0, top_k=50, top_p=0.95, max_new_tokens=24, stop_token_ids=[7, 30])


def by_prompt(out: RolloutOutput, order: list[int], num_samples: int) -> dict[tuple[int, int], tuple[list[int], ...]]:
    """Completions and logprobs keyed by (position in the original prompt list, sample index)."""
    rows = {}
    for i, (completion, logprobs) in enumerate(zip(out.completion_ids, out.logprobs)):
        rows[(order[i // num_samples], i % num_samples)] = (completion, logprobs)
    return rows


@pytest.fixture(scope="module")
def policy() -> PreTrainedModel:
    return build_model("qwen2", "tiny", seed=0)


def test_rollouts_do_not_depend_on_slots_or_prompt_order(policy: PreTrainedModel) -> None:
    """Slots 1, 4 and 16, the prompts in two orders: the same tokens row for row (and logprobs to rounding)."""
    ref = RolloutEngine(policy, max_seq_len=48, max_batch_size=16).generate(
        PROMPTS, SAMPLED, num_samples=3, generator=torch.Generator().manual_seed(5)
    )
    want = by_prompt(ref, list(range(len(PROMPTS))), 3)
    lengths = {len(c) for c in ref.completion_ids}
    assert len(lengths) > 3  # rows of different lengths: slots were freed and reused
    assert ref.completion_ids[3:6] != ref.completion_ids[15:18]  # a prompt given twice: independent rollouts
    order = [3, 0, 5, 2, 4, 1]
    for slots in (1, 4):
        engine = RolloutEngine(policy, max_seq_len=48, max_batch_size=slots)
        for perm in (list(range(len(PROMPTS))), order):
            out = engine.generate([PROMPTS[p] for p in perm], SAMPLED, num_samples=3,
                                  generator=torch.Generator().manual_seed(5))
            got = by_prompt(out, perm, 3)
            if perm == order:  # the two copies of a repeated prompt swap with their occurrence order
                got[(1, 0)], got[(5, 0)] = got[(5, 0)], got[(1, 0)]
                got[(1, 1)], got[(5, 1)] = got[(5, 1)], got[(1, 1)]
                got[(1, 2)], got[(5, 2)] = got[(5, 2)], got[(1, 2)]
            assert {r: c for r, (c, _) in got.items()} == {r: c for r, (c, _) in want.items()}, (slots, perm)
            for r, (_, logprobs) in got.items():  # a batched matmul's rounding depends on the batch
                torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want[r][1]), atol=1e-5, rtol=0)
    other = RolloutEngine(policy, max_seq_len=48, max_batch_size=16).generate(
        PROMPTS, SAMPLED, num_samples=3, generator=torch.Generator().manual_seed(6)
    )
    assert other.completion_ids != ref.completion_ids


def test_fallback_path_draws_the_same_numbers_in_any_wave() -> None:
    torch.manual_seed(0)  # test-side seeding of the HF init only; the library never seeds
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0)).eval()
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10, stop_token_ids=[3])
    outs = [
        RolloutEngine(model, max_seq_len=32, max_batch_size=slots).generate(
            PROMPTS[:4], cfg, num_samples=2, generator=torch.Generator().manual_seed(1)
        )
        for slots in (1, 3, 8)
    ]
    assert not outs[0].stats.get("graphs_captures")
    assert outs[0].completion_ids == outs[1].completion_ids == outs[2].completion_ids


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(("method", "k"), [("suffix", 2), ("suffix", 5), ("eagle", 3), ("eagle", None)])
def test_coupled_speculation_gives_plain_decodings_tokens(
    warm_arithmetic_policy: tuple[PreTrainedModel, object], method: str, k: int | None, temperature: float
) -> None:
    """Float32 on the CPU, the same seed: speculation on (coupled) and off give the same rollouts, token
    for token, for the suffix and the EAGLE drafter, a fixed k or the tuner's, greedy and T = 1."""
    policy, tokenizer = warm_arithmetic_policy
    prompts = [tokenizer.encode(q) for q in ("12+7=", "3*4=", "100-37=", "8+8=")]
    cfg = SamplingConfig(temperature=temperature, max_new_tokens=20, stop_token_ids=[])
    plain = RolloutEngine(policy, max_seq_len=64, max_batch_size=5).generate(
        prompts, cfg, num_samples=3, generator=torch.Generator().manual_seed(9)
    )
    spec = SpeculativeConfig(method=method, num_draft_tokens=k, threshold=8, hysteresis_steps=1,  # type: ignore[arg-type]
                             verification="coupled", draft_vocab_size=None)
    engine = RolloutEngine(policy, max_seq_len=64, max_batch_size=5, speculative=spec)
    if engine.tuner is not None:
        engine.tuner.cost_model = lambda arm, rows: 1e-3 * (1 + 0.1 * arm)
    if method == "eagle":  # an untrained drafter: what it proposes must change nothing
        engine.drafter = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0)).inference_copy()
    out = engine.generate(prompts, cfg, num_samples=3, generator=torch.Generator().manual_seed(9))
    assert engine.last_stats["spec/steps"] > 0
    if method == "suffix":  # sibling rollouts: drafts that were accepted, so accepted paths were compared too
        assert engine.last_stats["spec/acceptance_length"] > 1.0
    assert out.completion_ids == plain.completion_ids
    for a, b in zip(out.logprobs, plain.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-4, rtol=0)


def test_rejection_verification_stays_the_default() -> None:
    """Rejection sampling draws other numbers than plain decoding (its own acceptance uniforms), so only
    coupled verification promises plain decoding's tokens; both are lossless (tests/rollout/test_verify.py)."""
    assert SpeculativeConfig(method="suffix").verification == "rejection"
    with pytest.raises(ValueError, match="verification"):
        SpeculativeConfig(method="suffix", verification="maximal")  # type: ignore[arg-type]


@pytest.mark.parametrize("coupled", [False, True])
def test_the_draft_sample_compiles_with_inductor_and_draws_what_eager_draws(coupled: bool) -> None:
    # found on 2026-12-05: with the noise stream an int argument, Dynamo made it a symbolic size under
    # dynamic=True and Inductor's CPU vectorizer typed the hash mixing it as float (a C++ compile error);
    # the engine then ran every step uncompiled. The stream is chosen by a bool now, which Dynamo specialises
    from lightning_tlt.rollout.steps import SamplingKey, compile_settings, draft_sample

    torch._dynamo.reset()
    compiled = torch.compile(draft_sample, fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(0)
    feature, head = torch.randn(4, 32, generator=gen), torch.randn(64, 32, generator=gen)
    keys, positions, ids = torch.arange(4) * 7919 + 5, torch.arange(4), torch.randperm(64, generator=gen)
    key = SamplingKey(1.0, 0, 1.0)
    with compile_settings():
        for columns in (ids, None):
            index, q = compiled(feature, head, None, keys, positions, coupled, columns, key)
            want_index, want_q = draft_sample(feature, head, None, keys, positions, coupled, columns, key)
            assert torch.equal(index, want_index) and torch.allclose(q, want_q)


def test_the_engines_cold_eagle_drafter_is_the_same_whatever_the_global_rng_holds(policy: PreTrainedModel) -> None:
    """A restart, or a second process, must propose what the first did: the cold drafter's initialisation
    is seeded, not drawn from the global RNG (whose state each process starts from differently)."""
    spec = SpeculativeConfig(method="eagle", threshold=8, num_draft_tokens=3, draft_vocab_size=None)
    drafters = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        drafters.append(RolloutEngine(policy, max_seq_len=32, max_batch_size=2, speculative=spec)._drafter)
    first, second = (dict(d.named_parameters()) for d in drafters)
    assert first.keys() == second.keys() and first
    for name, param in first.items():
        assert torch.equal(param, second[name]), name
    # and with the rejection verifier's default, the same tokens from two engines under other global seeds
    prompts, cfg = [[5, 6, 7], [8, 9]], SamplingConfig(temperature=1.0, max_new_tokens=12, stop_token_ids=[])
    outs = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        engine = RolloutEngine(policy, max_seq_len=32, max_batch_size=2, speculative=spec)
        outs.append(engine.generate(prompts, cfg, generator=torch.Generator().manual_seed(0)).completion_ids)
    assert outs[0] == outs[1]
