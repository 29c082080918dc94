"""The policy's forward compiled by region (`PolicyRegions`): the same outputs as the forward in one piece,
one compiled decoder layer that every layer runs, and a restart that loads every region's versions."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedModel, Qwen2ForCausalLM

from lightning_tlt.core import stored_compile
from lightning_tlt.core.kv_cache import KVCache
from lightning_tlt.core.runner import ModelRunner
from lightning_tlt.core.stored_compile import CompileStore
from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.models.zoo import build_config, build_model
from lightning_tlt.rollout.engine import RolloutEngine
from lightning_tlt.rollout.steps import REGIONS_ENV_VAR, PolicyRegions, compile_settings, policy_step


class _Uncompiled:
    """A store that hands each region back uncompiled: the regions' composition alone, compared exactly."""

    def compile(self, fn: Callable[..., Any], **_: Any) -> Callable[..., Any]:
        return fn


def _step_inputs(runner: ModelRunner, batch: int, q: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, KVCache]:
    spec = runner.spec
    cache = KVCache.allocate(spec.num_layers, 4, 32, spec.num_kv_heads, spec.head_dim, device=torch.device("cpu"),
                             dtype=torch.float32)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    for k, v in zip(cache.k, cache.v):  # a filled prefix of 10 positions per row
        k[:, :10].normal_(generator=gen)
        v[:, :10].normal_(generator=gen)
    tokens = torch.randint(0, runner.spec.vocab_size, (batch, q), generator=gen)
    positions = 10 + torch.arange(q)[None].expand(batch, q)
    return tokens, positions.contiguous(), cache


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("q", [1, 4])  # a decode step, and a verify of three drafts
@pytest.mark.parametrize("capture", [(), (0, 1, 2)])  # EAGLE's last hidden state; EAGLE-3's layers
def test_regions_return_what_the_forward_in_one_piece_returns(
    tiny_arch_model: PreTrainedModel, fuse: bool, q: int, capture: tuple[int, ...]
) -> None:
    runner = ModelRunner(tiny_arch_model, fuse_projections=fuse)
    runner.sync_fused()
    tokens, positions, cache = _step_inputs(runner, 3, q, seed=q)
    regions = PolicyRegions(_Uncompiled())  # type: ignore[arg-type]
    with torch.no_grad():
        logits, features = regions(runner, tokens, positions, cache.k, cache.v, capture, None)
        k_after = [k.clone() for k in cache.k]
        ref_logits, ref_features = policy_step(runner, tokens, positions, cache.k, cache.v, capture, None)
    # the residual stream split in two is added one layer later: the same sums, float32 rounding apart
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(features, ref_features, rtol=1e-5, atol=1e-5)
    assert features.shape[-1] == runner.spec.hidden_size * max(1, len(capture))
    for mine, theirs in zip(k_after, cache.k):  # the same keys written to the same positions
        torch.testing.assert_close(mine, theirs)


def test_fused_regions_build_the_fused_weights_eagerly_and_refuse_to_in_a_capture() -> None:
    runner = ModelRunner(build_model("qwen2", "tiny", seed=0), fuse_projections=True)
    tokens, positions, cache = _step_inputs(runner, 2, 1, seed=0)
    regions = PolicyRegions(_Uncompiled())  # type: ignore[arg-type]
    with torch.no_grad():
        regions(runner, tokens, positions, cache.k, cache.v, (), None)
    assert runner.fused is not None  # built by the first (eager) call, as ModelRunner.forward does
    with torch.enable_grad():  # a training forward: the policy's own weights, as ModelRunner.forward
        assert list(runner.layer_fusions()) == [None] * runner.spec.num_layers
    runner = ModelRunner(build_model("qwen2", "tiny", seed=0), fuse_projections=True)
    compiled = torch.compile(lambda: runner.layer_fusions(), fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="sync_fused"), torch.no_grad():
        compiled()  # a compiled (or captured) forward must find them built


def _four_layers() -> PreTrainedModel:
    config = build_config("qwen2", "tiny")
    config.num_hidden_layers = 4
    config.layer_types = config.layer_types[:1] * 4
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.slow
@pytest.mark.skipif(not stored_compile.aot_enabled(), reason="torch without aot_compile")
def test_one_compiled_layer_serves_every_layer_and_a_restart_loads_every_region(tmp_path: Path) -> None:
    # compiled in one piece, the forward is traced and code-generated through every layer (the 0.5 B
    # policy's 24: 67.6 s for a decode forward on the CPU, 20.3 s by region); by region, every layer runs
    # one version (layer 0 adds a zero residual: with none, it compiled a version of its own)
    model = _four_layers()
    runner = ModelRunner(model)
    store = CompileStore(tmp_path, {"model": "four layers"})
    stored_compile.reset()
    start = stored_compile.stats()
    outputs = []
    with torch.no_grad(), compile_settings():
        regions = PolicyRegions(store)
        for batch, q in ((2, 1), (3, 1), (2, 4), (3, 3)):  # decode at two batches, verify at two shapes
            tokens, positions, cache = _step_inputs(runner, batch, q, seed=batch * q)
            outputs.append(regions(runner, tokens, positions, cache.k, cache.v, (), None))
            ref = policy_step(runner, tokens, positions, cache.k, cache.v, (), None)
            torch.testing.assert_close(outputs[-1], ref, rtol=1e-4, atol=1e-4)
        # decode and verify: one version each of the embeddings, the layer and the head
        assert (regions.embed.num_versions, regions.layer.num_versions, regions.head.num_versions) == (2, 2, 2)
        assert stored_compile.stats()["compiled"] - start["compiled"] == 6
        stored_compile.reset()  # as a restart: nothing held, every version on disk
        restarted = PolicyRegions(CompileStore(tmp_path, {"model": "four layers"}))
        for (batch, q), out in zip(((2, 1), (3, 1), (2, 4), (3, 3)), outputs):
            tokens, positions, cache = _step_inputs(runner, batch, q, seed=batch * q)
            torch.testing.assert_close(restarted(runner, tokens, positions, cache.k, cache.v, (), None), out,
                                       rtol=0, atol=0)  # fmt: skip
    end = stored_compile.stats()
    assert end["compiled"] - start["compiled"] == 6 and end["loaded"] - start["loaded"] == 6
    assert end["fell_back"] == start["fell_back"] and end["discarded"] == start["discarded"]


@pytest.mark.slow
def test_an_engine_by_region_samples_the_tokens_of_the_forward_in_one_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [[5, 6, 7], [8, 9], [3, 4, 5, 6]]
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=10, stop_token_ids=[])
    tokens = {}
    for regions in ("1", "0"):
        monkeypatch.setenv(REGIONS_ENV_VAR, regions)
        engine = RolloutEngine(build_model("qwen2", "tiny", seed=0), max_seq_len=32, max_batch_size=4, compile=True,
                               compile_cache=False, log_compile=False)  # fmt: skip
        out = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(0))
        assert engine.compile_failures == []
        assert isinstance(engine._forward, PolicyRegions) == (regions == "1")
        tokens[regions] = out.completion_ids
    assert tokens["1"] == tokens["0"]


def test_an_engine_over_a_policy_in_training_shares_and_stores_the_versions_of_a_frozen_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The e2e's b compiled the embeddings, the layer and the head again (6.4 s on the H100) after the drafter's
    warm-up had compiled them over the same weights: one engine decoded the policy's own parameters
    (``requires_grad``), the other a no-grad copy, and a version guards on that. The compiled steps take
    the policy through `ModelRunner.frozen`; a policy with a ``.grad`` (after a step) is stored and loaded too."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    import copy
    import warnings

    trained = build_model("qwen2", "tiny", seed=0)
    trained(torch.tensor([[5, 6, 7, 8]])).logits.sum().backward()  # every parameter has a .grad
    assert all(p.grad is not None for p in trained.parameters())
    frozen = copy.deepcopy(trained).requires_grad_(False)
    for p in frozen.parameters():
        p.grad = None
    prompts, sampling = [[5, 6, 7], [8, 9]], SamplingConfig(temperature=0.0, max_new_tokens=6, stop_token_ids=[])

    def generate(model: PreTrainedModel) -> list[list[int]]:
        engine = RolloutEngine(model, max_seq_len=32, max_batch_size=4, compile=True, compile_cache=str(tmp_path),
                               log_compile=False)  # fmt: skip
        out = engine.generate(prompts, sampling)
        assert engine.compile_failures == []
        return out.completion_ids

    stored_compile.reset()
    start = stored_compile.stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = generate(trained)
        compiled = stored_compile.stats()["compiled"] - start["compiled"]
        assert compiled >= 4 and generate(frozen) == tokens  # the embeddings, the layer, the head, the update
        assert stored_compile.stats()["compiled"] - start["compiled"] == compiled  # nothing compiled again
        stored_compile.reset()  # as a restart: the trained policy's versions were stored despite its .grad
        assert generate(trained) == tokens
    end = stored_compile.stats()
    assert end["compiled"] - start["compiled"] == compiled and end["loaded"] - start["loaded"] == compiled
    assert not [w for w in caught if "could not store" in str(w.message)]
