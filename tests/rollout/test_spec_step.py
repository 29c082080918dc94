"""The rebuilt speculative step: one slot state, never lossy, never slower than plain, safe drafter swaps.

Tiny models on the CPU, seeded. The losslessness tests count whole sampled sequences against the
policy's exact distribution (chi-square, see ``test_spec_engine.py``); the tuner tests inject a
deterministic cost model so that "which arm is faster" is a fact of the test, not of the machine.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_cuda_graphs import Replayable
from test_spec_engine import PolicyDrafter, chi_square_quantile, speculative_chi_square, tiny_vocab_model
from transformers import PreTrainedModel

from lightning_tlt.core import stored_compile
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig, StepEvent
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.suffix import SuffixDrafter
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.cuda_graphs import CUDAGraphProfileCache, GraphProfile
from lightning_tlt.rollout.engine import RolloutEngine
from lightning_tlt.rollout.steps import SamplingKey

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=14, stop_token_ids=[])


def eagle_engine(model: PreTrainedModel, slots: int, **spec: object) -> RolloutEngine:
    config = SpeculativeConfig(**{"method": "eagle", "num_draft_tokens": 3, "threshold": slots,
                                  "hysteresis_steps": 1, **spec})  # type: ignore[arg-type]
    engine = RolloutEngine(model, max_seq_len=48, max_batch_size=slots, speculative=config)
    engine.drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    return engine


# ------------------------------------------------------------------------- one slot state
def test_rows_admitted_while_speculating_start_their_own_history() -> None:
    """A request admitted into a slot while the engine speculates inherits nothing of the slot's previous
    request: its drafter history is its own prompt (run through the drafter at prefill), and its
    speculation (drafts, acceptance) is exactly that of the same request in a fresh engine."""
    model = build_model("llama", "tiny", seed=0)
    first, second = [4, 5, 6, 7, 8, 9], [20, 21, 22, 23]
    seen: dict[str, object] = {}
    engine = eagle_engine(model, slots=1)
    drafter = engine.drafter

    def at_prefill(event: StepEvent) -> None:
        st = engine.slot_state
        assert st is not None and st.spec is not None and st.spec.dcache is not None
        if event.phase == "prefill" and event.step > 1:  # the second request, admitted mid-call
            seen.update(prefix_end=int(st.spec.prefix_end[0]), start=int(st.spec.draft_start[0]),
                        fresh=bool(st.spec.cu_fresh[0]), keys=st.spec.dcache.k[0][0, : len(second) - 1].clone())

    engine.add_listener(at_prefill)
    both = engine.generate([first, second], GREEDY)
    assert both.stats["spec/speculative_step_share"] == 1.0  # every decode step of the call speculated
    assert seen["prefix_end"] == seen["start"] == len(second) - 2 and seen["fresh"] is False
    # its drafter cache holds its own prompt: the drafter over (h_t, x_{t+1}) at positions 0..P-2
    with torch.no_grad():
        hidden = model(torch.tensor([second]), output_hidden_states=True).hidden_states[-1]
        x = drafter.input_hidden(hidden[:, :-1], torch.tensor([second[1:]]))
        layer = drafter.layer.self_attn
        keys = layer.k_proj(x).view(1, len(second) - 1, drafter.num_kv_heads, drafter.head_dim)
    from lightning_tlt.core.runner import apply_rope, rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(len(second) - 1)[None], drafter.inv_freq, drafter.rope_scaling, keys.dtype)
    torch.testing.assert_close(seen["keys"], apply_rope(keys, cos, sin)[0], atol=1e-5, rtol=1e-5)
    # the second request's speculation equals a fresh engine's: counters(first, second) - counters(first)
    alone_first = eagle_engine(model, slots=1)
    alone_first.drafter = drafter
    alone_first.generate([first], GREEDY)
    counters_first = alone_first.slot_state.counters.clone()
    alone_second = eagle_engine(model, slots=1)
    alone_second.drafter = drafter
    out = alone_second.generate([second], GREEDY)
    torch.testing.assert_close(engine.slot_state.counters - counters_first, alone_second.slot_state.counters)
    assert both.completion_ids[1] == out.completion_ids[0]


# ------------------------------------------------------------------------- never lossy
@pytest.mark.parametrize(
    ("method", "kwargs"),
    [("nan", {}), ("eagle", {"top_p": 0.8}), ("eagle", {"draft_vocab_size": 6}), ("policy", {"top_p": 0.8})],
)
def test_lossless_for_nan_drafters_top_p_and_draft_vocabularies(method: str, kwargs: dict[str, object]) -> None:
    """Whole 3-token sequences sampled through the engine (rows admitted in waves while it speculates)
    follow the policy's exact distribution: a drafter with NaN weights, top-p < 1 with top-k, and a
    draft vocabulary of 6 of the 10 tokens."""
    chi2, df, stats = speculative_chi_square(method, **kwargs)
    assert df >= (15 if "top_p" in kwargs else 50)
    assert chi2 < chi_square_quantile(df), (chi2, df)
    assert stats["spec/steps"] > 0
    if method == "nan":
        assert all(v == 0.0 for key, v in stats.items() if key.startswith("spec/acceptance_rate_pos"))


def test_a_nan_drafter_is_refused_by_set_drafter(tiny_qwen2: PreTrainedModel) -> None:
    engine = eagle_engine(tiny_qwen2, slots=2)
    current = engine.drafter
    bad = EagleDrafter.from_target(tiny_qwen2)
    with torch.no_grad():
        bad.fc.weight[0, 0] = float("nan")
    with pytest.warns(UserWarning, match="refusing to publish a drafter with non-finite weights"):
        assert engine.set_drafter(bad, version=7) is False
    assert engine.drafter is current and engine.drafter_version == 0
    good = EagleDrafter.from_target(tiny_qwen2, generator=torch.Generator().manual_seed(3))
    assert engine.set_drafter(good, version=8) and engine.drafter is current  # same layout: copied in place
    assert torch.equal(current.fc.weight, good.fc.weight.to(current.fc.weight.dtype)) and engine.drafter_version == 8


# ------------------------------------------------------------------------- never slower than plain
def cost_model(k: int, rows: int) -> float:
    """A speculative step drafting k tokens costs 1 + 0.5 k plain steps (a slow drafter)."""
    return 1e-3 * (1.0 + 0.5 * k)


def tuned_engine(model: PreTrainedModel, drafter: object) -> RolloutEngine:
    config = SpeculativeConfig(method="eagle", num_draft_tokens=None, draft_candidates=(2, 4, 8), threshold=8,
                               hysteresis_steps=1, tuner_epsilon=0.0, tuner_min_samples=2)
    engine = RolloutEngine(model, max_seq_len=96, max_batch_size=8, speculative=config)
    engine.drafter = drafter
    assert engine.tuner is not None
    engine.tuner.cost_model = cost_model
    return engine


def test_tuner_settles_on_plain_decoding_with_a_useless_drafter() -> None:
    model = tiny_vocab_model()  # peaked distributions: an untrained drafter's drafts are mostly rejected
    cold = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    engine = tuned_engine(model, cold)
    phases: list[str] = []
    engine.add_listener(lambda e: phases.append(e.phase))
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=60, stop_token_ids=[])
    engine.generate([[1, 2, 3]], cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    steps = [p for p in phases if p in ("decode", "speculative")]
    # the drafting arms are tried min_samples = 2 times each, shortest first, and only while the
    # shorter arm's acceptance leaves them a chance (here k = 2 accepts 0.25 a step, which rules out
    # k = 4 but not k = 8); then plain wins for good (a bucket first met at the very end, when a row
    # has finished, starts exploring anew: at most 2 more steps). Without the bound: up to 6 + 3.
    assert steps.count("speculative") <= 4 + 2
    assert set(steps[10:-3]) == {"decode"} and len(steps) > 40
    assert engine.tuner.best(2) == 0
    assert engine.tuner.prune_margin == 0.05  # SpeculativeConfig.tuner_prune_margin reaches the tuner


def test_tuner_keeps_speculating_with_a_drafter_equal_to_the_policy() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    engine = tuned_engine(model, PolicyDrafter(model))
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=60, stop_token_ids=[])
    out = engine.generate([[5, 6, 7]], cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    assert engine.tuner.best(2) == 8  # every draft accepted: 9 tokens for 5 steps' cost beats 1 for 1
    assert out.stats["spec/speculative_step_share"] > 0.8


# ------------------------------------------------------------------------- drafter swaps
class CountingBackend:
    """Captures by keeping the function (an eager stand-in for a CUDA graph)."""

    def capture(self, fn: Callable[[], None], reset: Callable[[], None] | None = None, group: Hashable = ()) -> Replayable:
        if reset is not None:
            reset()
        return Replayable(fn, 1)


def test_twenty_drafter_swaps_keep_the_graph_cache_bounded() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    engine = eagle_engine(model, slots=2)
    engine.use_graph_backend(CountingBackend())
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=8, stop_token_ids=[])
    sizes = []
    for i in range(20):
        engine.drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(i)).inference_copy()
        engine.generate([[5, 6], [7, 8, 9]], cfg, generator=torch.Generator().manual_seed(i))
        sizes.append(len(engine.graph_profiles()))
        assert all(p.extra[1] == engine.drafter_handle for p in engine.graph_profiles() if p.phase == "spec")
    assert sizes[0] > 0 and any(p.phase == "spec" for p in engine.graph_profiles())  # the swaps had graphs to free
    # a replaced drafter's graphs are freed, never accumulated: at most one step over 2 rows and one over
    # the last row (whether the two rows end in the same step depends on what they sample)
    assert max(sizes) <= 2


# ------------------------------------------------------------------------- draft vocabulary
def test_drafts_come_from_the_draft_vocabulary() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    engine = eagle_engine(model, slots=4, draft_vocab_size=16)
    drafted: list[int] = []

    def record(event: StepEvent) -> None:
        st = engine.slot_state
        if event.phase == "speculative" and st is not None and st.spec is not None:
            drafted.extend(st.spec.draft_tokens[: event.active_rows + 1, :3].flatten().tolist())

    engine.add_listener(record)
    allowed = set(engine.draft_vocabulary.ids().tolist())
    assert allowed == set(range(16))  # before any rollout is counted: the first ids
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=20, stop_token_ids=[])
    engine.generate([[5, 6, 7], [40, 41]], cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    assert drafted and set(drafted) <= allowed
    # after the call the vocabulary follows the policy's own rollouts: its most frequent tokens
    counts = engine.draft_vocabulary.counts
    top = set(torch.argsort(-counts, stable=True)[:16].tolist())
    assert set(engine.draft_vocabulary.ids().tolist()) == top and counts.sum() == 2 * 2 * 20


def test_changing_k_and_shrinking_batches_keep_padding_rows_inert() -> None:
    """Rows finish at many different steps, queued requests are admitted into released slots and the
    tuner alternates k, so padding rows of a bucket hold stale catch-up blocks of other widths: they
    are never read (the step reads blocks of active rows only). Greedy output equals plain decoding."""
    model = build_model("llama", "tiny", seed=0)
    config = SpeculativeConfig(method="eagle", num_draft_tokens=None, draft_candidates=(2, 8), threshold=16,
                               hysteresis_steps=1, tuner_epsilon=0.5, tuner_min_samples=1, plain_arm=False,
                               tuner_prune_margin=None)  # k keeps alternating, whatever the CPU clock says
    engine = RolloutEngine(model, max_seq_len=64, max_batch_size=16, speculative=config)
    engine.drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    free = RolloutEngine(model, max_seq_len=64, max_batch_size=16)
    prompts = [[4 + i % 50, 5 + (7 * i) % 60, 6 + i % 3] for i in range(40)]
    runs = free.generate(prompts, SamplingConfig(temperature=0.0, max_new_tokens=30, stop_token_ids=[])).completion_ids
    stops = sorted({c[2 + i % 25] for i, c in enumerate(runs)})[:6]  # rows end at many different steps
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30, stop_token_ids=stops)
    ref = free.generate(prompts, cfg).completion_ids
    sizes: list[int] = []
    engine.add_listener(lambda e: sizes.append(e.active_rows) if e.phase == "speculative" else None)
    out = engine.generate(prompts, cfg)
    assert out.completion_ids == ref
    assert len({len(c) for c in ref}) > 5
    grew = any(b > a for a, b in zip(sizes, sizes[1:]))  # queued requests admitted after rows finished
    assert grew and out.stats["spec/steps"] > 10


def test_one_graph_per_bucket_and_k_whatever_the_last_k() -> None:
    """The catch-up block is always K + 1 rows wide, so a batch bucket and a draft length are one
    captured step, not one per last step's k (on the H200 the 0.5 B e2e run captured 167 graphs,
    50 s of one RL step, when the width followed the last k). Greedy output still equals plain."""
    model = build_model("llama", "tiny", seed=0)
    config = SpeculativeConfig(method="eagle", num_draft_tokens=None, draft_candidates=(2, 4, 8), threshold=8,
                               hysteresis_steps=1, tuner_epsilon=0.5, tuner_min_samples=1, plain_arm=False,
                               tuner_prune_margin=None)  # k keeps changing, whatever the CPU clock says
    engine = RolloutEngine(model, max_seq_len=64, max_batch_size=8, speculative=config)
    engine.drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    engine.use_graph_backend(CountingBackend())
    ks: list[int] = []
    engine.add_listener(lambda e: ks.append(engine.speculative_step.last_k) if e.phase == "speculative" else None)  # type: ignore[union-attr]
    cfg = SamplingConfig(temperature=0.0, max_new_tokens=30, stop_token_ids=[])
    prompts = [[4 + i, 9 + 2 * i, 7] for i in range(6)]
    out = engine.generate(prompts, cfg)
    ref = RolloutEngine(model, max_seq_len=64, max_batch_size=8).generate(prompts, cfg)
    assert out.completion_ids == ref.completion_ids
    assert len({(a, b) for a, b in zip(ks, ks[1:]) if a != b}) >= 3  # the last k varied under each k
    spec = [p for p in engine.graph_profiles() if p.phase == "spec"]
    # one per bucket, k and (on the CPU's SDPA path) KV-length bucket: none per last k
    assert spec and len(spec) == len({(p.batch, p.tokens_per_row, p.extra[2]) for p in spec})


def test_a_stale_catch_up_block_wider_than_the_step_is_never_indexed() -> None:
    """The H200 failure, directly: a slot whose catch-up block says 9 valid rows (from a k = 8 step) in
    a step whose block is 3 wide (the last step had k = 2), and a finished padding row with a stale
    fresh block: the step clamps to its width and reads only active rows, instead of indexing out of
    bounds. And the engine hands every graph capture a reset, so warm-up runs never see each other's
    writes (the cause of that state on the GPU)."""
    model = build_model("qwen2", "tiny", seed=0)
    engine = eagle_engine(model, slots=4, num_draft_tokens=8)
    engine.generate([[5, 6, 7]], SamplingConfig(temperature=1.0, max_new_tokens=4, stop_token_ids=[]), num_samples=2)
    st = engine.slot_state
    assert st is not None and st.spec is not None and engine.speculative_step is not None
    st.finished[:4] = torch.tensor([False, False, False, True])
    st.spec.cu_fresh[:4] = True
    st.spec.cu_valid[:4] = torch.tensor([2, 9, 3, 9])
    engine.speculative_step.begin(model.lm_head)
    engine.speculative_step.eagle_step(engine.step_context(), 4, 8, 3, SamplingKey(1.0, 0, 1.0), engine.drafter, None)
    assert int(st.spec.draft_lens[0]) == 8  # it ran through
    captured: list[object] = []

    class Backend:
        def capture(self, fn: Callable[[], None], reset: Callable[[], None] | None = None, group: Hashable = ()) -> Replayable:
            captured.append(reset)
            return Replayable(fn, 1)

    engine.use_graph_backend(Backend())
    engine.generate([[5, 6, 7]], SamplingConfig(temperature=1.0, max_new_tokens=6, stop_token_ids=[]), num_samples=2)
    assert captured and all(callable(r) for r in captured)


# ------------------------------------------------------------------------- compiled steps, errors, timing
def test_every_step_shape_of_a_speculating_engine_stays_compiled(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    # Dynamo's guards without Inductor (backend="eager"): each batch bucket x draft length x catch-up
    # width is a step the engine meets in the tail; at torch's default limit of 8 versions the 10th
    # drafter-rows compile raised, and the engine then ran uncompiled for the rest of its life
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    import torch._dynamo.config as dynamo_config

    fell_back = stored_compile.stats()["fell_back"]
    # torch's default limit, raised by the engine (config.patch restores it; pytest's monkeypatch deletes it)
    with dynamo_config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        model = build_model("qwen2", "tiny", seed=0)
        config = SpeculativeConfig(method="eagle", threshold=16, hysteresis_steps=1, draft_vocab_size=64)
        engine = RolloutEngine(model, max_seq_len=64, max_batch_size=16, compile=True, speculative=config,
                               compile_cache=str(tmp_path))  # fmt: skip
        engine.allocate_buffers()
        assert engine.speculative_step is not None and engine.slot_state is not None and engine.kv_cache is not None
        engine.speculative_step.begin(model.lm_head)
        st = engine.slot_state
        st.begin([], 20)
        st.finished[:] = False
        st.positions.fill_(10)
        drafter = engine.drafter
        assert drafter is not None
        st.ensure_drafter_cache(drafter.num_kv_heads, drafter.head_dim, engine.kv_cache.max_seq_len, drafter.fc.weight.dtype)
        key = SamplingKey(1.0, 0, 1.0)
        for batch in (16, 8, 4, 2, 1):
            for k in (8, 2, 4, 6):
                for width in (1, 3, 5, 9):
                    engine.speculative_step.eagle_step(engine.step_context(), batch, k, width, key, drafter, None)
        assert dynamo_config.recompile_limit >= 64 and engine.compile_failures == []
        # few versions serve every batch and draft length: with Dynamo's duck shaping (equal sizes of the
        # first call unified) and k = max_draft_tokens slicing a buffer's whole width, 14, 4, 11 and 9; then,
        # with a batch of 1 and a catch-up width of 1 specialised, 3, 3, 6 and 4. (The same calls under
        # no_grad, as the engine makes them, compiled one version each on the CPU.)
        step = engine.speculative_step
        versions = [getattr(step, n).num_versions for n in ("_verify_update", "_draft_sample", "_catch_up_rows",
                                                             "_chain_row")]  # fmt: skip
        assert all(n <= most for n, most in zip(versions, [2, 2, 3, 3])), versions
    # outside no_grad the regions' inputs require grad: a version compiled from an alias that did not once
    # made every call compile anew, past the 64 versions a stored function may hold
    assert stored_compile.stats()["fell_back"] == fell_back


def test_the_draft_chain_compiles_one_version_for_every_draft_length(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    # the e2e's step 0 on an H100 (and the CPU, stored versions): the catch-up compiled twice, for k = 1 and 2.
    # Its positions and RoPE were slices of a chain laid out k wide, and a slice's strides are its base's.
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    model = build_model("qwen2", "tiny", seed=0)
    config = SpeculativeConfig(method="eagle", threshold=16, hysteresis_steps=1, draft_candidates=(2, 4, 6, 8))
    engine = RolloutEngine(model, max_seq_len=64, max_batch_size=16, compile=True, speculative=config,
                           compile_cache=str(tmp_path))  # fmt: skip
    engine.allocate_buffers()
    step, st, cache, drafter = engine.speculative_step, engine.slot_state, engine.kv_cache, engine.drafter
    assert step is not None and st is not None and cache is not None and drafter is not None
    step.begin(model.lm_head)
    st.begin([], 20)
    st.finished[:] = False
    st.positions.fill_(10)
    st.ensure_drafter_cache(drafter.num_kv_heads, drafter.head_dim, cache.max_seq_len, drafter.fc.weight.dtype)
    with torch.no_grad():  # as the engine calls them
        for batch in (16, 8):
            for k in (1, 2, 4, 8, 3):
                step.eagle_step(engine.step_context(), batch, k, 9, SamplingKey(1.0, 0, 1.0), drafter, None)
    assert (step._catch_up_rows.num_versions, step._chain_row.num_versions) == (1, 1)


@pytest.mark.slow
@pytest.mark.skipif(not stored_compile.aot_enabled(), reason="torch without aot_compile")
def test_a_draft_length_or_batch_of_one_shares_the_verify_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # measured on an H100 (issue 29): the TLT shape's first call compiled the verify update three times,
    # 42 s of its 81 s: a draft length of 1, then 2, then a host drafter's drafts without probabilities.
    # Inductor's views of the drafts' slice of their wider buffer guarded on a draft length of 1 and a
    # batch above 1; the drafts are copied out now. Inductor compiles the verify update (the guards are
    # its own), every other step function runs eager (fast)
    compile_ = torch.compile

    def compile_verify_only(fn: Any, **kw: Any) -> Any:
        return compile_(fn, **kw if fn.__name__ == "verify_update" else {**kw, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", compile_verify_only)
    model = build_model("qwen2", "tiny", seed=0)
    config = SpeculativeConfig(method="eagle", threshold=16, hysteresis_steps=1, draft_vocab_size=64)
    engine = RolloutEngine(model, max_seq_len=64, max_batch_size=8, compile=True, speculative=config,
                           compile_cache=str(tmp_path))  # fmt: skip
    engine.allocate_buffers()
    step, st, drafter = engine.speculative_step, engine.slot_state, engine.drafter
    assert step is not None and st is not None and drafter is not None and engine.kv_cache is not None
    step.begin(model.lm_head)
    st.begin([], 20)
    st.finished[:] = False
    st.positions.fill_(10)
    st.ensure_drafter_cache(drafter.num_kv_heads, drafter.head_dim, engine.kv_cache.max_seq_len, drafter.fc.weight.dtype)
    key = SamplingKey(1.0, 0, 1.0)
    with torch.no_grad():
        for batch, k in ((4, 1), (4, 2), (1, 3)):
            step.eagle_step(engine.step_context(), batch, k, 3, key, drafter, None)
    assert step._verify_update.num_versions == 1 and engine.compile_failures == []
    assert step._verify_update.stored  # compiled ahead of time and stored, not fallen back to torch.compile


def _recording_compile(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``torch.compile`` with Dynamo's guards and no Inductor (fast), recording each compiled version's function."""
    compiled: list[str] = []
    compile_ = torch.compile

    def recording(fn: Any, **kw: Any) -> Any:
        name = getattr(fn, "__name__", type(fn).__name__)

        def backend(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            compiled.append(name)
            return gm.forward

        return compile_(fn, **{**kw, "backend": backend})

    monkeypatch.setattr(torch, "compile", recording)
    return compiled


def test_each_step_function_compiles_once_for_every_bucket_and_draft_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # measured on the H200 (issue 29): the e2e's first RL step traced the 24-layer policy three times
    # (static batch, then dynamic, then a verify) and compiled 55 graphs' worth of versions in 108 s.
    # Now each step function has one version for every batch bucket and draft length, compiled on its
    # first use: the forward's regions two each (a decode's one token a row, which Dynamo specialises,
    # and a verify's k + 1; every layer runs the same version), the verify update two (a host drafter's
    # drafts without probabilities, EAGLE's with),
    # the others one; the calls after the ones that first met them compile nothing
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = _recording_compile(monkeypatch)
    policy = build_model("qwen2", "tiny", seed=0)
    spec = SpeculativeConfig(method="suffix", threshold=16)  # as the e2e's a: suffix first, EAGLE handed over
    engine = RolloutEngine(policy, max_batch_size=32, max_seq_len=200, compile=True, use_cuda_graphs=False,
                           speculative=spec, compile_cache=False)  # fmt: skip
    assert engine.tuner is not None  # measured step times would make the k choices, so the rollouts, vary
    engine.tuner.cost_model = lambda k, rows: 1e-3 * (1 + 0.1 * k)  # (CI on 2 busy cores: no lone row)
    prompts = [[3, 17, 25, 9, 40, 11][: 3 + i % 4] for i in range(8)]
    lone: list[int] = []  # steps at one active row, per call
    engine.add_listener(lambda event: lone.__setitem__(-1, lone[-1] + (event.active_rows == 1)))
    per_call, ks, speculated = [], set(), []
    for call in range(5):
        if call == 2:
            engine.set_drafter(EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(1)))
        lone.append(0)
        before = counters["stats"]["unique_graphs"]
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=60 + 30 * (call % 3), stop_token_ids=[5])
        engine.generate(prompts, sampling, num_samples=4, generator=torch.Generator().manual_seed(30 + call))
        per_call.append(counters["stats"]["unique_graphs"] - before)
        ks |= {int(key.split("_k")[1].split("_")[0]) for key in engine.last_stats if key.startswith("tuner/b")}
        speculated.append(engine.last_stats.get("spec/steps", 0) > 0)
    assert speculated[1] and any(speculated[2:]), speculated  # the suffix drafter, then EAGLE
    assert sum(lone[1:]) > 0, f"the tails ran down to a lone row: {lone}"
    assert len(ks - {0}) >= 2, f"several draft lengths were met: {ks}"
    assert engine.graph_cache is not None and engine.graph_cache.buckets[0] == 2
    regions = ["policy_embed"] * 2 + ["policy_layer"] * 2 + ["policy_head"] * 2
    assert sorted(compiled) == sorted([*regions, "decode_update", "verify_update", "verify_update",
                                       "catch_up_rows", "chain_row", "draft_sample"]), compiled
    assert sum(per_call) == len(compiled), per_call  # every version Dynamo made is one of those
    assert engine.compile_failures == []


def test_compiling_a_staged_drafter_ahead_covers_every_draft_length(monkeypatch: pytest.MonkeyPatch) -> None:
    # measured on the H200 (2026-12-05, `TORCH_LOGS=recompiles`): with the staged drafter compiled ahead at
    # one draft length, verify_update still recompiled in RL step 2 (14.5 s cold). A draft of one token is
    # a version of its own (Dynamo specialises size 1), so the engine compiles ahead at 1 and at 2 tokens;
    # then no batch bucket or draft length up to the longest compiles anything
    from lightning_tlt.rollout.steps import compile_settings

    torch._dynamo.reset()
    compiled = _recording_compile(monkeypatch)
    model = build_model("qwen2", "tiny", seed=0)
    config = SpeculativeConfig(method="suffix", threshold=16, hysteresis_steps=1, draft_vocab_size=64)
    engine = RolloutEngine(model, max_seq_len=64, max_batch_size=16, compile=True, use_cuda_graphs=False,
                           speculative=config, compile_cache=False, fuse_projections=False)  # fmt: skip
    engine.stage_drafter(EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(1)))
    engine.allocate_buffers()
    step, st, drafter = engine.speculative_step, engine.slot_state, engine.staged_drafter
    assert step is not None and st is not None and drafter is not None
    step.begin(model.lm_head)
    st.begin([], 20)
    st.finished[:] = False
    st.positions.fill_(10)
    key, longest = SamplingKey(1.0, 0, 1.0), engine.max_draft_tokens
    assert longest > 3
    with torch.inference_mode():  # as in generate
        engine.compile_staged_drafter(4, key, None)
        assert {"catch_up_rows", "chain_row", "draft_sample", "verify_update"} <= set(compiled), compiled
        ahead = len(compiled)
        with compile_settings():  # as the engine runs its steps
            for batch in (4, 2, 8):
                for k in (1, 2, 3, longest):
                    step.eagle_step(engine.step_context(), batch, k, longest + 1, key, drafter, None)
    assert compiled[ahead:] == [], compiled[ahead:]
    assert engine.compile_failures == []


def test_a_staged_drafter_compiles_with_the_first_speculation_and_not_at_its_hand_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # measured on the H200 (2026-12-05): the EAGLE drafter's step functions compiled at its hand-over, in
    # RL step 2 (35 s cold, 11.5 s on a warm restart), inside the steady window. A staged drafter now
    # compiles them at the suffix drafter's first speculative step (one EAGLE step on the live state,
    # undone): the rollouts are those of an engine with nothing staged, and the hand-over compiles nothing
    torch._dynamo.reset()
    compiled = _recording_compile(monkeypatch)
    policy = build_model("qwen2", "tiny", seed=0)
    spec = SpeculativeConfig(method="suffix", num_draft_tokens=3, threshold=16, hysteresis_steps=1)
    prompts = [[3, 17, 25, 9, 40, 11][: 3 + i % 4] for i in range(8)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=90, stop_token_ids=[5])
    firsts, compiled_after = [], []
    for staged in (True, False):
        engine = RolloutEngine(policy, max_batch_size=32, max_seq_len=200, compile=True, use_cuda_graphs=False,
                               speculative=spec, compile_cache=False)  # fmt: skip
        drafter = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(1))
        if staged:
            engine.stage_drafter(drafter)
        firsts.append([engine.generate(prompts, cfg, num_samples=4, generator=torch.Generator().manual_seed(seed))
                       for seed in (2, 3)])  # the suffix drafter has rollouts to draft from in the second
        assert isinstance(engine.drafter, SuffixDrafter) and engine.last_stats["spec/steps"] > 0
        if staged:
            assert {"catch_up_rows", "draft_sample"} <= set(compiled), compiled  # compiled with the suffix's steps
        before = len(compiled)
        engine.set_drafter(drafter)
        eagle_steps = 0.0
        for call in range(3):
            engine.generate(prompts, cfg, num_samples=4, generator=torch.Generator().manual_seed(4 + call))
            eagle_steps += engine.last_stats.get("spec/steps", 0.0)
        assert eagle_steps > 0 and isinstance(engine.drafter, EagleDrafter)
        compiled_after.append(compiled[before:])
        assert engine.compile_failures == []
    assert compiled_after[0] == [], compiled_after[0]  # the hand-over found every EAGLE function compiled
    assert {"catch_up_rows", "draft_sample"} <= set(compiled_after[1])  # without staging, it compiled them
    for with_staged, without in zip(*firsts):
        assert with_staged.completion_ids == without.completion_ids and with_staged.logprobs == without.logprobs


def test_capturing_draws_nothing_the_rollouts_see(monkeypatch: pytest.MonkeyPatch) -> None:
    # a capture runs the live step (warm-up, capture) from a snapshot and restores it, the generator
    # included: a call that captures samples what the same call replaying its graphs samples
    from test_cuda_graphs import WarmupBackend

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    engine = RolloutEngine(build_model("qwen2", "tiny", seed=0), max_batch_size=8, max_seq_len=64, compile=True,
                           compile_cache=False)  # fmt: skip
    engine.use_graph_backend(WarmupBackend())
    assert engine.graph_cache is not None
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=24)
    prompts = [[3, 17, 25], [9, 40, 11, 4]]
    first = engine.generate(prompts, sampling, num_samples=3, generator=torch.Generator().manual_seed(7))
    assert engine.last_stats["compile/captures"] > 0
    again = engine.generate(prompts, sampling, num_samples=3, generator=torch.Generator().manual_seed(7))
    assert engine.last_stats["compile/captures"] == 0
    assert first.completion_ids == again.completion_ids and first.logprobs == again.logprobs


def test_graphs_are_captured_on_first_use_only_and_leave_no_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    # the CUDA path on the CPU: a backend that warms up and captures as CUDAGraphBackend does. Every
    # profile is captured when the rollout first meets it, never one it does not meet: speculative
    # profiles only once the gate turned speculation on, at buckets it allows. The rollouts equal the
    # same engine's without graphs
    from test_cuda_graphs import WarmupBackend

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    model = build_model("qwen2", "tiny", seed=0)
    prompts = [[4 + i % 50, 5 + (7 * i) % 60, 6 + i % 3] for i in range(12)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, stop_token_ids=[7, 9, 11, 13])
    spec = SpeculativeConfig(method="eagle", draft_candidates=(2, 8), threshold=4, hysteresis_steps=1,
                             tuner_epsilon=0.5, tuner_min_samples=1)  # fmt: skip
    drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    outs, stats, met = [], [], []
    for graphs in (False, True):
        engine = RolloutEngine(model, max_seq_len=48, max_batch_size=8, speculative=spec, compile=True,
                               compile_cache=False)  # fmt: skip
        engine.drafter = drafter
        assert engine.tuner is not None
        engine.tuner.cost_model = lambda k, rows: 1e-3 * (1 + 0.1 * k)  # the same k choices in both runs
        if graphs:
            engine.use_graph_backend(WarmupBackend())
            assert engine.graph_cache is not None
        seen: set[tuple[str, int, int]] = set()
        run = CUDAGraphProfileCache.run  # every step the engine runs goes through its graph cache's run

        def spy(graphs: CUDAGraphProfileCache, profile: GraphProfile, fn: Any, run: Any = run,
                seen: set[Any] = seen, **kw: Any) -> None:  # fmt: skip
            seen.add((profile.phase, profile.batch, profile.tokens_per_row))
            run(graphs, profile, fn, **kw)

        monkeypatch.setattr(CUDAGraphProfileCache, "run", spy)
        outs.append(engine.generate(prompts, cfg, num_samples=2, generator=torch.Generator().manual_seed(3)))
        stats.append(dict(engine.last_stats))
        met.append(seen)
        if graphs:
            captured = {(p.phase, p.batch, p.tokens_per_row) for p in engine.graph_cache.stats.captured}
    assert outs[1].completion_ids == outs[0].completion_ids and outs[1].logprobs == outs[0].logprobs
    assert captured == met[1] == met[0]  # every profile met, and only those
    assert stats[1]["compile/captures"] == len(captured) and stats[0]["compile/captures"] == 0
    assert {b for phase, b, _ in captured if phase == "decode"} == {2, 4, 8}
    spec_rows = {b for phase, b, _ in captured if phase == "spec"}
    assert spec_rows and max(spec_rows) <= 4, captured  # the gate allows 4 rows
    # a call whose rows never fall to the gate's threshold captures no speculative profile
    engine.generate(prompts[:4], SamplingConfig(temperature=1.0, max_new_tokens=4, stop_token_ids=[]),
                    num_samples=2, generator=torch.Generator().manual_seed(4))
    assert engine.graph_cache is not None
    assert not [p for p in engine.graph_cache.stats.captured[len(captured):] if p.phase == "spec"]


def test_a_staged_drafters_graphs_survive_its_publication(monkeypatch: pytest.MonkeyPatch) -> None:
    # a staged drafter is held under its own graph handle: nothing is captured for it while the suffix
    # drafter drafts (a profile a run never reaches is never captured); once published it captures its
    # profiles on first use, a later publication copies weights into it and captures nothing, and it
    # samples what an engine given the drafter directly samples
    from test_cuda_graphs import WarmupBackend

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    model = build_model("qwen2", "tiny", seed=0)
    prompts = [[4 + i % 50, 5 + (7 * i) % 60, 6 + i % 3] for i in range(12)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, stop_token_ids=[7, 9, 11, 13])
    spec = SpeculativeConfig(method="suffix", num_draft_tokens=4, threshold=8, hysteresis_steps=1)
    cold = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0))
    trained = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(1))  # other weights
    later = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(2))
    outs, spec_captures = [], []
    for staged in (True, False):
        engine = RolloutEngine(model, max_seq_len=48, max_batch_size=8, speculative=spec, compile=True,
                               compile_cache=False)  # fmt: skip
        engine.use_graph_backend(WarmupBackend())
        assert engine.graph_cache is not None
        if staged:
            engine.stage_drafter(cold)
            assert engine.staged_drafter is not None and engine.staged_drafter is not cold  # a frozen copy, not the trainee
        engine.generate(prompts, cfg, num_samples=2, generator=torch.Generator().manual_seed(2))
        assert isinstance(engine.drafter, SuffixDrafter) and engine.last_stats["spec/steps"] > 0
        graphs = engine.graph_cache
        assert graphs is not None

        def eagle(graphs: CUDAGraphProfileCache = graphs) -> list[GraphProfile]:
            return [p for p in graphs.stats.captured if p.phase == "spec"]

        assert eagle() == []  # nothing captured for a drafter that has not drafted
        assert engine.set_drafter(trained)
        outs.append(engine.generate(prompts, cfg, num_samples=2, generator=torch.Generator().manual_seed(3)))
        first = len(eagle())
        assert engine.set_drafter(later)
        engine.generate(prompts, cfg, num_samples=2, generator=torch.Generator().manual_seed(3))
        spec_captures.append((first, len(eagle()) - first))
    assert spec_captures[0][0] > 0 and spec_captures[0][1] == 0, spec_captures
    assert outs[0].completion_ids == outs[1].completion_ids and outs[0].logprobs == outs[1].logprobs


def test_stage_drafter_takes_only_an_eagle_drafter() -> None:
    engine = RolloutEngine(build_model("qwen2", "tiny", seed=0), max_seq_len=32, max_batch_size=2,
                           speculative=SpeculativeConfig(method="suffix"))  # fmt: skip
    with pytest.raises(TypeError, match="stage_drafter takes an EagleDrafter, got SuffixDrafter"):
        engine.stage_drafter(engine.drafter)


def test_a_step_error_is_raised_not_retried_as_a_compiler_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = RolloutEngine(build_model("qwen2", "tiny", seed=0), max_seq_len=32, max_batch_size=2, compile=False)
    assert engine.runner is not None
    forward = engine.runner.forward

    def broken(*args: Any, prefill: bool = False, **kwargs: Any) -> Any:  # the decode step's forward only
        if prefill:
            return forward(*args, prefill=prefill, **kwargs)
        raise ValueError("a bug in the step")

    monkeypatch.setattr(engine.runner, "forward", broken)
    with pytest.raises(ValueError, match="a bug in the step"):  # was: retried until RecursionError
        engine.generate([[5, 6]], GREEDY)


def test_the_tuner_never_scores_a_step_that_captured_a_graph() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    config = SpeculativeConfig(method="eagle", num_draft_tokens=None, draft_candidates=(2, 4, 8), threshold=8,
                               hysteresis_steps=1, tuner_epsilon=0.0, tuner_min_samples=2)
    engine = RolloutEngine(model, max_seq_len=96, max_batch_size=8, speculative=config)
    engine.drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    captures = [0]

    class Backend(CountingBackend):
        def capture(self, fn: Callable[[], None], reset: Callable[[], None] | None = None, group: Hashable = ()) -> Replayable:
            captures[0] += 1
            return super().capture(fn, reset)

    engine.use_graph_backend(Backend())
    tuner = engine.tuner
    assert tuner is not None
    start, stop = tuner.start, tuner.stop
    at_start: dict[int, int] = {}
    scored, discarded = [0], [0]

    def start_(k: int, rows: int):  # type: ignore[no-untyped-def]  # noqa: ANN202
        timing = start(k, rows)
        at_start[id(timing)] = captures[0]
        return timing

    def stop_(timing, emitted, *, captured=False) -> None:  # type: ignore[no-untyped-def]  # noqa: ANN001
        samples = sum(len(r) for r in tuner.rewards().values())
        stop(timing, emitted, captured=captured)
        if captures[0] != at_start[id(timing)]:  # this step captured: told so, and left unscored
            assert captured and sum(len(r) for r in tuner.rewards().values()) == samples
            discarded[0] += 1
        else:
            assert not captured
            scored[0] += 1

    tuner.start, tuner.stop = start_, stop_  # type: ignore[method-assign]
    events: list[StepEvent] = []
    engine.add_listener(events.append)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=40, stop_token_ids=[])
    engine.generate([[1, 2, 3]], cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    assert discarded[0] > 0 and scored[0] > 0
    # the step events whose time held a capture say so (the co-training pacer leaves them out)
    flagged = sum(e.captured for e in events)
    assert 0 < flagged <= captures[0] and not all(e.captured for e in events if e.phase != "done")


@pytest.mark.skipif(not stored_compile.aot_enabled(), reason="torch without aot_compile")
def test_a_co_trained_drafters_regions_are_stored_through_one_view(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    # the H100's e2e (torch 2.11): "could not store a compiled version of catch_up_rows (TypeError('assigned grad
    # expected to be a Tensor or None ...'))": a co-trained drafter's weights carry a .grad, which a version's
    # guards cannot hold; every process compiled the catch-up and the chained row again (10 s at the first
    # speculative step), and the background compile's child never stored them
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    model = build_model("qwen2", "tiny", seed=0)
    config = SpeculativeConfig(method="eagle", threshold=16, hysteresis_steps=1, num_draft_tokens=2)
    engine = RolloutEngine(model, max_seq_len=64, max_batch_size=4, compile=True, speculative=config,
                           compile_cache=str(tmp_path))  # fmt: skip
    engine.allocate_buffers()
    step, st, cache, drafter = engine.speculative_step, engine.slot_state, engine.kv_cache, engine.drafter
    assert step is not None and st is not None and cache is not None and drafter is not None
    for p in drafter.parameters():
        p.grad = torch.zeros_like(p)
    step.begin(model.lm_head)
    st.begin([], 20)
    st.finished[:] = False
    st.positions.fill_(10)
    st.ensure_drafter_cache(drafter.num_kv_heads, drafter.head_dim, cache.max_seq_len, drafter.fc.weight.dtype)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="could not store")
        with torch.no_grad():
            for k in (2, 1):
                step.eagle_step(engine.step_context(), 4, k, 3, SamplingKey(1.0, 0, 1.0), drafter, None)
    assert step._catch_up_rows.stored and step._chain_row.stored
    assert (step._catch_up_rows.num_versions, step._chain_row.num_versions) == (1, 1)  # one view, not one a call
    view = step._frozen(drafter)
    assert all(not p.requires_grad and p.grad is None for p in view.parameters())
    drafter.fc.weight.data = drafter.fc.weight.data.clone()  # new storage: a new view that reads it
    assert step._frozen(drafter) is not view and step._frozen(drafter).fc.weight.data_ptr() == drafter.fc.weight.data_ptr()


def test_a_drafter_over_the_master_weights_drafts_over_the_decoded_copys_embedding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The e2e's co-trained drafter reads the float32 master policy's embedding, while the engine decodes a bf16
    copy and a background compile's child builds its drafter over a bf16 model. The catch-up and the chained
    row guard on the embedding's dtype, so the parent compiled both again at its first speculative step (11.7 s
    on the H100). The engine's frozen copy of a drafter now reads the decoded model's embedding and head: one
    set of versions serves the parent and the child, and the drafts are the same."""
    import copy

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    master = build_model("qwen2", "tiny", seed=0)  # float32, in training
    spec = SpeculativeConfig(method="suffix", num_draft_tokens=2, threshold=16, hysteresis_steps=1)  # every step
    prompts = [[4 + i % 50, 5 + (7 * i) % 60, 6 + i % 3] for i in range(6)]
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=16, stop_token_ids=[])

    def engine_over(model: PreTrainedModel) -> RolloutEngine:
        return RolloutEngine(model, dtype=torch.bfloat16, max_seq_len=48, max_batch_size=8, speculative=spec,
                             compile=True, compile_cache=str(tmp_path), log_compile=False)  # fmt: skip

    def catch_up_versions() -> float:
        by = stored_compile.stats_by_function()
        return sum(by.get(name, {}).get("compiled", 0.0) for name in ("catch_up_rows", "chain_row"))

    trainee = EagleDrafter.from_target(master, generator=torch.Generator().manual_seed(1))
    parent = engine_over(master)
    assert parent.inference_copy is not None
    decoded = parent.inference_copy.module
    parent.stage_drafter(trainee)
    staged = parent.staged_drafter
    assert staged is not None and staged.shares(decoded) and not staged.shares(master)
    assert staged.fc.weight.dtype == torch.bfloat16 and torch.equal(staged.fc.weight, trainee.fc.weight.bfloat16())
    stored_compile.reset()
    before = catch_up_versions()
    parent.generate(prompts, cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    compiled = catch_up_versions() - before
    assert compiled >= 2  # the staged drafter's catch-up and chained row, compiled ahead of its hand-over
    # the child: a bf16 model of the same weights, no copy, its drafter built over it (`background_child`)
    stored_compile.reset()
    child_model = copy.deepcopy(decoded).requires_grad_(False)
    child = engine_over(child_model)
    assert child.inference_copy is None
    child.stage_drafter(EagleDrafter.from_target(child_model, generator=torch.Generator().manual_seed(1),
                                                 dtype=torch.bfloat16))  # fmt: skip
    child.generate(prompts, cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    assert catch_up_versions() - before == compiled  # the parent's versions served the child: nothing compiled
    # published without staging: the engine's copy reads the decoded embedding too
    fresh = engine_over(master)
    assert fresh.set_drafter(trainee) and isinstance(fresh.drafter, EagleDrafter)
    assert fresh.drafter is not trainee and fresh.drafter.shares(fresh.inference_copy.module)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match=r"target's embedding is \(\d+, \d+\), the drafter's policy's"):
        trainee.inference_copy(target=build_model("qwen2", "tiny", seed=0, vocab_size=400))
