"""The zoo: deterministic offline builds, sizes, config conventions, save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from lightning_tlt.models.zoo import (
    ZOO_SIZES,
    ZooSize,
    build_config,
    build_model,
    count_parameters,
    default_vocab_size,
    load_model,
    save_model,
)

# parameter counts with the default 128-token vocabulary (measured; the docs quote them)
EXPECTED_PARAMS = {
    ("qwen2", "tiny"): 328_832,
    ("llama", "tiny"): 328_320,
    ("qwen3", "tiny"): 328_576,
    ("qwen2", "small"): 3_215_616,
    ("qwen2", "100m"): 104_040_192,
    ("qwen2", "400m"): 358_127_488,
    ("llama", "400m"): 358_099_840,
    # Qwen2.5-0.5B: 494,032,768 parameters (its config: hidden 896, 24 layers, 14/2 heads, MLP 4,864,
    # vocab 151,936, tied embeddings); the hand count is 151,936 x 896 + 24 x 14,912,384 + 896
    ("qwen2", "0.5b"): 494_032_768,
}


@pytest.mark.parametrize(("arch", "size"), sorted(EXPECTED_PARAMS))
def test_parameter_counts(arch: str, size: str) -> None:
    if size in ("100m", "400m", "0.5b"):  # count on the meta device: no memory, no init
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(build_config(arch, size))
    else:
        model = build_model(arch, size)
    assert count_parameters(model) == EXPECTED_PARAMS[(arch, size)]
    assert count_parameters(model, trainable_only=True) == EXPECTED_PARAMS[(arch, size)]


def test_tiny_config_conventions(tiny_qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    cfg = tiny_qwen2.config
    assert count_parameters(tiny_qwen2) < 1_000_000
    assert cfg.hidden_size // cfg.num_attention_heads == 64  # vLLM's CPU attention needs head_dim 64
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.vocab_size == default_vocab_size() == 128 >= len(tokenizer)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    assert cfg.tie_word_embeddings is False and cfg.max_position_embeddings == 4096
    assert tiny_qwen2.lm_head.weight.data_ptr() != tiny_qwen2.model.embed_tokens.weight.data_ptr()
    attn = tiny_qwen2.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert attn.o_proj.bias is None
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert not tiny_qwen2.training


def test_400m_matches_qwen2_05b_body() -> None:
    shape = ZOO_SIZES["400m"]
    assert (shape.hidden_size, shape.num_hidden_layers, shape.num_attention_heads) == (896, 24, 14)
    assert (shape.num_key_value_heads, shape.intermediate_size, shape.head_dim) == (2, 4864, 64)


def test_05b_is_qwen25_05b_shaped() -> None:
    body, shape = ZOO_SIZES["400m"], ZOO_SIZES["0.5b"]
    assert shape.hidden_size == body.hidden_size and shape.intermediate_size == body.intermediate_size
    assert (shape.num_hidden_layers, shape.num_attention_heads, shape.num_key_value_heads) == (24, 14, 2)
    assert (shape.vocab_size, shape.tie_word_embeddings) == (151_936, True)
    cfg = build_config("qwen2", "0.5b")
    assert cfg.vocab_size == 151_936 and cfg.tie_word_embeddings is True and cfg.max_position_embeddings == 32768
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one matrix, as in Qwen2.5-0.5B
    assert model.lm_head.weight.shape == (151_936, 896)
    # the 400m body plus the one 151,936-row matrix replacing its two 128-row ones
    assert count_parameters(model) == EXPECTED_PARAMS[("qwen2", "400m")] + 896 * (151_936 - 2 * 128)
    # an explicit vocab_size still wins over the size's own
    assert build_config("qwen2", "0.5b", vocab_size=256).vocab_size == 256


def test_architectures(tiny_llama: PreTrainedModel, tiny_qwen3: PreTrainedModel) -> None:
    assert type(tiny_llama).__name__ == "LlamaForCausalLM"
    assert tiny_llama.model.layers[0].self_attn.q_proj.bias is None
    assert type(tiny_qwen3).__name__ == "Qwen3ForCausalLM"
    assert tiny_qwen3.model.layers[0].self_attn.q_norm.weight.shape == (64,)


def test_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a, b, c = build_model(seed=7), build_model(seed=7), build_model(seed=8)
    assert torch.equal(torch.random.get_rng_state(), state)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)
    assert a.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.05)  # HF's initializer_range


def test_dtype_and_vocab_size() -> None:
    model = build_model("llama", vocab_size=256, dtype=torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.lm_head.weight.shape == (256, 128)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"arch": "gpt2"}, "arch must be one of"),
        ({"size": "huge"}, "size must be one of"),
        ({"vocab_size": 50}, "vocab_size must be >= the tokenizer's 103"),
    ],
)
def test_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_model(**kwargs)


def test_bad_size_shape() -> None:
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        ZooSize(
            hidden_size=100,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=1,
            intermediate_size=8,
        )


def test_save_and_load_give_same_logits(
    tiny_arch_model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    ids = torch.tensor([tokenizer("Compute 3+4*2\n4*2=8")["input_ids"]])  # (1, T)
    with torch.no_grad():
        expected = tiny_arch_model(ids).logits  # (1, T, V)
    save_model(tiny_arch_model, tokenizer, tmp_path / "m")
    loaded, loaded_tok = load_model(tmp_path / "m")
    assert type(loaded) is type(tiny_arch_model)
    assert loaded_tok.get_vocab() == tokenizer.get_vocab()
    with torch.no_grad():
        got = loaded(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_load_model_rejects_non_model_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        load_model(tmp_path)
