"""EagleDrafter: shapes, shared-by-reference weights, alignment, parity with HF and the runner, export layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from lightning_tlt.core.runner import decoder_layer, rope_cos_sin
from lightning_tlt.core.sampling import processed_probs
from lightning_tlt.drafters.base import Drafter
from lightning_tlt.drafters.eagle import EagleDrafter, align_for_eagle, default_eagle3_layers
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.verify import verify_chain

VLLM_EAGLE1_TENSORS = {
    "fc.weight",
    "layers.0.self_attn.q_proj.weight",
    "layers.0.self_attn.k_proj.weight",
    "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight",
    "layers.0.post_attention_layernorm.weight",
    "layers.0.mlp.gate_proj.weight",
    "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight",
}
BIASES = {f"layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}


def _drafter(model: torch.nn.Module, **kwargs: object) -> EagleDrafter:
    drafter = EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(1), **kwargs)  # type: ignore[arg-type]
    with torch.no_grad():  # a non-trivial norm weight, so parity tests exercise it
        drafter.layers[0].post_attention_layernorm.weight.uniform_(
            0.5, 1.5, generator=torch.Generator().manual_seed(2)
        )
    return drafter


def _policy_features(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return model(tokens, output_hidden_states=True).hidden_states


def test_shapes_and_protocol(tiny_qwen2: torch.nn.Module) -> None:
    drafter = _drafter(tiny_qwen2)
    assert isinstance(drafter, Drafter) and drafter.name == "eagle" and drafter.needs_features
    hidden, vocab = tiny_qwen2.config.hidden_size, tiny_qwen2.config.vocab_size
    assert tuple(drafter.fc.weight.shape) == (hidden, 2 * hidden)
    assert drafter.fuse is None and len(drafter.layers) == 1
    assert not hasattr(drafter.layers[0], "input_layernorm")
    tokens = torch.randint(0, vocab, (3, 9), generator=torch.Generator().manual_seed(0))
    feats = _policy_features(tiny_qwen2, tokens)[-1]
    pred = drafter(feats[:, :-1], tokens[:, 1:], torch.arange(8).expand(3, 8))
    assert pred.shape == (3, 8, hidden)
    assert drafter.logits(pred).shape == (3, 8, vocab)


def test_embedding_and_head_shared_by_reference_and_never_trained() -> None:
    policy = build_model("qwen2", "tiny", seed=0)
    drafter = _drafter(policy)
    embed, head = policy.model.embed_tokens.weight, policy.lm_head.weight
    assert drafter.embed_weight.data_ptr() == embed.data_ptr()
    assert drafter.lm_head_weight.data_ptr() == head.data_ptr()
    assert not drafter.embed_weight.requires_grad and not drafter.lm_head_weight.requires_grad
    assert embed.requires_grad and head.requires_grad  # the policy itself still trains them
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names)
    param_ids = {id(p) for p in drafter.parameters()}
    assert id(embed) not in param_ids and id(head) not in param_ids
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    # a few drafter optimizer steps on the drafter's own loss
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-2)
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    hidden = _policy_features(policy, tokens)[-1]
    batch = align_for_eagle(hidden, tokens, torch.ones_like(tokens))
    first_loss = None
    for _ in range(5):
        pred = drafter(batch.features, batch.input_ids, batch.position_ids)
        loss = (
            torch.nn.functional.smooth_l1_loss(pred, batch.target_features)
            + drafter.logits(pred).logsumexp(-1).mean() * 0.01
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        first_loss = first_loss if first_loss is not None else float(loss.detach())
    assert float(loss.detach()) < first_loss  # the drafter did train
    for n, p in policy.named_parameters():
        assert p.grad is None, n
        assert torch.equal(p, before[n]), n
    # the same storage is still shared after training
    assert drafter.embed_weight.data_ptr() == policy.model.embed_tokens.weight.data_ptr()


def test_align_for_eagle_convention() -> None:
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    feats = torch.arange(5.0).view(1, 5, 1).expand(1, 5, 4)  # feature t has value t
    mask = torch.tensor([[0, 0, 1, 1, 0]])  # prompt of 2, completion of 2, one pad
    batch = align_for_eagle(feats, tokens, mask)
    assert batch.features[0, :, 0].tolist() == [0, 1, 2, 3]  # h_t
    assert batch.input_ids[0].tolist() == [11, 12, 13, 14]  # x_{t+1}
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3]  # t
    assert batch.target_features[0, :, 0].tolist() == [1, 2, 3, 4]  # h_{t+1}
    # rows whose input token is a completion token: the first completion token pairs with the
    # last prompt feature (exactly what the engine does after prefill)
    assert batch.loss_mask[0].tolist() == [False, True, True, False]
    with pytest.raises(ValueError, match="must agree"):
        align_for_eagle(feats, tokens[:, :4], mask)


def test_row_t_reads_feature_t_and_token_t_plus_1_only(tiny_llama: torch.nn.Module) -> None:
    drafter = _drafter(tiny_llama)
    gen = torch.Generator().manual_seed(4)
    feats = torch.randn(1, 6, 128, generator=gen)
    ids = torch.randint(0, 100, (1, 6), generator=gen)
    pos = torch.arange(6)[None]
    base = drafter(feats, ids, pos)
    # row 0 attends to itself only: fc -> o_proj(v) -> MLP, computed by hand
    layer = drafter.layers[0]
    x0 = drafter.fc(torch.cat([tiny_llama.model.embed_tokens.weight[ids[0, 0]], feats[0, 0]]))
    v0 = layer.self_attn.v_proj(x0).view(1, 64).repeat(2, 1).view(128)  # 1 KV head shared by 2 heads
    x0 = x0 + layer.self_attn.o_proj(v0)
    h0 = layer.post_attention_layernorm(x0)
    mlp = layer.mlp
    x0 = x0 + mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(h0)) * mlp.up_proj(h0))
    torch.testing.assert_close(base[0, 0], x0, atol=1e-5, rtol=1e-5)
    # causality: changing row 3's feature or token changes rows >= 3 only
    for changed in (feats.clone(), ids.clone()):
        if changed.dtype == torch.long:
            changed[0, 3] = (changed[0, 3] + 1) % 100
            out = drafter(feats, changed, pos)
        else:
            changed[0, 3] += 1.0
            out = drafter(changed, ids, pos)
        torch.testing.assert_close(out[:, :3], base[:, :3])
        assert (out[:, 3] - base[:, 3]).abs().max() > 1e-3


def test_forward_matches_hf_llama_layer_with_identity_input_norm(tiny_qwen2: torch.nn.Module) -> None:
    drafter = _drafter(tiny_qwen2)
    config = LlamaConfig(**{k: v for k, v in drafter.config.to_dict().items() if k != "architectures"},
                         attn_implementation="eager")  # fmt: skip
    hf_layer = LlamaDecoderLayer(config, layer_idx=0)
    hf_layer.input_layernorm = torch.nn.Identity()
    missing, unexpected = hf_layer.load_state_dict(
        {
            k.removeprefix("layers.0."): v
            for k, v in drafter.state_dict().items()
            if k.startswith("layers.0.")
        },
        strict=False,
    )
    assert missing == [] and unexpected == []
    gen = torch.Generator().manual_seed(5)
    feats = torch.randn(2, 7, 128, generator=gen)
    ids = torch.randint(0, 100, (2, 7), generator=gen)
    pos = (torch.arange(7) + 30)[None].expand(2, 7)  # a completion that starts after a prompt
    x = drafter.input_hidden(feats, ids)
    cos, sin = LlamaRotaryEmbedding(config)(x, pos)
    causal = torch.full((7, 7), float("-inf")).triu(1)[None, None].expand(2, 1, 7, 7)
    want = hf_layer(x, attention_mask=causal, position_embeddings=(cos, sin))
    torch.testing.assert_close(drafter(feats, ids, pos), want, atol=1e-5, rtol=1e-5)


def test_forward_matches_runner_cached_decoder_layer(tiny_qwen2: torch.nn.Module) -> None:
    """The engine's cached path (`runner.decoder_layer` over ``layers[0]``) equals the reference forward."""
    drafter = _drafter(tiny_qwen2)
    gen = torch.Generator().manual_seed(6)
    bsz, seq, start = 2, 6, 5
    feats = torch.randn(bsz, seq, 128, generator=gen)
    ids = torch.randint(0, 100, (bsz, seq), generator=gen)
    pos = (torch.arange(seq) + start)[None].expand(bsz, seq)
    want = drafter(feats, ids, pos)
    cache_len = start + seq
    k_cache = torch.zeros(bsz, cache_len, drafter.num_kv_heads, drafter.head_dim)
    v_cache = torch.zeros_like(k_cache)
    # the cache holds nothing before ``start``: a hole hides those keys; rows fed one at a time,
    # through both attention backends (the Triton kernel runs in Triton's CPU interpreter)
    hole = torch.tensor([[0, start]] * bsz)
    for backend in ("sdpa", "triton"):
        k_cache.zero_()
        v_cache.zero_()
        outs = []
        for t in range(seq):
            x = drafter.input_hidden(feats[:, t : t + 1], ids[:, t : t + 1])
            p = pos[:, t : t + 1]
            cos, sin = rope_cos_sin(p, drafter.inv_freq, drafter.rope_scaling, x.dtype)
            outs.append(
                decoder_layer(
                    drafter.layers[0], x, cos, sin, p, k_cache, v_cache,
                    num_heads=drafter.num_heads, num_kv_heads=drafter.num_kv_heads, head_dim=drafter.head_dim,
                    attention=backend, hole=hole,
                )
            )  # fmt: skip
        torch.testing.assert_close(torch.cat(outs, 1), want, atol=1e-5, rtol=1e-5)


def _layout(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    return json.loads((path / "config.json").read_text()), load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize(("arch", "bias"), [("qwen2", True), ("llama", False), ("qwen3", False)])
def test_save_pretrained_writes_vllm_eagle1_layout(arch: str, bias: bool, tmp_path: Path) -> None:
    target = build_model(arch, "tiny", seed=0)
    drafter = _drafter(target)
    drafter.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    config, tensors = _layout(tmp_path)
    assert set(tensors) == VLLM_EAGLE1_TENSORS | (BIASES if bias else set())
    hidden = target.config.hidden_size
    assert tuple(tensors["fc.weight"].shape) == (hidden, 2 * hidden)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 1
    assert config["attention_bias"] is bias
    assert "layer_types" not in config
    for key in (
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "intermediate_size",
        "vocab_size",
    ):
        assert config[key] == getattr(target.config, key), key
    assert config["head_dim"] == 64
    assert config["tie_word_embeddings"] is False
    assert config["rope_parameters"]["rope_theta"] == target.config.rope_parameters["rope_theta"]
    # HF reads it back as a one-layer Llama config
    assert LlamaConfig.from_pretrained(tmp_path).num_hidden_layers == 1


def test_round_trip_proposes_the_same_tokens(tmp_path: Path) -> None:
    target = build_model("qwen2", "tiny", seed=0)
    drafter = _drafter(target)
    drafter.save_pretrained(tmp_path)
    loaded = EagleDrafter.from_pretrained(tmp_path, target)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    assert loaded.embed_weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(7))
    feats = _policy_features(target, tokens[:, :-1])[-1]
    for temperature in (0.0, 1.0):
        a_tok, a_probs = drafter.draft(
            feats, tokens, 4, temperature=temperature, generator=torch.Generator().manual_seed(8)
        )
        b_tok, b_probs = loaded.draft(
            feats, tokens, 4, temperature=temperature, generator=torch.Generator().manual_seed(8)
        )
        assert torch.equal(a_tok, b_tok)
        torch.testing.assert_close(a_probs, b_probs)
    other = build_model("qwen2", "small", seed=0)
    with pytest.raises(ValueError, match="hidden_size"):
        EagleDrafter.from_pretrained(tmp_path, other)


def test_draft_chains_its_own_predictions(tiny_llama: torch.nn.Module) -> None:
    drafter = _drafter(tiny_llama)
    tokens = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(9))
    feats = _policy_features(tiny_llama, tokens[:, :-1])[-1]  # (2, 5, H): h_0..h_4; tokens x_0..x_5
    drafted, probs = drafter.draft(feats, tokens, 3, temperature=0.0)
    assert drafted.shape == (2, 3) and probs.shape == (2, 3, 128)
    assert torch.equal(probs.argmax(-1), drafted) and torch.all(probs.max(-1).values == 1)
    # step 2 by hand: rows h_0..h_4 then the predicted feature of row 4 with draft 1, at position 5
    pred = drafter(feats, tokens[:, 1:], torch.arange(5).expand(2, 5))
    assert torch.equal(drafter.logits(pred[:, -1]).argmax(-1), drafted[:, 0])
    feats2 = torch.cat([feats, pred[:, -1:]], 1)
    ids2 = torch.cat([tokens[:, 1:], drafted[:, :1]], 1)
    pred2 = drafter(feats2, ids2, torch.arange(6).expand(2, 6))
    assert torch.equal(drafter.logits(pred2[:, -1]).argmax(-1), drafted[:, 1])


def test_eagle3_features(tmp_path: Path) -> None:
    target = build_model("llama", "tiny", seed=0)
    layers = default_eagle3_layers(target.config.num_hidden_layers)
    assert layers == (2, 1, 0)  # clamped for a 2-layer model
    assert default_eagle3_layers(24) == (2, 12, 21)
    drafter = _drafter(target, feature_layers=(0, 1, 2))
    assert drafter.fuse is not None and tuple(drafter.fuse.weight.shape) == (128, 384)
    tokens = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(10))
    hs = _policy_features(target, tokens)
    feats = torch.cat([hs[i] for i in drafter.feature_layers], -1)  # (B, T, 3H)
    batch = align_for_eagle(feats, tokens, torch.ones_like(tokens), last_features=hs[-1])
    assert batch.features.shape[-1] == 384 and batch.target_features.shape[-1] == 128
    pred = drafter(batch.features, batch.input_ids, batch.position_ids)
    assert pred.shape == (2, 6, 128)
    # fused features == passing the fused H-wide features directly
    torch.testing.assert_close(
        drafter(drafter.fuse(batch.features), batch.input_ids, batch.position_ids), pred
    )
    drafter.save_pretrained(tmp_path)
    config, tensors = _layout(tmp_path)
    assert config["eagle_feature_layers"] == [0, 1, 2] and "fuse.weight" in tensors
    loaded = EagleDrafter.from_pretrained(tmp_path, target)
    torch.testing.assert_close(loaded(batch.features, batch.input_ids, batch.position_ids), pred)
    with pytest.raises(ValueError, match="feature_layers must be hidden_states indices"):
        EagleDrafter.from_target(target, feature_layers=(0, 1, 9))


@torch.no_grad()
def test_greedy_speculation_equals_greedy_decoding(tiny_qwen2: torch.nn.Module) -> None:
    """Greedy chain speculation (draft, verify, append the emitted tokens) == greedy decoding, token for token."""
    policy, drafter = tiny_qwen2, _drafter(tiny_qwen2)
    prompt, new, k = torch.tensor([[3, 17, 25, 9, 40, 11]]), 16, 3
    plain = prompt
    for _ in range(new):
        plain = torch.cat([plain, policy(plain).logits[:, -1].argmax(-1, keepdim=True)], 1)

    def oracle(seq: torch.Tensor, corrupt: bool) -> tuple[torch.Tensor, None]:
        drafts = seq
        for _ in range(k):
            drafts = torch.cat([drafts, policy(drafts).logits[:, -1].argmax(-1, keepdim=True)], 1)
        drafts = drafts[:, seq.shape[1] :].clone()
        if corrupt:
            drafts[:, 1] = (drafts[:, 1] + 1) % 128  # accepted 1, then a rejection
        return drafts, None

    for source in ("eagle", "oracle", "corrupted"):
        seq, accepted = prompt, 0
        while seq.shape[1] < prompt.shape[1] + new:
            t = seq.shape[1] - 1
            if source == "eagle":
                feats = policy(seq, output_hidden_states=True).hidden_states[-1][:, :t]
                drafts, q = drafter.draft(feats, seq, k, temperature=0.0)
            else:
                drafts, q = oracle(seq, source == "corrupted")
            p = processed_probs(policy(torch.cat([seq, drafts], 1)).logits[:, t:], 0.0)
            out = verify_chain(drafts, q, p, None, torch.Generator().manual_seed(0))
            accepted += int(out.num_accepted[0])
            seq = torch.cat([seq, out.tokens[:, : int(out.num_emitted[0])]], 1)
        assert torch.equal(seq[:, : plain.shape[1]], plain), source
        if source == "oracle":
            assert accepted >= new - (new // (k + 1)) - 1  # every draft accepted
        if source == "corrupted":
            assert accepted > 0


def test_copy_weights_from_writes_in_place_and_same_layout_guards_it() -> None:
    # the engine publishes co-trained weights by copying into the drafter its CUDA graphs were captured
    # with: the tensors must stay where they are, and a drafter of another shape must not be copied
    policy = build_model("qwen2", "tiny", seed=0)
    target = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0)).inference_copy()
    source = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(1))
    ptrs = {name: t.data_ptr() for name, t in target.state_dict().items()}
    assert target.same_layout(source) and not torch.equal(target.fc.weight, source.fc.weight)
    target.copy_weights_from(source)
    assert {name: t.data_ptr() for name, t in target.state_dict().items()} == ptrs
    assert all(torch.equal(t, source.state_dict()[name]) for name, t in target.state_dict().items())
    other = EagleDrafter.from_target(build_model("qwen2", "small", seed=0))
    assert not target.same_layout(other)
