"""Turning logits into the distribution that is sampled from, and sampling from it.

The same `processed_probs` is applied to the policy and to a drafter, so that speculative
verification compares the two distributions the user asked for (temperature, then top-k, then
top-p, as HF ``generate`` and vLLM do). Sampling uses the exponential race (Gumbel-max in another
guise): ``argmax(p / E)`` with ``E ~ Exp(1)`` draws exactly from ``p``, in one fused pass, without
a host sync, from an explicit ``torch.Generator``.

Inside a compiled step the noise is drawn *outside* the compiled function (``torch.compile``
cannot trace an explicit generator) by `exponential_noise`, one kernel captured in the same CUDA
graph, and the race itself, `sample_with_noise`, fuses with the head's softmax: the head path is
the LM head, one softmax and one argmax (plus a sort only when ``top_p < 1``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "exponential_noise",
    "processed_probs",
    "sample",
    "sample_with_noise",
    "token_logprobs",
]

_TINY = 1e-30  # keeps p / E finite when an Exp(1) draw underflows to 0


def processed_probs(logits: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Probabilities after temperature, top-k and top-p, in float32.

    Args:
        logits: ``(..., V)`` raw logits.
        temperature: 0 gives the one-hot argmax distribution (greedy).
        top_k: keep the ``top_k`` largest logits (ties at the boundary are kept); 0 keeps all.
        top_p: keep the smallest prefix of the sorted distribution whose mass reaches ``top_p``.

    Returns:
        ``(..., V)`` float32 probabilities summing to 1 along the last dimension.
    """
    logits = logits.float()
    if temperature == 0.0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # mass strictly before each token; a token is dropped once that mass already reaches top_p
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def exponential_noise(
    shape: tuple[int, ...], generator: torch.Generator | None = None, device: torch.device | None = None
) -> Tensor:
    """``Exp(1)`` draws of ``shape`` in float32, clamped away from 0 (the race's noise)."""
    noise = torch.empty(shape, dtype=torch.float32, device=device).exponential_(generator=generator)
    return noise.clamp_min_(_TINY)


def sample_with_noise(probs: Tensor, noise: Tensor) -> Tensor:
    """The exponential race ``argmax(p / E)`` with given ``Exp(1)`` noise of ``probs``'s shape."""
    return (probs / noise).argmax(-1)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row from ``probs`` (``(..., V)``) by the exponential race; returns ``(...)`` long."""
    return sample_with_noise(probs, exponential_noise(tuple(probs.shape), generator, probs.device))


def token_logprobs(probs: Tensor, tokens: Tensor) -> Tensor:
    """``log probs[..., token]`` for each row; ``probs`` ``(..., V)``, ``tokens`` ``(...)``."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).clamp_min(_TINY).log()
