"""Keyed sampling noise: a pure function of (key, position, purpose, column), uniform and independent."""

from __future__ import annotations

import math

import torch

from lightning_tlt.core.sampling import (
    NOISE_ACCEPT,
    NOISE_DRAFT,
    NOISE_SAMPLE,
    keyed_bits,
    keyed_exponential,
    keyed_uniform,
    row_keys,
    sample_keyed,
    sample_with_noise,
)


def test_row_keys_follow_the_prompt_not_its_place() -> None:
    prompts = [[1, 2, 3], [4, 5], [1, 2, 3]]
    keys = row_keys(7, prompts, num_samples=2)
    assert len(keys) == 6 and len(set(keys)) == 6  # a repeated prompt draws independent rollouts
    assert all(0 <= k < 2**62 for k in keys)
    moved = row_keys(7, [[4, 5], [1, 2, 3], [9], [1, 2, 3]], num_samples=2)
    assert moved[2:4] == keys[0:2] and moved[0:2] == keys[2:4] and moved[6:8] == keys[4:6]
    assert row_keys(7, prompts, 3)[:2] == keys[:2]  # more samples per prompt: the first ones unchanged
    assert not set(row_keys(8, prompts, 2)) & set(keys)  # another seed, other keys


def test_keyed_noise_is_a_pure_function_of_its_inputs() -> None:
    keys = torch.tensor(row_keys(0, [[1], [2], [3]]))
    cols = torch.arange(64)
    full = keyed_exponential(keys[:, None], torch.arange(5)[None], NOISE_SAMPLE, cols)  # (3, 5, 64)
    # any subset, order or batch shape gives the same numbers for the same (key, position, column)
    one = keyed_exponential(keys[2:3], torch.tensor([4]), NOISE_SAMPLE, cols)
    assert torch.equal(one[0], full[2, 4])
    perm = torch.tensor([2, 0, 1])
    assert torch.equal(keyed_exponential(keys[perm], torch.tensor([1, 3, 0]), NOISE_SAMPLE, cols),
                       full[perm, torch.tensor([1, 3, 0])])
    assert torch.equal(keyed_bits(keys, torch.ones_like(keys), NOISE_SAMPLE, cols)[:, 7],
                       keyed_bits(keys, torch.ones_like(keys), NOISE_SAMPLE, cols[7:8])[:, 0])
    # purposes are different streams
    draws = [keyed_uniform(keys[:, None], torch.arange(5)[None], p, cols) for p in (NOISE_SAMPLE, NOISE_DRAFT,
                                                                                      NOISE_ACCEPT)]
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert bool(torch.isfinite(full).all()) and bool((full > 0).all())


def test_keyed_uniforms_are_uniform_and_uncorrelated() -> None:
    keys = torch.tensor(row_keys(3, [[i] for i in range(64)]))
    u = keyed_uniform(keys[:, None], torch.arange(64)[None], NOISE_SAMPLE, torch.arange(256))  # 1 M draws
    n = u.numel()
    assert 0.0 < float(u.min()) and float(u.max()) < 1.0
    # moments: mean 1/2, variance 1/12, each within 5 standard errors
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)
    # 64 equal bins: chi-square with 63 degrees of freedom (99.99th percentile about 113)
    counts = torch.bincount((u * 64).long().flatten(), minlength=64).double()
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 113, chi2
    # neighbours along every axis (rows, positions, columns) are uncorrelated
    for dim in range(3):
        a, b = u.narrow(dim, 0, u.shape[dim] - 1).flatten(), u.narrow(dim, 1, u.shape[dim] - 1).flatten()
        corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
        assert abs(corr) < 5 / math.sqrt(a.numel()), (dim, corr)


def test_the_top_bit_pattern_draws_below_one_and_loses_a_race_at_probability_zero() -> None:
    """Row 0 of seed 0 at position 31 draws the top 24-bit pattern at column 47,095 (checked below): the mapping
    kept 24 bits, that uniform rounded to 1.0, its exponential to -0.0, and a race over a vocabulary where that
    column has probability 0 picked it (0 / -0.0 is NaN, and ``argmax`` takes NaN as the largest)."""
    keys, position, column, vocab = torch.tensor(row_keys(0, [[0]])), torch.tensor([31]), 47095, 151936
    columns = torch.arange(vocab)
    assert int(keyed_bits(keys, position, NOISE_SAMPLE, columns)[0, column]) >> 8 == 2**24 - 1
    u = keyed_uniform(keys, position, NOISE_SAMPLE, columns)
    e = keyed_exponential(keys, position, NOISE_SAMPLE, columns)
    assert float(u.max()) < 1.0 and float(e.min()) > 0.0 and not bool(torch.signbit(e).any())
    probs = torch.zeros(1, vocab)
    probs[0, :1000] = torch.rand(1000, generator=torch.Generator().manual_seed(0)).softmax(-1)  # column 47,095: 0
    for race in (sample_keyed(probs, keys, position), sample_with_noise(probs, e)):
        assert int(race) < 1000


def test_sample_keyed_draws_from_probs() -> None:
    """The race with keyed noise over 20,000 keys: counts of a 6-token distribution pass a chi-square test."""
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    keys = torch.tensor(row_keys(0, [[i] for i in range(20000)]))
    tokens = sample_keyed(probs.expand(len(keys), 6), keys, torch.zeros_like(keys))
    counts = torch.bincount(tokens, minlength=6).double()
    expected = probs.double() * len(keys)
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts)  # 5 degrees of freedom, p = 0.001


def test_compiled_keyed_noise_is_the_eager_noise() -> None:
    """Inductor's code (what the engine's compiled steps run) computes the same bits and the same winners."""

    def race(keys: torch.Tensor, positions: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        columns = torch.arange(probs.shape[-1], device=probs.device)
        bits = keyed_bits(keys, positions, NOISE_SAMPLE, columns)
        return bits, (probs / keyed_exponential(keys, positions, NOISE_SAMPLE, columns)).argmax(-1)

    keys = torch.tensor(row_keys(0, [[i] for i in range(7)]))
    positions = torch.arange(7) * 13
    probs = torch.rand(7, 1000, generator=torch.Generator().manual_seed(0)).softmax(-1)
    compiled = torch.compile(race, fullgraph=True, dynamic=True)
    for eager, fused in zip(race(keys, positions, probs), compiled(keys, positions, probs)):
        assert torch.equal(eager, fused)
