"""RolloutEngine on CPU: parity with HF, sampling semantics, scheduling, validation, events."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedModel

from lightning_tlt.core.kv_cache import KVCache
from lightning_tlt.core.runner import ModelRunner
from lightning_tlt.core.sampling import processed_probs, token_logprobs
from lightning_tlt.core.types import SamplingConfig, StepEvent
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19], [3], [20, 21, 22]]


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new: int, eos: list[int] | None) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


def teacher_forced_logprobs(model: PreTrainedModel, prompt: list[int], completion: list[int], cfg: SamplingConfig):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1]  # (N, V) predicting each completion token
    probs = processed_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p)
    return token_logprobs(probs, torch.tensor(completion))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_greedy_matches_hf_generate(arch: str) -> None:
    model = build_model(arch, "tiny", seed=0)
    # an eos that the greedy path emits midway: the 5th greedy token of prompt 0
    free_run = hf_greedy(model, PROMPTS[0], 8, eos=[])
    eos = free_run[4]
    model.generation_config.eos_token_id = eos
    engine = RolloutEngine(model, max_seq_len=48, max_batch_size=2)  # 5 requests, 2 slots: a queue
    out = engine.generate(PROMPTS, SamplingConfig(temperature=0.0, max_new_tokens=16))
    assert len(out) == len(PROMPTS)
    for prompt, completion, reason in zip(PROMPTS, out.completion_ids, out.finish_reasons):
        ref = hf_greedy(model, prompt, 16, eos=[eos])
        assert completion == ref
        assert reason == ("stop" if ref[-1] == eos else "length")
    assert out.completion_ids[0][-1] == eos and len(out.completion_ids[0]) == free_run.index(eos) + 1 <= 5
    assert out.finish_reasons[0] == "stop"
    assert all(lp == 0.0 for row in out.logprobs for lp in row)  # one-hot distribution
    assert out.stats["tokens"] == sum(len(c) for c in out.completion_ids)


def test_num_samples_split_across_slots_copies_prefix(tiny_qwen2: PreTrainedModel) -> None:
    """4 samples per prompt, 3 slots: a prompt's samples are split over admissions (prefix copy)."""
    engine = RolloutEngine(tiny_qwen2, max_seq_len=40, max_batch_size=3)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10, stop_token_ids=[])
    out = engine.generate(PROMPTS[:3], cfg, num_samples=4)
    assert len(out) == 12
    for i, prompt in enumerate(PROMPTS[:3]):
        ref = hf_greedy(tiny_qwen2, prompt, 10, eos=[])
        for g in range(4):
            assert out.prompt_ids[4 * i + g] == prompt
            assert out.completion_ids[4 * i + g] == ref
    assert set(out.finish_reasons) == {"length"}


def test_runner_logits_match_hf_forward(tiny_arch_model: PreTrainedModel) -> None:
    runner = ModelRunner(tiny_arch_model)
    spec = runner.spec
    ids = torch.randint(0, spec.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = tiny_arch_model(ids, output_hidden_states=True)
        cache = KVCache.allocate(spec.num_layers, 4, 32, spec.num_kv_heads, spec.head_dim,
                                 device=torch.device("cpu"), dtype=torch.float32)
        pos = torch.arange(12)[None].expand(3, 12)
        prefill = runner.forward(ids[:, :7], pos[:, :7], cache.k, cache.v, prefill=True, capture_layers=(1, 2))
        step = runner.forward(ids[:, 7:8], pos[:, 7:8], cache.k, cache.v)  # decode, q = 1
        verify = runner.forward(ids[:, 8:], pos[:, 8:], cache.k, cache.v)  # q = 4 over the cache
    torch.testing.assert_close(prefill.logits, ref.logits[:, :7])
    torch.testing.assert_close(step.logits, ref.logits[:, 7:8])
    torch.testing.assert_close(verify.logits, ref.logits[:, 8:])
    torch.testing.assert_close(verify.hidden, ref.hidden_states[-1][:, 8:])
    torch.testing.assert_close(prefill.layer_hidden[1], ref.hidden_states[1][:, :7])
    torch.testing.assert_close(prefill.layer_hidden[2], ref.hidden_states[2][:, :7])


def test_per_row_positions_are_independent(tiny_llama: PreTrainedModel) -> None:
    """Rows at different cache lengths in one decode batch each match their own HF forward."""
    runner = ModelRunner(tiny_llama)
    spec = runner.spec
    seqs = [[4, 5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20]]
    cache = KVCache.allocate(spec.num_layers, 3, 16, spec.num_kv_heads, spec.head_dim,
                             device=torch.device("cpu"), dtype=torch.float32)
    with torch.no_grad():
        for row, s in enumerate(seqs):  # prefill all but the last token of each row into its slot
            scratch = KVCache.allocate(spec.num_layers, 1, len(s) - 1, spec.num_kv_heads, spec.head_dim,
                                       device=torch.device("cpu"), dtype=torch.float32)
            runner.forward(torch.tensor([s[:-1]]), torch.arange(len(s) - 1)[None], scratch.k, scratch.v,
                           prefill=True, logits=False)
            cache.write_prefix(torch.tensor([row]), scratch.k, scratch.v, torch.tensor([0]))
        last = torch.tensor([[s[-1]] for s in seqs])
        pos = torch.tensor([[len(s) - 1] for s in seqs])
        out = runner.forward(last, pos, cache.k, cache.v)
        for row, s in enumerate(seqs):
            ref = tiny_llama(torch.tensor([s])).logits[0, -1]
            torch.testing.assert_close(out.logits[row, 0], ref)


def test_sampled_logprobs_equal_teacher_forced(tiny_qwen2: PreTrainedModel) -> None:
    cfg = SamplingConfig(temperature=0.8, top_k=40, top_p=0.9, max_new_tokens=12, stop_token_ids=[])
    engine = RolloutEngine(tiny_qwen2, max_seq_len=40, max_batch_size=4)
    out = engine.generate(PROMPTS[:3], cfg, num_samples=2, generator=torch.Generator().manual_seed(3))
    for prompt, completion, logprobs in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        ref = teacher_forced_logprobs(tiny_qwen2, prompt, completion, cfg)
        torch.testing.assert_close(torch.tensor(logprobs), ref, atol=1e-4, rtol=1e-4)
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)


def test_top_k_and_top_p_respected(tiny_qwen2: PreTrainedModel) -> None:
    prompt = [7, 8, 9]
    with torch.no_grad():
        logits = tiny_qwen2(torch.tensor([prompt])).logits[0, -1]
    engine = RolloutEngine(tiny_qwen2, max_seq_len=8, max_batch_size=64)
    gen = torch.Generator().manual_seed(0)
    for cfg in (SamplingConfig(temperature=1.5, top_k=3, max_new_tokens=1),
                SamplingConfig(temperature=1.5, top_p=0.3, max_new_tokens=1)):
        allowed = set(processed_probs(logits, cfg.temperature, cfg.top_k, cfg.top_p).nonzero().flatten().tolist())
        out = engine.generate([prompt], cfg, num_samples=400, generator=gen)
        drawn = {c[0] for c in out.completion_ids}
        assert drawn <= allowed
        assert len(drawn) >= min(2, len(allowed))  # sampling, not argmax


def test_a_token_of_probability_zero_is_counted_and_warned(
    tiny_qwen2: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sampler defect made visible: race noise of -0.0 everywhere (what the keyed noise's float32 rounding drew
    at one column in 2**24) turns every column of probability 0 into NaN, which ``argmax`` picks."""
    import lightning_tlt.rollout.steps as steps

    cfg = SamplingConfig(temperature=1.0, top_k=3, max_new_tokens=5, stop_token_ids=[])
    engine = RolloutEngine(tiny_qwen2, max_seq_len=40, max_batch_size=4)
    clean = engine.generate(PROMPTS[:2], cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    assert clean.stats["zero_prob_tokens"] == 0.0  # top-k leaves most columns at 0: none drawn
    monkeypatch.setattr(steps, "row_noise", lambda keys, positions, vocab, purpose=0: torch.full(
        (keys.shape[0], vocab), -0.0))
    with pytest.warns(RuntimeWarning, match=r"had probability 0 under the policy's processed distribution"):
        broken = engine.generate(PROMPTS[:2], cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    zero = sum(lp <= -69.0 for row in broken.logprobs for lp in row)
    assert zero > 0 and broken.stats["zero_prob_tokens"] == zero


def test_first_token_frequencies_match_processed_distribution(tiny_llama: PreTrainedModel) -> None:
    """Chi-square goodness of fit of 2,000 first tokens against the processed distribution."""
    prompt = [30, 31, 32]
    cfg = SamplingConfig(temperature=2.0, top_k=6, max_new_tokens=1)
    with torch.no_grad():
        probs = processed_probs(tiny_llama(torch.tensor([prompt])).logits[0, -1], 2.0, 6)
    engine = RolloutEngine(tiny_llama, max_seq_len=8, max_batch_size=128)
    out = engine.generate([prompt], cfg, num_samples=2000, generator=torch.Generator().manual_seed(5))
    counts = torch.bincount(torch.tensor([c[0] for c in out.completion_ids]), minlength=probs.numel()).float()
    support = probs > 0
    expected = probs[support] * 2000
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert counts[~support].sum() == 0
    assert chi2 < 20.5  # chi-square 0.999 quantile with 5 degrees of freedom


def test_same_seed_same_rollouts(tiny_qwen3: PreTrainedModel) -> None:
    engine = RolloutEngine(tiny_qwen3, max_seq_len=40, max_batch_size=3)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=10)
    a = engine.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(11))
    b = engine.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(11))
    c = engine.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(12))
    assert a.completion_ids == b.completion_ids and a.logprobs == b.logprobs
    assert a.completion_ids != c.completion_ids


def test_in_place_parameter_change_is_seen() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    engine = RolloutEngine(model, max_seq_len=24, max_batch_size=2)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=6, stop_token_ids=[])
    before = engine.generate([[5, 6, 7]], cfg).completion_ids[0]
    assert before == hf_greedy(model, [5, 6, 7], 6, eos=[])
    with torch.no_grad():  # in place, as an optimizer step does: argmax becomes argmin
        model.lm_head.weight.mul_(-1.0)
        model.model.layers[0].mlp.down_proj.weight.add_(0.05)
    after = engine.generate([[5, 6, 7]], cfg).completion_ids[0]
    assert after == hf_greedy(model, [5, 6, 7], 6, eos=[])
    assert after[0] != before[0]


def test_wrapped_model_is_unwrapped(tiny_qwen2: PreTrainedModel) -> None:
    class Wrapper(torch.nn.Module):  # what DDP looks like from outside: the model under .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    engine = RolloutEngine(Wrapper(tiny_qwen2), max_seq_len=24, max_batch_size=2)
    assert engine.is_native and engine.hidden_size == 128 and engine.vocab_size == tiny_qwen2.config.vocab_size
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=5, stop_token_ids=[])
    assert engine.generate([[5, 6, 7]], cfg).completion_ids[0] == hf_greedy(tiny_qwen2, [5, 6, 7], 5, eos=[])


def test_generic_fallback_matches_hf_generate() -> None:
    torch.manual_seed(0)  # test-side seeding of the HF init only; the library never seeds
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                      bos_token_id=0, eos_token_id=0)).eval()
    engine = RolloutEngine(model, max_seq_len=32, max_batch_size=2)
    assert not engine.is_native
    free_run = hf_greedy(model, PROMPTS[0], 6, eos=[])
    eos = free_run[2]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=8, stop_token_ids=[eos])
    out = engine.generate(PROMPTS[:3], cfg)
    for prompt, completion in zip(PROMPTS[:3], out.completion_ids):
        assert completion == hf_greedy(model, prompt, 8, eos=[eos])
    assert out.finish_reasons[0] == "stop" and len(out.completion_ids[0]) == free_run.index(eos) + 1
    sampled = engine.generate(PROMPTS[:2], SamplingConfig(temperature=0.9, top_k=10, max_new_tokens=6,
                                                          stop_token_ids=[]), generator=torch.Generator().manual_seed(0))
    for prompt, completion, lps in zip(PROMPTS[:2], sampled.completion_ids, sampled.logprobs):
        ref = teacher_forced_logprobs(model, prompt, completion, SamplingConfig(temperature=0.9, top_k=10))
        torch.testing.assert_close(torch.tensor(lps), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("prompts", "kwargs", "match"),
    [
        ([[]], {}, "prompt 0 is empty"),
        ([[1, 2], [3] * 30], {}, "prompt 1 has 30 tokens.*max_seq_len=32"),
        ([[1, 999]], {}, "token id 999 outside the vocabulary"),
        ([[1, -1]], {}, "token id -1 outside the vocabulary"),
        ([[1, 2]], {"num_samples": 0}, "num_samples must be >= 1, got 0"),
    ],
)
def test_bad_input_raises(tiny_qwen2: PreTrainedModel, prompts, kwargs, match: str) -> None:
    engine = RolloutEngine(tiny_qwen2, max_seq_len=32, max_batch_size=2)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, SamplingConfig(max_new_tokens=4), **kwargs)


def test_bad_sampling_and_engine_args_raise(tiny_qwen2: PreTrainedModel) -> None:
    with pytest.raises(ValueError, match=r"temperature must be finite and >= 0.*-0.5"):
        SamplingConfig(temperature=-0.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingConfig(top_p=1.5)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="max_seq_len must be >= 2, got 1"):
        RolloutEngine(tiny_qwen2, max_seq_len=1)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1 or None, got 0"):
        RolloutEngine(tiny_qwen2, max_seq_len=8, max_batch_size=0)


def test_step_events(tiny_qwen2: PreTrainedModel) -> None:
    engine = RolloutEngine(tiny_qwen2, max_seq_len=32, max_batch_size=4)
    events: list[StepEvent] = []
    engine.add_listener(events.append)
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=6, stop_token_ids=[])
    prompts = [[5, 6], [7, 8, 9], [10, 11, 12, 13], [14], [15, 16], [17]]  # 6 requests, 4 slots
    engine.generate(prompts, cfg)
    assert events[-1].phase == "done" and sum(e.phase == "done" for e in events) == 1
    decode = [e for e in events if e.phase == "decode"]
    assert sum(e.new_tokens for e in decode) == 6 * 6  # every generated token reported once
    # finish flags reach the host one step late (no sync bubble): each wave ends with one masked step
    assert [e.new_tokens for e in decode] == [4] * 6 + [0] + [2] * 6 + [0]
    assert [e.step for e in events[:-1]] == list(range(1, len(events)))
    prefill = [e for e in events if e.phase == "prefill"]
    assert len(prefill) == 2 and prefill[0].queued_rows == 2 and prefill[1].queued_rows == 0
    assert all(e.num_slots == 4 for e in events)
    actives = [e.active_rows for e in decode]
    assert actives == [4, 4, 4, 4, 4, 0, 2, 2, 2, 2, 2, 2, 0, 0]
    engine.remove_listener(events.append)
    n = len(events)
    engine.generate([[5, 6]], cfg)
    assert len(events) == n


def test_properties(tiny_llama: PreTrainedModel) -> None:
    engine = RolloutEngine(tiny_llama, max_seq_len=16)
    assert engine.model is tiny_llama
    assert engine.num_slots == 16  # the CPU default
    assert engine.device == torch.device("cpu") and engine.dtype == torch.float32
    budget = RolloutEngine(tiny_llama, max_seq_len=16, memory_budget_bytes=10 * 2 * 2 * 16 * 64 * 4)
    assert budget.num_slots == 10  # 2 layers x (K, V) x 16 positions x 1 KV head x 64 dims x 4 bytes


@pytest.mark.slow
def test_compiled_step_matches_eager(tiny_qwen3: PreTrainedModel) -> None:
    """The CUDA default, torch.compile(fullgraph=True) of the model step, traced and run on the CPU:
    plain decode and the speculative verify (k + 1 tokens a row) give the eager engine's tokens."""
    import warnings

    from lightning_tlt.core.types import SpeculativeConfig

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=10, stop_token_ids=[])
    ref = RolloutEngine(tiny_qwen3, max_seq_len=32, max_batch_size=2).generate(prompts, cfg)
    spec = SpeculativeConfig(method="suffix", num_draft_tokens=3, threshold=1, hysteresis_steps=1)
    engine = RolloutEngine(tiny_qwen3, max_seq_len=32, max_batch_size=2, compile=True, speculative=spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.generate(prompts, cfg)
    assert not [w for w in caught if "compile of the decode step failed" in str(w.message)]
    assert engine.compiled  # the compiled forward, never fallen back to the uncompiled one
    assert out.completion_ids == ref.completion_ids
    assert out.stats["spec/steps"] > 0 and out.stats["steps_decode"] > 0


def test_progress_bar_counts_tokens(tiny_qwen2: PreTrainedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    import tqdm.auto

    bars: list[tqdm.auto.tqdm] = []

    class RecordingBar(tqdm.auto.tqdm):  # the real bar, remembered for the assertions
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            bars.append(self)

    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    engine = RolloutEngine(tiny_qwen2, max_seq_len=24, max_batch_size=2, progress=True)
    engine.generate([[5, 6], [7]], SamplingConfig(temperature=0.0, max_new_tokens=5, stop_token_ids=[]))
    assert len(bars) == 1 and bars[0].total == 10 and bars[0].n == 10 and bars[0].unit == "tok"
    RolloutEngine(tiny_qwen2, max_seq_len=24, max_batch_size=2).generate([[5, 6]], SamplingConfig(max_new_tokens=2))
    assert len(bars) == 1  # off by default


def test_triton_attention_backend_matches_hf_generate() -> None:
    """The engine on the GPU's attention path (the Triton kernels, through Triton's CPU interpreter):
    greedy completions equal HF ``generate``'s, as on the SDPA path."""
    from lightning_tlt.core.attention import triton_available

    if not triton_available(torch.device("cpu")):
        pytest.skip("needs Triton's interpreter")
    model = build_model("qwen2", "tiny", seed=0)
    engine = RolloutEngine(model, max_seq_len=40, max_batch_size=2, attention="triton")
    assert engine.attention == "triton"
    out = engine.generate(PROMPTS[:3], SamplingConfig(temperature=0.0, max_new_tokens=10, stop_token_ids=[]))
    for prompt, completion in zip(PROMPTS[:3], out.completion_ids):
        assert completion == hf_greedy(model, prompt, 10, eos=[])
