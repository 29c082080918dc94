"""An offline, character-level tokenizer for the synthetic tasks.

No tokenizer can be downloaded here, so the kit builds its own with ``tokenizers``: one token per
character (every printable ASCII character, space included, plus ``"\\n"``), a few special tokens
and a chat template, wrapped as a `transformers.PreTrainedTokenizerFast` so that TRL, HF
``generate`` and ``save_pretrained``/``from_pretrained`` treat it like any hub tokenizer.

Ids are fixed by construction (specials first, then ``"\\n"``, then ASCII 32..126 in order), so
every build gives the same vocabulary and a model trained with one build reads another's ids.

The vocabulary is spelled in GPT-2's byte-level alphabet (space is ``"Ġ"``, newline ``"Ċ"``) and
the model is a BPE without merges behind a ``ByteLevel`` pre-tokenizer: one token per character,
exactly as a WordLevel model would give, but also what the Qwen2 tokenizer class rebuilds from
``tokenizer.json``. That matters because ``AutoTokenizer`` forces ``Qwen2Tokenizer`` (a byte-level
BPE pipeline) on any directory whose ``config.json`` says ``model_type: qwen2`` (transformers
5.24), and vLLM loads tokenizers through ``AutoTokenizer``.

Conventions (shared by the engine, the datamodule, SFT and TRL):

- a plain prompt is ``<bos>`` + text (the post-processor adds ``<bos>`` when
  ``add_special_tokens=True``, which is what TRL does for plain prompts);
- a conversational prompt is rendered by the chat template as
  ``<bos><|user|>content<eos><|assistant|>`` (each turn is closed by ``<eos>``, so one stop token
  ends a completion in both forms);
- a completion is the answer text followed by ``<eos>``.
"""

from __future__ import annotations

import string
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
ROLE_TOKENS: dict[str, str] = {
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
}
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, *ROLE_TOKENS.values())
"""Special tokens, in id order: ``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3, then the roles."""

CHARACTERS: str = "\n" + "".join(chr(c) for c in range(32, 127))
"""Every ordinary character the tokenizer knows, in id order (after the special tokens)."""


def byte_level(char: str) -> str:
    """The vocabulary spelling of an ASCII character in GPT-2's byte-level alphabet.

    Bytes 33..126 stand for themselves; bytes 0..32 (space and newline among them) are shifted
    to ``chr(256 + byte)``: ``" "`` is ``"Ġ"``, ``"\\n"`` is ``"Ċ"``.
    """
    code = ord(char)
    if code > 126:
        raise ValueError(f"byte_level covers ASCII characters only, got {char!r}")
    return char if code >= 33 else chr(256 + code)


assert set(string.printable) - set("\t\r\x0b\x0c") <= set(CHARACTERS)

CHAT_TEMPLATE: str = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' ~ message['role'] ~ '; allowed: system, user, assistant') }}"
    "{% endif %}"
    "{{ '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
"""Jinja chat template: ``<bos>`` then ``<|role|>content<eos>`` per message, then ``<|assistant|>``
when ``add_generation_prompt`` (TRL's conversational format)."""


def vocabulary() -> dict[str, int]:
    """Token -> id map of the tokenizer: special tokens, then `CHARACTERS` in byte-level spelling."""
    tokens = [*SPECIAL_TOKENS, *(byte_level(c) for c in CHARACTERS)]
    return {tok: i for i, tok in enumerate(tokens)}


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character-level tokenizer of the kit (offline, same ids on every call).

    Returns:
        A `PreTrainedTokenizerFast` with ``pad``/``bos``/``eos``/``unk`` tokens, a chat template,
        left padding off by default (right padding, as HF training expects) and
        ``decode(encode(s, add_special_tokens=False)) == s`` for any string of `CHARACTERS`.
    """
    # a BPE without merges splits every pre-token into single characters
    core = Tokenizer(models.BPE(vocab=vocabulary(), merges=[], unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = vocabulary()[BOS_TOKEN]
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        clean_up_tokenization_spaces=False,
        padding_side="right",
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str | Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of one TRL prompt, as the policy sees it before its completion.

    Args:
        tokenizer: a tokenizer from `build_tokenizer` (or any HF tokenizer with a chat template).
        prompt: a plain string (encoded as ``<bos>`` + text) or a list of ``{"role", "content"}``
            messages (rendered with the chat template and ``add_generation_prompt=True``).

    Returns:
        The prompt's token ids.

    Raises:
        ValueError: if ``prompt`` is neither a string nor a list of role/content messages.
    """
    if isinstance(prompt, str):
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        bos = tokenizer.bos_token_id
        return ([bos] if bos is not None else []) + list(ids)
    if isinstance(prompt, Sequence) and all(
        isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt
    ):
        messages = [dict(m) for m in prompt if isinstance(m, Mapping)]
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, Mapping):  # some transformers versions return a BatchEncoding regardless
            ids = ids["input_ids"]
        return list(ids)
    raise ValueError(
        f"prompt must be a str or a list of {{'role', 'content'}} messages (TRL's formats), got {prompt!r}"
    )


def completion_text(completion: Any) -> str:
    """The text of one TRL completion: a string, or conversational ``[{"role", "content"}, ...]``.

    Conversational completions give the concatenated contents of their assistant messages (all
    messages when none is marked assistant). Anything else gives ``""``: rewards never raise.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        completion = [completion]
    if isinstance(completion, Sequence) and not isinstance(completion, bytes):
        messages = [m for m in completion if isinstance(m, Mapping)]
        assistant = [m for m in messages if m.get("role") == "assistant"] or messages
        return "".join(m["content"] for m in assistant if isinstance(m.get("content"), str))
    return ""
