"""Fused q|k|v and gate|up projections (`FusedProjections`, ``fuse_projections=True``): the same
logits and rollouts as the policy's own weights, and never stale after the policy changes."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import PreTrainedModel

from lightning_tlt.core.kv_cache import KVCache
from lightning_tlt.core.runner import FusedProjections, ModelRunner
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine

GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=8, stop_token_ids=[])
PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


def _forward_all(runner: ModelRunner, ids: torch.Tensor) -> torch.Tensor:
    spec = runner.spec
    cache = KVCache.allocate(spec.num_layers, ids.shape[0], 32, spec.num_kv_heads, spec.head_dim,
                             device=torch.device("cpu"), dtype=torch.float32)  # fmt: skip
    pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    with torch.no_grad():
        prefill = runner.forward(ids[:, :7], pos[:, :7], cache.k, cache.v, prefill=True)
        decode = runner.forward(ids[:, 7:8], pos[:, 7:8], cache.k, cache.v)
        verify = runner.forward(ids[:, 8:], pos[:, 8:], cache.k, cache.v)
    assert prefill.logits is not None and decode.logits is not None and verify.logits is not None
    return torch.cat([prefill.logits, decode.logits, verify.logits], dim=1)


def test_fused_logits_equal_the_policys_own(tiny_arch_model: PreTrainedModel) -> None:
    """Qwen2 (q, k, v biases), Llama and Qwen3 (none; Qwen3's per-head norms after the split)."""
    ids = torch.randint(0, tiny_arch_model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    plain = _forward_all(ModelRunner(tiny_arch_model), ids)
    fused_runner = ModelRunner(tiny_arch_model, fuse_projections=True)
    fused = _forward_all(fused_runner, ids)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ref = tiny_arch_model(ids).logits
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    layer = tiny_arch_model.model.layers[0]
    per_layer = sum(p.numel() for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                                        layer.mlp.gate_proj, layer.mlp.up_proj) for p in m.parameters())  # fmt: skip
    assert fused_runner.fused_bytes == 4 * per_layer * len(tiny_arch_model.model.layers)  # float32 copies
    assert ModelRunner(tiny_arch_model).fused_bytes == 0


def test_fused_engine_rollouts_equal_the_plain_engines() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    ref = RolloutEngine(model, max_seq_len=32, max_batch_size=2).generate(PROMPTS, GREEDY)
    out = RolloutEngine(model, max_seq_len=32, max_batch_size=2, fuse_projections=True).generate(PROMPTS, GREEDY)
    assert out.completion_ids == ref.completion_ids


@pytest.mark.parametrize("optimizer", ["foreach", "fused"])
def test_an_optimizer_step_on_the_policy_reaches_the_fused_weights(optimizer: str) -> None:
    model = build_model("qwen2", "tiny", seed=0)
    engine = RolloutEngine(model, max_seq_len=32, max_batch_size=2, fuse_projections=True)
    engine.generate(PROMPTS, GREEDY)
    runner = engine.runner
    assert runner is not None and runner.fused is not None
    fused = runner.fused[0]
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, **{optimizer: True})
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    model.train()
    model(ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    q = model.model.layers[0].self_attn.q_proj.weight
    # stale until the next generate (the fused step does not even advance the version counter)...
    assert not torch.equal(fused.qkv_weight[: q.shape[0]], q)
    after = engine.generate(PROMPTS, GREEDY)  # ... which refreshes it
    assert torch.equal(fused.qkv_weight[: q.shape[0]], q)
    fresh = RolloutEngine(model, max_seq_len=32, max_batch_size=2).generate(PROMPTS, GREEDY)
    assert after.completion_ids == fresh.completion_ids


def test_replaced_weights_are_seen_and_a_training_forward_keeps_autograd() -> None:
    model = build_model("llama", "tiny", seed=0)
    layer = model.model.layers[1]
    fused = FusedProjections(layer)
    address = fused.gate_up_weight.data_ptr()
    layer.mlp.up_proj.weight = torch.nn.Parameter(layer.mlp.up_proj.weight.detach() * 2.0)  # new storage
    fused.sync()
    assert fused.gate_up_weight.data_ptr() == address  # copied in place: captured graphs stay valid
    half = layer.mlp.gate_proj.weight.shape[0]
    assert torch.equal(fused.gate_up_weight[half:], layer.mlp.up_proj.weight)
    runner = ModelRunner(model, fuse_projections=True)
    ids = torch.tensor([[5, 6, 7, 8]])
    out = runner.forward(ids, torch.arange(4)[None], [None] * runner.spec.num_layers,
                         [None] * runner.spec.num_layers, prefill=True)  # fmt: skip
    assert out.logits is not None
    out.logits.sum().backward()  # with grad enabled the policy's own weights are used
    assert layer.self_attn.q_proj.weight.grad is not None and runner.fused is None


def test_compiled_fused_engine_matches_eager() -> None:
    model = build_model("qwen3", "tiny", seed=0)
    ref = RolloutEngine(model, max_seq_len=32, max_batch_size=2).generate(PROMPTS, GREEDY)
    spec = SpeculativeConfig(method="suffix", num_draft_tokens=3, threshold=1, hysteresis_steps=1)
    engine = RolloutEngine(model, max_seq_len=32, max_batch_size=2, compile=True, speculative=spec,
                           fuse_projections=True)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = engine.generate(PROMPTS, GREEDY)
    assert not [w for w in caught if "compile" in str(w.message) and "failed" in str(w.message)]
    assert engine.compiled and out.completion_ids == ref.completion_ids
    with torch.no_grad():  # an in-place change between calls: the compiled steps read the refreshed copy
        model.model.layers[0].mlp.gate_proj.weight.mul_(-1.0)
    again = engine.generate(PROMPTS, GREEDY)
    assert again.completion_ids == RolloutEngine(model, max_seq_len=32, max_batch_size=2).generate(
        PROMPTS, GREEDY).completion_ids  # fmt: skip


def test_a_policy_moved_to_another_dtype_gets_new_fused_weights() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    engine = RolloutEngine(model, max_seq_len=32, max_batch_size=2, fuse_projections=True, compile=False)
    engine.generate(PROMPTS, GREEDY)
    runner = engine.runner
    assert runner is not None and runner.fused is not None and runner.fused[0].qkv_weight.dtype == torch.float32
    model.to(torch.float64)
    runner.sync_fused()
    assert runner.fused[0].matches(model.model.layers[0]) and runner.fused[0].qkv_weight.dtype == torch.float64
    torch.testing.assert_close(runner.fused[0].gate_up_weight[: model.config.intermediate_size],
                               model.model.layers[0].mlp.gate_proj.weight, rtol=0, atol=0)  # fmt: skip


def test_mlp_biases_and_replaced_layers_are_fused_too() -> None:
    """Llama's ``mlp_bias`` (gate and up biases), and a decoder layer swapped for another object."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, mlp_bias=True, attention_bias=True)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.bias.normal_(0, 0.5)
            layer.mlp.up_proj.bias.normal_(0, 0.5)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    fused_runner = ModelRunner(model, fuse_projections=True)
    torch.testing.assert_close(_forward_all(fused_runner, ids), _forward_all(ModelRunner(model), ids),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
    other = LlamaForCausalLM(config).eval()
    model.model.layers[1] = other.model.layers[1]  # a new layer object: its weights, not the old copy's
    fused_runner.sync_fused()
    torch.testing.assert_close(_forward_all(fused_runner, ids), _forward_all(ModelRunner(model), ids),
                               rtol=1e-5, atol=1e-5)  # fmt: skip
