"""What an engine accepts as prompts: one validator shared by the native and the vLLM engine.

A prompt is a sequence of token ids: Python ``int`` s, NumPy integers or integer tensors (a 1-D
integer tensor is a prompt too). Anything else is refused with a `TypeError` that names the
prompt and the element, before any work: a float id would otherwise be truncated silently and a
string would fail deep inside with ``invalid literal for int()``.

A prompt that with its completion budget runs past the policy's positions
(``config.max_position_embeddings``, `policy_positions`) is refused too, even when the engine's
cache would hold it: RoPE past the trained positions samples garbage without an error. Where the
policy's config scales RoPE to longer contexts (YaRN, dynamic NTK, ...) it is a warning instead.
`check_stop_ids` refuses stop tokens outside the vocabulary (they could never fire).
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["PositionLimit", "check_stop_ids", "policy_positions", "validate_prompts"]


class PositionLimit(NamedTuple):
    """How many positions a policy was built for, and whether its RoPE scaling extends them."""

    max_positions: int
    """``config.max_position_embeddings``."""
    rope_scaling: str | None
    """The RoPE scaling type that extends the context ("yarn", "dynamic", ...), ``None`` for plain RoPE."""


def policy_positions(model: Any) -> PositionLimit | None:
    """The `PositionLimit` of an HF model (or of its ``config``), ``None`` where the config does not say."""
    config = getattr(model, "config", model)
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions < 1:
        return None
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = str(params.get("rope_type", params.get("type", "default")) or "default") if isinstance(params, dict) else ""
    return PositionLimit(positions, None if kind in ("", "default") else kind)


def check_stop_ids(stop_ids: Sequence[int], vocab_size: int) -> None:
    """Refuse stop token ids outside ``[0, vocab_size)``: such a token is never sampled, so it never stops a row.

    Raises:
        ValueError: naming the first such id and the vocabulary.
    """
    bad = [t for t in stop_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(f"stop token id {bad[0]!r} is outside the vocabulary [0, {vocab_size}): it could never "
                         f"end a completion (stop ids: {list(stop_ids)!r})")


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
    prompts: Sequence[Sequence[int]], vocab_size: int, *, max_new_tokens: int = 0, max_seq_len: int | None = None,
    positions: PositionLimit | None = None,
) -> list[tuple[int, ...]]:
    """Check a batch of prompts and return them as tuples of ``int``.

    Args:
        prompts: one sequence of token ids per prompt.
        vocab_size: ids must lie in ``[0, vocab_size)``.
        max_new_tokens: the completion budget; with ``max_seq_len``, each prompt must leave room for it.
        max_seq_len: the engine's context (prompt plus completion); ``None`` does not check lengths.
        positions: the policy's positions (`policy_positions`): each prompt with ``max_new_tokens``
            must fit them, or (where RoPE scaling extends them) is warned about.

    Returns:
        The prompts as tuples of Python ints, in order.

    Raises:
        TypeError: ``prompts`` is not a sequence of prompts, or a prompt holds a non-integer
            (a float, a string, ...): the message names the prompt's index, the position and the value.
        ValueError: a prompt is empty, has an id outside the vocabulary, or is too long for
            ``max_seq_len`` or the policy's positions with ``max_new_tokens`` new tokens.
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
    longest = max(range(len(out)), key=lambda i: len(out[i]), default=None)
    if positions is not None and longest is not None and len(out[longest]) + max_new_tokens > positions.max_positions:
        message = (
            f"prompt {longest} has {len(out[longest])} tokens; with max_new_tokens={max_new_tokens} that is "
            f"{len(out[longest]) + max_new_tokens} > the policy's max_position_embeddings={positions.max_positions}"
        )
        if positions.rope_scaling is None:
            raise ValueError(f"{message}: positions past it were never trained (shorten the prompt or max_new_tokens)")
        warnings.warn(f"{message}; its RoPE scaling ({positions.rope_scaling!r}) is what extends it", stacklevel=3)
    return out
