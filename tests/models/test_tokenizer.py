"""The offline character-level tokenizer: ids, round trips, chat template, save/load."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from lightning_tlt.models.tokenizer import (
    CHARACTERS,
    SPECIAL_TOKENS,
    build_tokenizer,
    byte_level,
    encode_prompt,
    vocabulary,
)


def test_vocabulary_is_fixed(tokenizer: PreTrainedTokenizerFast) -> None:
    # 7 specials + "\n" + 95 printable ASCII characters
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(CHARACTERS) == 7 + 1 + 95 == 103
    assert (
        tokenizer.pad_token_id,
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.unk_token_id,
    ) == (0, 1, 2, 3)
    # the vocabulary is spelled in GPT-2's byte-level alphabet: space is "Ġ", newline "Ċ"
    assert [byte_level(c) for c in "\n 0A~"] == ["Ċ", "Ġ", "0", "A", "~"]
    assert tokenizer.convert_tokens_to_ids(["Ċ", "Ġ", "0", "A", "~"]) == [7, 8, 24, 41, 102]
    assert tokenizer("\n 0A~", add_special_tokens=False)["input_ids"] == [7, 8, 24, 41, 102]
    assert build_tokenizer().get_vocab() == tokenizer.get_vocab() == vocabulary()


def test_one_token_per_character_and_exact_round_trip(tokenizer: PreTrainedTokenizerFast) -> None:
    text = CHARACTERS + "  double  spaces ,. ( 3 + -4 ) * 5 = -7\n\n#### 12\n"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    # the post-processor adds <bos> (what TRL gets for plain prompts); skipping specials restores the text
    with_bos = tokenizer(text)["input_ids"]
    assert with_bos[0] == tokenizer.bos_token_id and with_bos[1:] == ids
    assert tokenizer.decode(with_bos, skip_special_tokens=True) == text


def test_special_tokens_are_atomic(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tokenizer("<|user|>1+1<eos>", add_special_tokens=False)["input_ids"]
    assert ids == [5, 25, 19, 25, 2]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1+1"
    # characters outside the vocabulary become <unk> (one per UTF-8 byte) rather than crashing
    assert tokenizer("é", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id] * 2


def test_chat_template_and_encode_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2*3"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|system|>be brief<eos><|user|>2*3<eos><|assistant|>"
    ids = encode_prompt(tokenizer, messages)
    assert ids == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == 1 and ids[-1] == 6 and len(ids) == 1 + 1 + 8 + 1 + 1 + 3 + 1 + 1
    assert encode_prompt(tokenizer, "2*3") == [1, 26, 18, 27]
    no_gen = tokenizer.apply_chat_template(messages[1:], add_generation_prompt=False, tokenize=False)
    assert no_gen == "<bos><|user|>2*3<eos>"


@pytest.mark.parametrize("bad", [3, None, [{"content": "no role"}], ["plain", "list"]])
def test_encode_prompt_rejects_bad_prompts(tokenizer: PreTrainedTokenizerFast, bad: object) -> None:
    with pytest.raises(ValueError, match="prompt must be a str or a list"):
        encode_prompt(tokenizer, bad)  # type: ignore[arg-type]


def test_save_and_load_round_trip(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    tokenizer.save_pretrained(tmp_path)
    for loaded in (
        AutoTokenizer.from_pretrained(tmp_path),
        PreTrainedTokenizerFast.from_pretrained(tmp_path),
    ):
        assert loaded.get_vocab() == tokenizer.get_vocab()
        assert (loaded.pad_token, loaded.bos_token, loaded.eos_token) == ("<pad>", "<bos>", "<eos>")
        assert loaded.chat_template == tokenizer.chat_template
        text = "Solve: 12 - 3 * 4\n#### 0"
        assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
        messages = [{"role": "user", "content": "hi"}]
        assert encode_prompt(loaded, messages) == encode_prompt(tokenizer, messages)


def test_round_trip_on_every_task_text(tokenizer: PreTrainedTokenizerFast) -> None:
    from lightning_tlt.tasks import TASKS

    texts = []
    for task in TASKS.values():
        for difficulty in range(1, task.max_difficulty + 1):
            for p in task.problems(200, difficulty=difficulty, seed=1):
                texts += [p.prompt, p.solution, p.answer]
    used = set("".join(texts))
    assert used <= set(CHARACTERS)
    assert {"\n", " ", "#", "=", "*", "+", "-", "/", "(", ")"} <= used
    batch = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for text, ids in zip(texts, batch):
        assert len(ids) == len(text) and tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3"])
def test_auto_tokenizer_in_a_model_directory(
    arch: str, tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    # AutoTokenizer forces Qwen2Tokenizer (a byte-level BPE pipeline rebuilt from tokenizer.json) on
    # model_type qwen2 directories; the byte-level vocabulary keeps the ids identical there too.
    from lightning_tlt.models.zoo import build_model, save_model

    save_model(build_model(arch), tokenizer, tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Compute 9-8-3\n a  b\n#### -2\n" + CHARACTERS
    assert loaded(text)["input_ids"] == tokenizer(text)["input_ids"]
    assert loaded.decode(loaded(text, add_special_tokens=False)["input_ids"]) == text
    messages = [{"role": "user", "content": "Use 3 5 2 to make 16"}]
    assert encode_prompt(loaded, messages) == encode_prompt(tokenizer, messages)
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
