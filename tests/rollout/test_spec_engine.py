"""Speculation inside RolloutEngine: greedy equality, KV consistency, losslessness by chi-square."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from lightning_tlt.core.sampling import processed_probs, sample, token_logprobs
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig, StepEvent
from lightning_tlt.drafters.base import DraftProposal
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [3], [20, 21, 22]]


def spec(method: str, k: int | None = 4, threshold: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_draft_tokens=k, threshold=threshold, hysteresis_steps=1)


class PolicyDrafter:
    """A host-side drafter that samples from the policy itself (q = p): every draft is accepted."""

    name = "policy"
    needs_features = False

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state_dict: object) -> None:
        return None

    @torch.no_grad()
    def draft(self, contexts, k, sampling: SamplingConfig, generator, device) -> DraftProposal:
        rows = [list(c) for c in contexts]
        tokens = torch.zeros(len(rows), k, dtype=torch.long)
        probs = torch.zeros(len(rows), k, self.model.config.vocab_size)
        for j in range(k):
            for length in sorted({len(r) for r in rows}):  # batch rows of equal length
                idx = [i for i, r in enumerate(rows) if len(r) == length]
                logits = self.model(torch.tensor([rows[i] for i in idx])).logits[:, -1]
                q = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
                d = sample(q, generator)
                for row, i in enumerate(idx):
                    tokens[i, j] = d[row]
                    probs[i, j] = q[row]
            for i, r in enumerate(rows):
                r.append(int(tokens[i, j]))
        return DraftProposal(tokens=tokens.to(device), probs=probs.to(device), lens=torch.full((len(rows),), k))


@pytest.mark.parametrize("method", ["suffix", "eagle"])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_speculation_equals_greedy_plain(method: str, arch: str) -> None:
    model = build_model(arch, "tiny", seed=0)
    free = RolloutEngine(model, max_seq_len=48, max_batch_size=3).generate(
        PROMPTS[:1], SamplingConfig(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    )
    eos = free.completion_ids[0][7]  # fires mid-way for prompt 0 (and maybe others)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=24, stop_token_ids=[eos])
    plain = RolloutEngine(model, max_seq_len=48, max_batch_size=3).generate(PROMPTS, cfg, num_samples=2)
    engine = RolloutEngine(model, max_seq_len=48, max_batch_size=3, speculative=spec(method, threshold=3))
    out = engine.generate(PROMPTS, cfg, num_samples=2)
    assert out.completion_ids == plain.completion_ids
    assert out.finish_reasons == plain.finish_reasons
    assert "stop" in out.finish_reasons
    assert out.stats["spec/speculative_step_share"] == 1.0
    assert out.stats["spec/steps"] == out.stats["steps_speculative"] > 0
    assert out.stats["tokens"] == sum(len(c) for c in out.completion_ids)


def test_suffix_accepts_on_repetitive_greedy_text() -> None:
    """A random tiny model's greedy output falls into a cycle: the suffix drafter rides it."""
    model = build_model("qwen2", "tiny", seed=0)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=48, stop_token_ids=[])
    engine = RolloutEngine(model, max_seq_len=64, max_batch_size=4, speculative=spec("suffix", k=6))
    out = engine.generate([[5, 6, 7, 8]], cfg, num_samples=2)
    plain = RolloutEngine(model, max_seq_len=64, max_batch_size=4).generate([[5, 6, 7, 8]], cfg, num_samples=2)
    assert out.completion_ids == plain.completion_ids
    emitted_per_step = out.stats["tokens"] / out.stats["spec/steps"]
    assert emitted_per_step >= 3.0  # 2+ accepted drafts a step on average (plus the bonus token)


@pytest.mark.parametrize("method", ["suffix", "eagle", "policy"])
def test_kv_consistent_after_mixed_accept_lengths(method: str) -> None:
    """Sampled logprobs (from verify forwards over a KV cache grown by varying accept lengths)
    equal teacher-forced logprobs of the same tokens under a fresh HF forward."""
    model = build_model("llama", "tiny", seed=0)
    cfg = SamplingConfig(temperature=1.0, top_k=20, max_new_tokens=20, stop_token_ids=[])
    engine = RolloutEngine(model, max_seq_len=40, max_batch_size=4, speculative=spec("suffix", k=3))
    if method == "eagle":
        engine.drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    elif method == "policy":
        engine.drafter = PolicyDrafter(model)
    out = engine.generate(PROMPTS[:3], cfg, num_samples=2, generator=torch.Generator().manual_seed(1))
    accepted = [v for key, v in out.stats.items() if key.startswith("spec/acceptance_rate_pos")]
    assert accepted, out.stats
    for prompt, completion, logprobs in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        assert len(completion) == 20
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        ref = token_logprobs(processed_probs(logits, 1.0, 20), torch.tensor(completion))
        torch.testing.assert_close(torch.tensor(logprobs), ref, atol=1e-4, rtol=1e-4)
    if method == "policy":  # q = p: every draft accepted
        assert all(v == 1.0 for v in accepted)


def test_speculative_step_events_and_gate(tiny_qwen2: PreTrainedModel) -> None:
    """Plain decode above the threshold, speculative below it (hysteresis 2), events say which."""
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10, stop_token_ids=[])
    config = SpeculativeConfig(method="suffix", num_draft_tokens=3, threshold=2, hysteresis_steps=2)
    engine = RolloutEngine(tiny_qwen2, max_seq_len=32, max_batch_size=4, speculative=config)
    events: list[StepEvent] = []
    engine.add_listener(events.append)
    prompts = [[5, 6], [7, 8, 9], [10, 11, 12, 13], [14], [15, 16], [17]]  # 6 rows, 4 slots
    out = engine.generate(prompts, cfg)
    plain = RolloutEngine(tiny_qwen2, max_seq_len=32, max_batch_size=4).generate(prompts, cfg)
    assert out.completion_ids == plain.completion_ids
    phases = [e.phase for e in events]
    assert phases[-1] == "done" and "speculative" in phases and "decode" in phases
    assert {e.draft_tokens for e in events if e.phase == "speculative"} == {3}  # each step says its k
    assert {e.draft_tokens for e in events if e.phase != "speculative"} == {0}
    first_spec = phases.index("speculative")
    assert all(e.active_rows <= 4 for e in events)
    decode_before = [e for e in events[:first_spec] if e.phase == "decode"]
    assert decode_before and decode_before[0].active_rows == 4  # 4 rows: above the threshold, plain
    assert sum(e.new_tokens for e in events) == 60
    assert 0.0 < out.stats["spec/speculative_step_share"] < 1.0


def test_tuner_chooses_among_candidates(tiny_qwen2: PreTrainedModel) -> None:
    # every arm explored: without the acceptance bound (on the CPU clock, k = 2 of this suffix drafter
    # can measure slow enough to rule k = 4 out, which the tuner's own tests cover)
    config = SpeculativeConfig(method="suffix", num_draft_tokens=None, draft_candidates=(2, 4), threshold=4,
                               hysteresis_steps=1, tuner_epsilon=0.5, tuner_prune_margin=None)
    engine = RolloutEngine(tiny_qwen2, max_seq_len=48, max_batch_size=4, speculative=config)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30, stop_token_ids=[])
    out = engine.generate(PROMPTS[:2], cfg, num_samples=2)
    plain = RolloutEngine(tiny_qwen2, max_seq_len=48, max_batch_size=4).generate(PROMPTS[:2], cfg, num_samples=2)
    assert out.completion_ids == plain.completion_ids
    arms = {key for key in out.stats if key.startswith("tuner/")}
    assert {key.split("_")[1] for key in arms} == {"k0", "k2", "k4"}  # every arm measured, plain included
    tuner = engine.tuner
    state = tuner.state_dict()
    engine.drafter = EagleDrafter.from_target(tiny_qwen2).inference_copy()  # new buffers, same tuner
    engine.generate(PROMPTS[:1], cfg)
    assert engine.tuner is tuner and sum(tuner.state_dict()["counts"].values()) > sum(state["counts"].values())
    assert RolloutEngine(tiny_qwen2, max_seq_len=8).tuner is None  # no speculation, no tuner


def test_eagle3_drafter_in_the_engine() -> None:
    """An EAGLE-3 drafter (features of three layers, fused) drafts inside the engine: greedy stays
    greedy, sampled logprobs stay the policy's, and the kept features are 3H wide."""
    model = build_model("qwen3", "tiny", seed=0)
    engine = RolloutEngine(model, max_seq_len=40, max_batch_size=4, speculative=spec("eagle", k=3))
    engine.drafter = EagleDrafter.from_target(
        model, feature_layers=(0, 1, 2), generator=torch.Generator().manual_seed(0)
    ).inference_copy()
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=16, stop_token_ids=[])
    out = engine.generate(PROMPTS[:3], greedy, num_samples=2)
    plain = RolloutEngine(model, max_seq_len=40, max_batch_size=4).generate(PROMPTS[:3], greedy, num_samples=2)
    assert out.completion_ids == plain.completion_ids
    assert engine.slot_state.hidden.shape[1] == 3 * model.config.hidden_size
    assert out.stats["spec/steps"] > 0
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=12, stop_token_ids=[])
    sampled = engine.generate(PROMPTS[:2], cfg, num_samples=2, generator=torch.Generator().manual_seed(2))
    for prompt, completion, logprobs in zip(sampled.prompt_ids, sampled.completion_ids, sampled.logprobs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
        ref = token_logprobs(processed_probs(logits, 1.0), torch.tensor(completion))
        torch.testing.assert_close(torch.tensor(logprobs), ref, atol=1e-4, rtol=1e-4)
    engine.drafter = EagleDrafter.from_target(model).inference_copy()  # back to EAGLE-1: buffers follow
    assert engine.generate(PROMPTS[:3], greedy, num_samples=2).completion_ids == plain.completion_ids
    assert engine.slot_state.hidden.shape[1] == model.config.hidden_size


def test_eagle_features_follow_the_alignment_convention() -> None:
    """The features the engine keeps per slot are the policy's: after generation each slot's
    feature equals HF's last hidden state at the position before the pending token."""
    model = build_model("llama", "tiny", seed=0)
    engine = RolloutEngine(model, max_seq_len=32, max_batch_size=2, speculative=spec("eagle", k=2, threshold=2))
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=20, stop_token_ids=[])
    prompt = [4, 5, 6, 7]
    engine.generate([prompt], cfg)
    completion = engine.generate([prompt], cfg).completion_ids[0]
    st = engine.slot_state
    # the finished row keeps its last pending token and the feature that predicted it
    seq = prompt + completion
    with torch.no_grad():
        ref = model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
    position = int(st.positions[0])
    assert int(st.tokens[0]) == seq[position]
    torch.testing.assert_close(st.hidden[0], ref[position - 1], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# losslessness: the distribution of whole short sequences against the policy's exact one


def tiny_vocab_model(vocab: int = 10) -> PreTrainedModel:
    config = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # test-side, forked: the library never seeds
        model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)  # uneven distributions: drafts get rejected, ~70 cells get counts
    return model


def exact_sequence_probs(model: PreTrainedModel, prompt: list[int], length: int, cfg: SamplingConfig):
    """p(x_1..x_n | prompt) under the processed distribution, for every sequence (enumerated)."""
    vocab = model.config.vocab_size
    probs = {(): 1.0}
    for _ in range(length):
        prefixes = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1]
        step = processed_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
        probs = {p + (t,): probs[p] * float(step[i, t]) for i, p in enumerate(prefixes) for t in range(vocab)
                 if step[i, t] > 0}
    return probs


def chi_square_quantile(df: int, z: float = 3.0902) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.09: significance 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def speculative_chi_square(
    method: str, samples: int = 4000, top_p: float = 1.0, draft_vocab_size: int | None = None
) -> tuple[float, int, dict[str, float]]:
    """Chi-square statistic of ``samples`` speculative 3-token rollouts against the exact distribution.

    256 slots for 4,000 samples: rows are admitted in waves while the engine speculates.
    """
    model = tiny_vocab_model()
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]  # repetitive: the suffix drafter proposes, and is often wrong
    cfg = SamplingConfig(temperature=1.0, top_k=6, top_p=top_p, max_new_tokens=3, stop_token_ids=[])
    exact = exact_sequence_probs(model, prompt, 3, cfg)
    engine = RolloutEngine(model, max_seq_len=16, max_batch_size=256,
                           speculative=SpeculativeConfig(method="suffix" if method == "suffix" else "eagle",
                                                         num_draft_tokens=3, threshold=256, hysteresis_steps=1,
                                                         draft_vocab_size=draft_vocab_size))
    if method in ("eagle", "nan"):  # an untrained drafter: many rejections
        engine.drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
        if method == "nan":  # a diverged drafter (bypassing set_drafter's refusal): its q is NaN everywhere
            with torch.no_grad():
                engine.drafter.fc.weight.fill_(float("nan"))
    elif method == "policy":
        engine.drafter = PolicyDrafter(model)
    out = engine.generate([prompt], cfg, num_samples=samples, generator=torch.Generator().manual_seed(0))
    counts = Counter(tuple(c) for c in out.completion_ids)
    assert set(counts) <= set(exact)  # never a sequence the policy cannot produce (top-k respected)
    # cells with expected count >= 5; the rest pooled into one cell
    big = [c for c in sorted(exact, key=exact.get, reverse=True) if exact[c] * samples >= 5]
    observed = [counts.get(c, 0) for c in big]
    expected = [exact[c] * samples for c in big]
    if samples - sum(expected) >= 5:
        observed.append(samples - sum(observed))
        expected.append(samples - sum(expected))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return chi2, len(expected) - 1, out.stats


@pytest.mark.parametrize("method", ["eagle", "policy", "suffix"])
def test_speculative_sampling_is_lossless_chi_square(method: str) -> None:
    chi2, df, stats = speculative_chi_square(method)
    assert df >= 50
    assert chi2 < chi_square_quantile(df), (chi2, df)
    rates = [v for key, v in stats.items() if key.startswith("spec/acceptance_rate_pos")]
    if method == "policy":
        assert all(v == 1.0 for v in rates)
    elif method == "eagle":
        assert stats["spec/acceptance_rate_pos0"] < 0.9  # rejections were exercised
    else:
        assert stats["spec/steps"] > 0


def test_chi_square_detects_a_lossy_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: sampling the correction from p instead of the residual (p - q)+ is caught."""
    import lightning_tlt.rollout.verify as verify

    monkeypatch.setattr(verify, "residual_probs", lambda p, q: p)
    chi2, df, _ = speculative_chi_square("eagle")
    assert chi2 > 2 * chi_square_quantile(df), (chi2, df)
