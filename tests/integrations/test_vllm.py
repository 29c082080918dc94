"""`VLLMRolloutEngine` against a real vLLM on the CPU, and its pure mappings everywhere.

The ``vllm``-marked tests run in their own virtual environment (``.ci/run-vllm``: ``vllm-cpu``,
``VLLM_CPU_KVCACHE_SPACE=1``) and skip with the reason elsewhere. Each test class starts one
``vllm.LLM`` (about 20-35 s on a busy 2-core CPU) and shuts it down when the class is done.
The unmarked tests (schedules, configs, weight encoding, rescoring) need no vLLM.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.integrations.vllm import (
    INSTALL_HINT,
    decode_weights,
    draft_schedule,
    encode_weights,
    import_vllm,
    make_engine,
    policy_logprobs,
    sampling_params_kwargs,
    speculative_config,
)
from lightning_tlt.models.tokenizer import build_tokenizer
from lightning_tlt.models.zoo import build_model

HAS_VLLM = importlib.util.find_spec("vllm") is not None
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = [[1, 40, 41, 42, 43], [1, 50, 51], [1, 60, 61, 62, 63, 64, 65]]
GREEDY = SamplingConfig(temperature=0.0, max_new_tokens=16, stop_token_ids=[])
ENGINE_KW = dict(max_seq_len=128, gpu_memory_utilization=0.3, enforce_eager=True, dtype="float32")


# ---------------------------------------------------------------------------- helpers
def hf_greedy(model: PreTrainedModel, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF ``generate`` greedy completions, no stop token."""
    out = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(ids[0, len(p) :].tolist())
    return out


def write_eagle_layout(target: PreTrainedModel, path: Path, *, seed: int, perfect: bool = False) -> Path:
    """An EAGLE-1 draft directory in the layout vLLM loads (shared/notes/environment.md).

    ``perfect=True`` writes the drafter that predicts a "bigram" target (see `bigram_target`)
    exactly: ``fc = [I, 0]`` passes the next token's embedding through, and the layer adds
    nothing (zero ``o_proj`` and ``down_proj``), so the draft's logits are ``lm_head(embed(t))``,
    whose argmax is the bigram target's (its final RMSNorm, with unit weights, only rescales).
    """
    c = target.config
    h, inter = c.hidden_size, c.intermediate_size
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or h // nh
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    w = {
        "fc.weight": rand(h, 2 * h),
        "layers.0.self_attn.q_proj.weight": rand(nh * hd, h),
        "layers.0.self_attn.k_proj.weight": rand(nkv * hd, h),
        "layers.0.self_attn.v_proj.weight": rand(nkv * hd, h),
        "layers.0.self_attn.o_proj.weight": rand(h, nh * hd),
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
        "layers.0.mlp.gate_proj.weight": rand(inter, h),
        "layers.0.mlp.up_proj.weight": rand(inter, h),
        "layers.0.mlp.down_proj.weight": rand(h, inter),
    }
    bias = c.model_type == "qwen2"  # Qwen2's q/k/v biases: the Llama draft takes attention_bias (o_proj too)
    if bias:
        w["layers.0.self_attn.q_proj.bias"] = rand(nh * hd)
        w["layers.0.self_attn.k_proj.bias"] = rand(nkv * hd)
        w["layers.0.self_attn.v_proj.bias"] = rand(nkv * hd)
        w["layers.0.self_attn.o_proj.bias"] = torch.zeros(h)
    if perfect:
        w["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        w["layers.0.self_attn.o_proj.weight"].zero_()
        w["layers.0.mlp.down_proj.weight"].zero_()
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, path / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": 10000.0,
        "attention_bias": bias,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def export_drafter(target: PreTrainedModel, path: Path) -> Path:
    """The cold drafter exported by the kit's ``EagleDrafter`` when it is there, else the layout above."""
    try:
        from lightning_tlt.drafters.eagle import EagleDrafter
    except ImportError:
        return write_eagle_layout(target, path, seed=0)
    drafter = EagleDrafter.from_target(target)
    drafter.save_pretrained(path)
    return path


def bigram_target(model: PreTrainedModel) -> PreTrainedModel:
    """A copy whose layers write nothing to the residual stream: ``logits = lm_head(norm(embed(t)))``."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


# ---------------------------------------------------------------------------- pure mappings (no vLLM)
def test_draft_schedule_fixed_k_gates_at_threshold() -> None:
    spec = SpeculativeConfig(method="suffix", num_draft_tokens=3, threshold=32)
    assert draft_schedule(spec) == [(1, 32, 3), (33, 33, 0)]


def test_draft_schedule_spreads_candidates_over_tlt_buckets() -> None:
    spec = SpeculativeConfig(method="suffix", threshold=32)  # candidates (2, 4, 6, 8)
    assert draft_schedule(spec) == [(1, 1, 8), (2, 4, 6), (5, 20, 4), (21, 32, 2), (33, 33, 0)]
    small = SpeculativeConfig(method="suffix", threshold=3, draft_candidates=(5,))
    assert draft_schedule(small) == [(1, 1, 5), (2, 3, 5), (4, 4, 0)]
    with pytest.raises(ValueError, match="method='none'"):
        draft_schedule(SpeculativeConfig())


def test_speculative_config_maps_methods(tmp_path: Path) -> None:
    assert speculative_config(None) is None
    assert speculative_config(SpeculativeConfig(method="none")) is None
    ngram = speculative_config(SpeculativeConfig(method="suffix", num_draft_tokens=3, threshold=8))
    assert ngram == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
        "num_speculative_tokens_per_batch_size": [(1, 8, 3), (9, 9, 0)],
    }
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(
        SpeculativeConfig(method="suffix"), dynamic=False
    )
    with pytest.raises(ValueError, match="drafter_path=None"):
        speculative_config(SpeculativeConfig(method="eagle"))
    with pytest.raises(ValueError, match="config.json"):
        speculative_config(SpeculativeConfig(method="eagle", drafter_path=str(tmp_path)))
    (tmp_path / "config.json").write_text("{}")
    eagle = speculative_config(SpeculativeConfig(method="eagle", drafter_path=str(tmp_path)))
    assert eagle is not None
    assert (eagle["method"], eagle["model"], eagle["num_speculative_tokens"]) == ("eagle", str(tmp_path), 8)


def test_sampling_params_kwargs() -> None:
    kw = sampling_params_kwargs(
        SamplingConfig(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5), 4, 123, [2]
    )
    assert kw == {
        "n": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_tokens": 5,
        "stop_token_ids": [2],
        "ignore_eos": True,
        "logprobs": 0,
        "seed": 123,
        "detokenize": False,
    }
    assert sampling_params_kwargs(SamplingConfig(top_k=7), 1, 0, [])["top_k"] == 7
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        sampling_params_kwargs(SamplingConfig(), 0, 0, [])


def test_weights_roundtrip_is_exact() -> None:
    model = build_model("qwen2", "tiny", seed=3)
    weights = [(n, p.detach()) for n, p in model.named_parameters()]
    back = decode_weights(encode_weights(weights))
    assert sorted(n for n, _ in back) == sorted(n for n, _ in weights)
    ref = dict(weights)
    assert all(torch.equal(t, ref[n]) for n, t in back)
    assert decode_weights(weights) == weights  # in-process payloads pass through


def test_policy_logprobs_match_a_hand_computation() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    prompts, completions = [[1, 40, 41], [1, 50, 51, 52, 53]], [[7, 8, 9, 10], [11]]
    sampling = SamplingConfig(temperature=0.5, top_k=0)
    got = policy_logprobs(model, prompts, completions, sampling, batch_size=2)  # padded together
    for p, c, lp in zip(prompts, completions, got):
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1] / 0.5
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lp), want, atol=1e-5, rtol=0)


def test_make_engine_rejects_unknown_kinds() -> None:
    model = build_model("qwen2", "tiny", seed=0)
    with pytest.raises(ValueError, match="engine must be 'native' or 'vllm', got 'sglang'"):
        make_engine("sglang", model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs the policy module"):
        make_engine("native", "/some/path", max_seq_len=64)
    native = make_engine("native", model, max_seq_len=64)
    assert type(native).__name__ == "RolloutEngine"
    out = native.generate([[1, 40]], SamplingConfig(temperature=0.0, max_new_tokens=4, stop_token_ids=[]))
    assert out.completion_ids == hf_greedy(model, [[1, 40]], 4)


def test_the_vllm_backend_checks_positions_and_stop_ids_as_the_native_engine_does() -> None:
    from lightning_tlt.core.prompts import PositionLimit
    from lightning_tlt.rollout.vllm_engine import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)  # its input checks only: no vllm.LLM behind it
    engine.vocab_size, engine.max_seq_len, engine.eos_ids = 128, 64, [2]
    engine.positions = PositionLimit(24, None)
    assert engine.validate([[1, 2]], SamplingConfig(max_new_tokens=4), 2) == [[1, 2]]
    with pytest.raises(ValueError, match=r"prompt 0 has 30 tokens; with max_new_tokens=4 that is 34 > the policy's "
                                         r"max_position_embeddings=24"):
        engine.validate([[1] * 30], SamplingConfig(max_new_tokens=4), 1)
    with pytest.raises(ValueError, match=r"stop token id 128 is outside the vocabulary \[0, 128\)"):
        engine.validate([[1, 2]], SamplingConfig(max_new_tokens=4, stop_token_ids=[128]), 1)


def test_the_vllm_backend_is_a_drafter_host_that_refuses_a_non_finite_drafter(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_tlt.core.types import DrafterHost
    from lightning_tlt.drafters.eagle import EagleDrafter
    from lightning_tlt.rollout.vllm_engine import VLLMRolloutEngine

    engine = object.__new__(VLLMRolloutEngine)  # the publishing only: the push to vLLM is recorded
    engine.last_stats = {}
    assert engine.drafter is None and engine.drafter_version == 0  # nothing published yet
    pushed: list[EagleDrafter] = []
    monkeypatch.setattr(engine, "update_drafter_weights", lambda d: pushed.append(d) or 1)
    assert isinstance(engine, DrafterHost) and engine.draft_vocab_ids() is None
    target = build_model("qwen2", "tiny", seed=0)
    drafter = EagleDrafter.from_target(target, generator=torch.Generator().manual_seed(3))
    assert engine.set_drafter(drafter, 7) and engine.drafter_version == 7
    copy = engine.drafter
    assert isinstance(copy, EagleDrafter) and copy is not drafter and pushed == [copy]  # a frozen copy is pushed
    assert not any(p.requires_grad for p in copy.parameters())
    with torch.no_grad():
        drafter.fc.weight[0, 0] = float("nan")
    with pytest.warns(UserWarning, match=r"refusing to publish a drafter with non-finite weights \(fc.weight"):
        assert not engine.set_drafter(drafter)
    assert engine.drafter_version == 7 and len(pushed) == 1 and bool(torch.isfinite(copy.fc.weight).all())
    with torch.no_grad():
        drafter.fc.weight[0, 0] = 0.5
    assert engine.set_drafter(drafter) and engine.drafter_version == 8 and engine.drafter is copy  # copied in place
    assert copy.fc.weight[0, 0].item() == 0.5
    with pytest.raises(TypeError, match="set_drafter takes an EagleDrafter, got str"):
        engine.set_drafter("drafter")


def test_missing_vllm_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install lightning-tlt\[vllm\]"):
        import_vllm()
    assert "lightning-tlt[vllm]" in INSTALL_HINT


# ---------------------------------------------------------------------------- real vLLM (CPU)
@pytest.fixture(scope="class")
def policy() -> PreTrainedModel:
    return build_model("qwen2", "tiny", seed=0)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (its tests run in .ci/run-vllm's venv)")
class TestPlainEngine:
    @pytest.fixture(scope="class")
    def engine(self, policy: PreTrainedModel):
        from lightning_tlt.integrations.vllm import VLLMRolloutEngine

        engine = VLLMRolloutEngine(policy, build_tokenizer(), **ENGINE_KW)
        yield engine
        engine.close()

    def test_same_structure_and_greedy_output_as_native_engine(self, engine, policy) -> None:
        from lightning_tlt.rollout.engine import RolloutEngine

        out = engine.generate(PROMPTS, GREEDY, num_samples=2)
        native = RolloutEngine(policy, max_seq_len=128).generate(PROMPTS, GREEDY, num_samples=2)
        assert len(out) == 6
        assert out.prompt_ids == native.prompt_ids == [p for p in PROMPTS for _ in range(2)]
        assert out.completion_ids == native.completion_ids
        assert out.finish_reasons == native.finish_reasons == ["length"] * 6
        assert out.logprobs == native.logprobs == [[0.0] * 16] * 6  # greedy: one-hot distribution
        assert out.completion_ids[::2] == hf_greedy(policy, PROMPTS, 16)
        assert out.stats["tokens"] == 96.0 and out.stats["tokens_per_s"] > 0
        assert (Path(engine.model_path) / "tokenizer.json").is_file()  # saved beside the weights

    def test_stop_token_ends_and_is_kept(self, engine, policy) -> None:
        ref = hf_greedy(policy, PROMPTS[:1], 16)[0]
        stop = ref[3]
        cut = ref.index(stop) + 1
        out = engine.generate(
            PROMPTS[:1], SamplingConfig(temperature=0.0, max_new_tokens=16, stop_token_ids=[stop])
        )
        assert out.completion_ids == [ref[:cut]] and out.finish_reasons == ["stop"]

    def test_sampled_logprobs_are_the_processed_distribution(self, engine, policy) -> None:
        sampling = SamplingConfig(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=12)
        out = engine.generate(PROMPTS, sampling, num_samples=3, generator=torch.Generator().manual_seed(0))
        want = policy_logprobs(policy, out.prompt_ids, out.completion_ids, sampling)
        got = torch.tensor([x for row in out.logprobs for x in row])
        torch.testing.assert_close(got, torch.tensor([x for row in want for x in row]), atol=2e-3, rtol=0)
        assert math.isclose(sum(len(c) for c in out.completion_ids), out.stats["tokens"])
        again = engine.generate(PROMPTS, sampling, num_samples=3, generator=torch.Generator().manual_seed(0))
        other = engine.generate(PROMPTS, sampling, num_samples=3, generator=torch.Generator().manual_seed(1))
        assert again.completion_ids == out.completion_ids  # same seed, same rollouts
        assert other.completion_ids != out.completion_ids
        assert len({tuple(c) for c in out.completion_ids[:3]}) > 1  # the 3 samples of a prompt differ

    def test_prompt_validation_and_adaptive_state_as_the_native_engine(self, engine) -> None:
        with pytest.raises(TypeError, match=r"prompt 0 has 2\.5 \(float\) at position 1"):
            engine.generate([[1, 2.5]], GREEDY)
        assert engine.adaptive_state_dict() == {}  # what a datamodule checkpoints for this engine
        engine.load_adaptive_state_dict({"gate": {"on": True, "streak": 0, "switches": 1}, "tuner": None})

    def test_sleep_is_a_warned_no_op_on_cpu(self, engine) -> None:
        with pytest.warns(UserWarning, match="sleep"):
            engine.sleep()
        assert not engine.is_sleeping
        assert len(engine.generate(PROMPTS[:1], GREEDY)) == 1

    def test_policy_update_is_reflected(self, engine, policy) -> None:
        new = build_model("qwen2", "tiny", seed=1)
        before = engine.generate(PROMPTS, GREEDY).completion_ids
        assert engine.update_policy_weights(new) == len(list(new.parameters()))
        after = engine.generate(PROMPTS, GREEDY)
        assert after.completion_ids == hf_greedy(new, PROMPTS, 16) != before
        assert after.stats["policy_version"] == 1.0
        engine.update_policy_weights(policy)  # and back
        assert engine.generate(PROMPTS, GREEDY).completion_ids == before

    def test_in_place_optimizer_updates_are_followed(self, engine, policy) -> None:
        before = engine.generate(PROMPTS, GREEDY)
        original = {k: v.clone() for k, v in policy.state_dict().items()}
        new = build_model("qwen2", "tiny", seed=2)
        optimizer = torch.optim.SGD(policy.parameters(), lr=1.0)
        for p, q in zip(policy.parameters(), new.parameters()):
            p.grad = p.detach() - q.detach()  # one SGD step of lr 1 lands exactly on `new`
        optimizer.step()
        after = engine.generate(PROMPTS, GREEDY)  # auto_sync pushes the stepped weights first
        assert after.completion_ids == hf_greedy(new, PROMPTS, 16) != before.completion_ids
        assert after.stats["policy_version"] == before.stats["policy_version"] + 1
        policy.load_state_dict(original)
        assert engine.generate(PROMPTS, GREEDY).completion_ids == before.completion_ids


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (its tests run in .ci/run-vllm's venv)")
def test_a_sharded_policy_reaches_vllm_through_its_weight_loading(tmp_path: Path) -> None:
    """FSDP2 on one rank (gloo): vLLM starts from the config on dummy weights, the gathered policy is pushed at
    once and after an optimizer step on the shards; greedy rollouts are the unsharded twin's, token for token."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_tlt.integrations.vllm import VLLMRolloutEngine
    from lightning_tlt.rl.fsdp import shard_module

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        policy = build_model("qwen2", "tiny", seed=0)
        twin = copy.deepcopy(policy)
        shard_module(policy, init_device_mesh("cpu", (1,)))
        engine = VLLMRolloutEngine(policy, build_tokenizer(), **ENGINE_KW)
        try:
            assert not list(Path(engine.model_path).glob("*.safetensors"))  # the config only: no rank has it whole
            assert engine.policy_version == 1  # the gathered weights, pushed before the first rollout
            assert engine.generate(PROMPTS, GREEDY).completion_ids == hf_greedy(twin, PROMPTS, 16)
            new = build_model("qwen2", "tiny", seed=2)
            for model in (policy, twin):  # one SGD step of lr 1 lands exactly on `new`, shards and twin alike
                optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
                for p, q in zip(model.parameters(), new.parameters()):
                    p.grad = p.detach() - (q.detach() if not hasattr(p, "device_mesh") else
                                           torch.distributed.tensor.distribute_tensor(q.detach(), p.device_mesh,
                                                                                     p.placements))  # fmt: skip
                optimizer.step()
            after = engine.generate(PROMPTS, GREEDY)  # auto_sync: the shards moved, the gather is pushed
            assert after.stats["policy_version"] == 2.0
            assert after.completion_ids == hf_greedy(twin, PROMPTS, 16) == hf_greedy(new, PROMPTS, 16)
        finally:
            engine.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (its tests run in .ci/run-vllm's venv)")
class TestEagleEngine:
    @pytest.fixture(scope="class")
    def engine(self, policy: PreTrainedModel, tmp_path_factory: pytest.TempPathFactory):
        from lightning_tlt.integrations.vllm import VLLMRolloutEngine

        path = export_drafter(policy, tmp_path_factory.mktemp("drafter"))
        spec = SpeculativeConfig(method="eagle", drafter_path=str(path), num_draft_tokens=3)
        engine = VLLMRolloutEngine(policy, speculative=spec, **ENGINE_KW)
        yield engine
        engine.close()

    def test_exported_drafter_loads_and_greedy_matches_plain(self, engine, policy) -> None:
        out = engine.generate(PROMPTS, GREEDY)
        assert out.completion_ids == hf_greedy(policy, PROMPTS, 16)
        assert out.stats["spec_draft_tokens"] > 0  # the draft model proposed tokens
        assert out.stats["spec_draft_tokens"] == 3 * out.stats["spec_drafts"]

    def test_drafter_update_reaches_the_draft_model(self, engine, policy, tmp_path: Path) -> None:
        target = bigram_target(policy)
        engine.update_policy_weights(target)
        ref = hf_greedy(target, PROMPTS, 16)
        cold = engine.generate(PROMPTS, GREEDY)
        assert cold.completion_ids == ref
        assert cold.stats["spec_acceptance_rate"] < 0.2  # a random drafter
        engine.update_drafter_weights(write_eagle_layout(target, tmp_path / "perfect", seed=1, perfect=True))
        hot = engine.generate(PROMPTS, GREEDY)
        assert hot.completion_ids == ref  # speculation never changes what is sampled
        assert hot.stats["spec_accepted_tokens"] == hot.stats["spec_draft_tokens"] > 0  # every draft accepted
        assert hot.stats["spec_accept_len"] == 4.0 and hot.stats["drafter_version"] == 1.0
        # every row-step after the prefill drafts
        assert hot.stats["spec_fraction"] > 0.9

    def test_publish_drafter_protocol_pushes_the_drafter(self, engine, policy) -> None:
        from lightning_tlt.callbacks.drafter_cotrain import publish_drafter
        from lightning_tlt.drafters.eagle import EagleDrafter

        target = bigram_target(policy)
        engine.update_policy_weights(target)
        drafter = EagleDrafter.from_target(target, generator=torch.Generator().manual_seed(3))
        engine.update_drafter_weights(drafter)  # a cold drafter, from the module
        cold = engine.generate(PROMPTS, GREEDY)
        assert cold.stats["spec_acceptance_rate"] < 0.2
        h = target.config.hidden_size
        with torch.no_grad():  # the perfect drafter of the bigram target (see write_eagle_layout)
            drafter.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
            drafter.layers[0].self_attn.o_proj.weight.zero_()
            drafter.layers[0].self_attn.o_proj.bias.zero_()
            drafter.layers[0].mlp.down_proj.weight.zero_()
        publish_drafter(engine, drafter, version=7)
        hot = engine.generate(PROMPTS, GREEDY)
        assert hot.completion_ids == cold.completion_ids == hf_greedy(target, PROMPTS, 16)
        assert hot.stats["spec_accepted_tokens"] == hot.stats["spec_draft_tokens"] > 0
        assert engine.drafter_version == 7 and hot.stats["drafter_version"] == 7.0

    def test_sampled_logprobs_are_finite_policy_logprobs(self, engine) -> None:
        sampling = SamplingConfig(temperature=1.0, max_new_tokens=8)
        out = engine.generate(PROMPTS, sampling, num_samples=2, generator=torch.Generator().manual_seed(0))
        flat = torch.tensor([x for row in out.logprobs for x in row])
        assert torch.isfinite(flat).all() and (flat < 0).all()
        assert [len(r) for r in out.logprobs] == [len(c) for c in out.completion_ids]


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (its tests run in .ci/run-vllm's venv)")
class TestNgramEngine:
    @pytest.fixture(scope="class")
    def engine(self, policy: PreTrainedModel):
        from lightning_tlt.integrations.vllm import VLLMRolloutEngine

        # this one runs vLLM inside the test process (TRL's colocate setup): weights travel as tensors
        previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        spec = SpeculativeConfig(method="suffix", num_draft_tokens=3, threshold=2)
        try:
            engine = VLLMRolloutEngine(
                policy, speculative=spec, distributed_executor_backend="uni", **ENGINE_KW
            )
            yield engine
            engine.close()
        finally:
            if previous is None:
                os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous

    def test_ngram_greedy_matches_plain_and_speculates(self, engine, policy) -> None:
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=32, stop_token_ids=[])
        out = engine.generate(PROMPTS[:1], sampling)
        assert out.completion_ids == hf_greedy(policy, PROMPTS[:1], 32)
        assert out.stats["spec_accepted_tokens"] > 0  # the greedy output repeats itself: lookups hit

    def test_gate_stops_drafting_above_threshold(self, engine, policy) -> None:
        sampling = SamplingConfig(temperature=0.0, max_new_tokens=32, stop_token_ids=[])
        out = engine.generate(PROMPTS, sampling)  # 3 rows > threshold 2 for the whole call
        assert out.completion_ids == hf_greedy(policy, PROMPTS, 32)
        assert out.stats["spec_draft_tokens"] == 0.0 and out.stats["spec_fraction"] == 0.0

    def test_in_process_policy_update(self, engine, policy) -> None:
        assert engine.in_process  # tensors handed over as they are, no serialisation
        new = build_model("qwen2", "tiny", seed=4)
        engine.update_policy_weights(new)
        assert engine.generate(PROMPTS, GREEDY).completion_ids == hf_greedy(new, PROMPTS, 16)
        engine.update_policy_weights(policy)
        assert engine.generate(PROMPTS, GREEDY).completion_ids == hf_greedy(policy, PROMPTS, 16)


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (its tests run in .ci/run-vllm's venv)")
def test_grpo_trainer_rolls_out_on_vllm_and_follows_the_optimizer(tmp_path: Path) -> None:
    """A real `Trainer` (2 GRPO steps) whose datamodule's engine is vLLM: rollouts of step 2 come
    from the weights after step 1's optimizer step (auto-sync), with no hook in the RL code."""
    import lightning.pytorch as pl

    from lightning_tlt.data.datamodule import RolloutDataModule
    from lightning_tlt.integrations.vllm import VLLMRolloutEngine
    from lightning_tlt.rl.config import GRPOConfig
    from lightning_tlt.rl.grpo import GRPOModule

    class VLLMDataModule(RolloutDataModule):
        vllm_engine: VLLMRolloutEngine | None = None

        @property
        def engine(self) -> VLLMRolloutEngine:  # type: ignore[override]
            if self.vllm_engine is None:
                self.vllm_engine = VLLMRolloutEngine(self.policy, max_batch_size=8, **ENGINE_KW)
            return self.vllm_engine

    def digits(completions: list[str], **kwargs: object) -> list[float]:
        return [sum(ch.isdigit() for ch in c) / max(1, len(c)) for c in completions]

    config = GRPOConfig(
        num_generations=4, max_completion_length=12, learning_rate=3e-3, lr_scheduler_type="constant"
    )
    module = GRPOModule(build_model("qwen2", "tiny", seed=0), config)
    data = VLLMDataModule("arithmetic", [digits], prompts_per_step=2, task_size=32, seed=0)
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
    )
    try:
        trainer.fit(module, datamodule=data)
        engine = data.vllm_engine
        assert engine is not None and module.global_step == 2
        moved = max((before[k] - v).abs().max().item() for k, v in module.policy.state_dict().items())
        assert moved > 1e-4
        assert (
            engine.policy_version == 1
        )  # pushed once: after step 1's optimizer step, before step 2's rollouts
        policy = copy.deepcopy(module.policy).eval()
        out = engine.generate(PROMPTS, GREEDY)  # and the trained weights after step 2
        assert out.completion_ids == hf_greedy(policy, PROMPTS, 16)
    finally:
        if data.vllm_engine is not None:
            data.vllm_engine.close()
