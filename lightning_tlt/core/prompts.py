"""Checking prompts before any work: the one validator of every engine's ``generate``."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["validate_prompts"]


def validate_prompts(
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    *,
    max_new_tokens: int,
    max_seq_len: int | None = None,
) -> list[tuple[int, ...]]:
    """Token-id lists checked and normalised to tuples of ``int``.

    Raises:
        TypeError: ``prompts`` is not a list of token-id lists, or an id is not an integer (a float
            or a string is refused, never truncated), naming the prompt and the element.
        ValueError: an empty prompt, an id outside ``[0, vocab_size)``, or a prompt that leaves no
            room for ``max_new_tokens`` within ``max_seq_len``.
    """
    if not isinstance(prompts, Sequence) or isinstance(prompts, (str, bytes)):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__} {prompt!r:.60}")
        ids = []
        for t in prompt:
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise TypeError(f"prompt {i} has {t!r} ({type(t).__name__}); token ids must be integers")
            ids.append(int(t.__index__()))
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
        out.append(tuple(ids))
    return out
