"""Turning logits into the distribution that is sampled from, and sampling from it.

The same `processed_probs` is applied to the policy and to a drafter, so that speculative
verification compares the two distributions the user asked for (temperature, then top-k, then
top-p, as HF ``generate`` and vLLM do). Sampling uses the exponential race (Gumbel-max in another
guise): ``argmax(p / E)`` with ``E ~ Exp(1)`` draws exactly from ``p``, in one fused pass, without
a host sync.

Keyed noise. The engine's noise is not drawn from a stream (whose order would depend on which rows
share a step, in which slots, and on whether a step speculated) but computed by a counter-based hash
(`keyed_bits`): the ``Exp(1)`` draw for vocabulary entry ``v`` of row ``r``'s token at completion
position ``t`` is a pure function of ``(row key, t, purpose, v)``, the row key itself a function of
the run's seed, the prompt and the sample index (`row_keys`). So a row draws the same numbers
whatever the batch, the slot order or the admission order, and speculative verification can use
the very numbers plain decoding would have used (`lightning_tlt.rollout.verify.verify_coupled`).
The hash is integer arithmetic on tensors (``torch.compile`` fuses it with the head's softmax and
the race: the ``(B, V)`` noise is never materialised, and no generator state is captured in a CUDA
graph). Explicit generators (`exponential_noise`, `sample`) remain for code outside the engine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "NOISE_ACCEPT",
    "NOISE_DRAFT",
    "NOISE_SAMPLE",
    "PROB_FLOOR",
    "exponential_noise",
    "keyed_bits",
    "keyed_exponential",
    "keyed_uniform",
    "processed_probs",
    "row_keys",
    "sample",
    "sample_keyed",
    "sample_with_noise",
    "token_logprobs",
]

NOISE_SAMPLE = 0
"""Purpose of the race that picks a row's token at a position (plain decoding, and the verifier's)."""
NOISE_DRAFT = 1
"""Purpose of a drafter's own race under rejection sampling (independent of the verifier's numbers)."""
NOISE_ACCEPT = 2
"""Purpose of the uniform that accepts or rejects a draft under rejection sampling."""

_MASK32 = 0xFFFFFFFF
# odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows
# (signed overflow would be undefined behaviour in Inductor's C++ code)
_MUL1, _MUL2 = 0x7FEB352D, 0x2C1B3C6D
_PURPOSE_SALT = 0x68E31DA4

PROB_FLOOR = 1e-30
"""The samplers' floor on a probability: keeps ``p / E`` finite when an Exp(1) draw underflows to 0, and a
chosen token's logprob finite (``log(PROB_FLOOR)`` = -69.08 marks a token drawn at probability 0)."""


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
    return noise.clamp_min_(PROB_FLOOR)


def call_seed(generator: torch.Generator | None) -> int:
    """A ``generate`` call's seed: one draw from ``generator`` (advancing it), or from torch's default one;
    with `row_keys`, it names the noise of every row of the call."""
    source = "cpu" if generator is None else generator.device
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=source).item())


def row_keys(seed: int, prompts: Sequence[Sequence[int]], num_samples: int = 1) -> list[int]:
    """The noise key of every row of a ``generate`` call (prompt-major: all samples of prompt 0 first).

    A row's key is a hash of the seed, the prompt's tokens, which occurrence of that prompt in the
    call it is (a prompt given twice draws independent rollouts) and the sample index: so it does not
    depend on where the prompt stands in the list, nor on anything about the other rows.

    Returns:
        ``len(prompts) * num_samples`` non-negative keys below ``2**62``.
    """
    seen: dict[tuple[int, ...], int] = {}
    keys: list[int] = []
    for prompt in prompts:
        ids = tuple(int(t) for t in prompt)
        occurrence = seen.get(ids, 0)
        seen[ids] = occurrence + 1
        digest = hashlib.blake2b(repr((int(seed), ids, occurrence)).encode(), digest_size=8).digest()
        base = int.from_bytes(digest, "little")
        for g in range(num_samples):
            sample = hashlib.blake2b(base.to_bytes(8, "little") + g.to_bytes(8, "little"), digest_size=8).digest()
            keys.append(int.from_bytes(sample, "little") >> 2)
    return keys


def _mix32(x: Tensor) -> Tensor:
    """A bijective 32-bit integer mixer (xorshift-multiply, after Wellons' ``lowbias32``) on int64."""
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def keyed_bits(keys: Tensor, positions: Tensor, purpose: int, columns: Tensor | None = None) -> Tensor:
    """32 pseudo-random bits per ``(key, position, purpose[, column])``, as int64 in ``[0, 2**32)``.

    Args:
        keys: ``(...)`` int64 row keys (`row_keys`), non-negative.
        positions: ``(...)`` int64 positions (broadcast against ``keys``).
        purpose: which stream (`NOISE_SAMPLE`, `NOISE_DRAFT`, `NOISE_ACCEPT`): each is independent.
        columns: ``(V,)`` int64 ids; the result gets a trailing ``V`` dimension.

    Returns:
        ``(..., [V])`` int64.
    """
    h = _mix32((keys & _MASK32) ^ (_PURPOSE_SALT * (purpose + 1) & _MASK32))
    h = _mix32(h ^ ((keys >> 32) & _MASK32))
    h = _mix32(h ^ (positions & _MASK32))
    if columns is not None:
        h = _mix32(_mix32(h[..., None] ^ columns))
    return h


UNIFORM_BITS = 23
"""Bits of `keyed_bits` a uniform draw keeps: ``(b + 0.5) / 2**23`` is exact in float32 for every ``b``, so a draw
is never 0 nor 1. (With 24 bits the top value ``(2**24 - 0.5) / 2**24`` rounded to 1.0 and its exponential to -0.0:
over a 151,936-token vocabulary about one position in 110 had such a column, and where its probability was 0 (a
token the policy never emits, or one top-k or top-p removed) ``0 / -0.0`` is NaN, which ``argmax`` picks. Found
on an H100 by `benchmarks/reproducible.py`, whose margin at a divergence took the log of that draw.)"""


def keyed_uniform(keys: Tensor, positions: Tensor, purpose: int, columns: Tensor | None = None) -> Tensor:
    """``U(0, 1)`` float32 draws, never 0 nor 1: the top `UNIFORM_BITS` of `keyed_bits`, centred in their interval."""
    bits = keyed_bits(keys, positions, purpose, columns) >> (32 - UNIFORM_BITS)
    return (bits.float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


def keyed_exponential(keys: Tensor, positions: Tensor, purpose: int, columns: Tensor | None = None) -> Tensor:
    """``Exp(1)`` float32 draws ``-log U`` of `keyed_uniform`: finite and positive (at least 2**-24, about 6e-8), so a
    race column of probability 0 never wins."""
    # clamped: a draw is below 1 - 2**-24 and its exact log nonzero, but a GPU's approximate log may round it to 0
    return (-torch.log(keyed_uniform(keys, positions, purpose, columns))).clamp_min(PROB_FLOOR)


def sample_keyed(probs: Tensor, keys: Tensor, positions: Tensor, purpose: int = NOISE_SAMPLE) -> Tensor:
    """The exponential race over ``probs`` (``(..., V)``) with keyed noise; ``keys``/``positions`` ``(...)``."""
    columns = torch.arange(probs.shape[-1], device=probs.device)
    return sample_with_noise(probs, keyed_exponential(keys, positions, purpose, columns))


def sample_with_noise(probs: Tensor, noise: Tensor) -> Tensor:
    """The exponential race ``argmax(p / E)`` with given ``Exp(1)`` noise of ``probs``'s shape."""
    return (probs / noise).argmax(-1)


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one token per row from ``probs`` (``(..., V)``) by the exponential race; returns ``(...)`` long."""
    return sample_with_noise(probs, exponential_noise(tuple(probs.shape), generator, probs.device))


def token_logprobs(probs: Tensor, tokens: Tensor) -> Tensor:
    """``log probs[..., token]`` for each row; ``probs`` ``(..., V)``, ``tokens`` ``(...)``."""
    return probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).clamp_min(PROB_FLOOR).log()
