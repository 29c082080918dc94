"""What an engine accepts as prompts: one validator shared by the native and the vLLM engine.

A prompt is a sequence of token ids: Python ``int`` s, NumPy integers or integer tensors (a 1-D
integer tensor is a prompt too). Anything else is refused with a `TypeError` that names the
prompt and the element, before any work: a float id would otherwise be truncated silently and a
string would fail deep inside with ``invalid literal for int()``.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["validate_prompts"]


def _token_id(value: Any, i: int, j: int) -> int:
    """``value`` as an ``int`` if it is an integer of any kind, else a `TypeError` naming prompt ``i``, position ``j``."""
    if isinstance(value, torch.Tensor):
        if value.ndim == 0 and not value.is_floating_point() and not value.is_complex() and value.dtype != torch.bool:
            return int(value.item())
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    raise TypeError(
        f"prompt {i} has {value!r} ({type(value).__name__}) at position {j}; token ids must be integers "
        "(encode text with the tokenizer first)"
    )


def _prompt_ids(prompt: Any, i: int) -> tuple[int, ...]:
    if isinstance(prompt, (str, bytes)):
        raise TypeError(
            f"prompt {i} is a {type(prompt).__name__} ({prompt[:40]!r}); the engine takes token ids: "
            "encode it with the tokenizer first"
        )
    if isinstance(prompt, torch.Tensor):
        if prompt.ndim != 1:
            raise TypeError(f"prompt {i} is a tensor of shape {tuple(prompt.shape)}; a prompt is 1-D")
        return tuple(_token_id(t, i, j) for j, t in enumerate(prompt))
    if not isinstance(prompt, Sequence):
        raise TypeError(f"prompt {i} is a {type(prompt).__name__}, not a sequence of token ids")
    return tuple(_token_id(t, i, j) for j, t in enumerate(prompt))


def validate_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int, *, max_new_tokens: int = 0, max_seq_len: int | None = None
) -> list[tuple[int, ...]]:
    """Check a batch of prompts and return them as tuples of ``int``.

    Args:
        prompts: one sequence of token ids per prompt.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_new_tokens: the completion budget; with ``max_seq_len``, each prompt must leave room for it.
        max_seq_len: the engine's context (prompt plus completion); ``None`` does not check lengths.

    Returns:
        The prompts as tuples of Python ints, in order.

    Raises:
        TypeError: ``prompts`` is not a sequence of prompts, or a prompt holds a non-integer
            (a float, a string, ...): the message names the prompt's index, the position and the value.
        ValueError: a prompt is empty, has an id outside the vocabulary, or is too long for
            ``max_seq_len`` with ``max_new_tokens`` new tokens.
    """
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, torch.Tensor)):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, prompt in enumerate(prompts):
        ids = _prompt_ids(prompt, i)
        if not ids:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]!r} outside the vocabulary [0, {vocab_size})")
        if max_seq_len is not None and len(ids) + max_new_tokens > max_seq_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that is "
                f"{len(ids) + max_new_tokens} > max_seq_len={max_seq_len}"
            )
        out.append(ids)
    return out
