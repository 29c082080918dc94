"""Lossless verification: the exact identity, Monte Carlo against the target, greedy, ragged drafts."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_tlt.core.sampling import (
    NOISE_DRAFT,
    NOISE_SAMPLE,
    keyed_exponential,
    processed_probs,
    row_keys,
    sample_keyed,
    sample_with_noise,
)
from lightning_tlt.rollout.verify import acceptance_probs, residual_probs, verify_chain, verify_coupled

ALPHA = 1e-3  # significance of every chi-square test below (fixed seeds: deterministic outcomes)


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness-of-fit p-value of ``counts`` against ``probs`` (1-D, same length).

    Categories with probability 0 must have no counts (asserted: that would be an outright bug).
    """
    counts = counts.double().flatten()
    probs = probs.double().flatten()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token/sequence of probability 0"
    n = counts.sum()
    expected = n * probs[support]
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    assert support.sum() >= 2, "degenerate target: nothing to test"
    dof = torch.tensor(float(support.sum().item() - 1), dtype=torch.float64)
    return float(1.0 - torch.special.gammainc(dof / 2, stat / 2))


def random_logits(shape: tuple[int, ...], gen: torch.Generator, zero_frac: float = 0.3) -> torch.Tensor:
    logits = torch.randn(shape, generator=gen) * 2.0
    # hard zeros in the distribution (masked vocabulary), never the whole row
    mask = torch.rand(shape, generator=gen) < zero_frac
    mask[..., 0] = False
    return logits.masked_fill(mask, float("-inf"))


@pytest.mark.parametrize("temperature", [0.0, 0.5, 1.0, 1.7])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.7), (8, 0.9)])
def test_exact_identity(temperature: float, top_k: int, top_p: float) -> None:
    gen = torch.Generator().manual_seed(17)
    p = processed_probs(random_logits((64, 32), gen), temperature, top_k, top_p)  # (64, V)
    q = processed_probs(random_logits((64, 32), gen), temperature, top_k, top_p)
    a = acceptance_probs(p, q)
    r = residual_probs(p, q)
    assert torch.all((a >= 0) & (a <= 1))
    torch.testing.assert_close(r.sum(-1), torch.ones(64), atol=1e-6, rtol=0)
    accept_mass = (q * a).sum(-1, keepdim=True)
    torch.testing.assert_close(q * a + (1 - accept_mass) * r, p, atol=1e-6, rtol=0)


def test_exact_identity_edge_cases() -> None:
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    q = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    a = acceptance_probs(p, q)
    r = residual_probs(p, q)
    # hand-derived: q=0 with p>0 -> 1; p=0 -> 0; p == q -> all 1 and residual = p
    torch.testing.assert_close(a[0], torch.tensor([1.0, 1.0, 0.0]))
    torch.testing.assert_close(a[1], torch.ones(3))
    torch.testing.assert_close(r[1], p[1])
    torch.testing.assert_close(r[0], torch.tensor([1.0, 0.0, 0.0]))
    torch.testing.assert_close(r[2], torch.tensor([0.0, 0.0, 1.0]))
    accept_mass = (q * a).sum(-1, keepdim=True)
    torch.testing.assert_close(q * a + (1 - accept_mass) * r, p, atol=1e-7, rtol=0)


def _one_step_counts(
    p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor | None, n: int, seed: int, k: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify n rows sharing p (over k + 1 positions) and q; returns first-token counts and accepted."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p.shape[-1]
    target = p.expand(n, k + 1, vocab)
    if q is None:
        assert draft is not None
        tokens = draft.expand(n, k)
        probs = None
    else:
        tokens = torch.multinomial(q.expand(n * k, vocab), 1, generator=gen).view(n, k)
        probs = q.expand(n, k, vocab)
    out = verify_chain(tokens, probs, target, None, gen)
    return torch.bincount(out.tokens[:, 0], minlength=vocab), out.num_accepted


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_one_step_matches_target_for_random_q(temperature: float) -> None:
    gen = torch.Generator().manual_seed(3)
    p = processed_probs(random_logits((12,), gen), temperature, top_k=9)
    q = processed_probs(random_logits((12,), gen), temperature, top_p=0.9)
    counts, accepted = _one_step_counts(p, q, None, 60_000, seed=11)
    assert chi_square_pvalue(counts, p) > ALPHA
    # acceptance rate matches its closed form sum(min(p, q)) (binomial, 5 sigma)
    expected_rate = torch.minimum(p, q).sum()
    sigma = (expected_rate * (1 - expected_rate) / 60_000).sqrt()
    assert abs(accepted.float().mean() - expected_rate) < 5 * sigma


def test_q_equal_p_accepts_everything() -> None:
    gen = torch.Generator().manual_seed(5)
    p = processed_probs(random_logits((10,), gen), 1.0)
    counts, accepted = _one_step_counts(p, p, None, 40_000, seed=12, k=4)
    assert torch.all(accepted == 4)  # acceptance rate exactly 1
    assert chi_square_pvalue(counts, p) > ALPHA


def test_one_hot_q_deterministic_and_explicit() -> None:
    gen = torch.Generator().manual_seed(6)
    p = processed_probs(random_logits((10,), gen, zero_frac=0.0), 1.0)
    draft = torch.tensor([[int(p.argmin())]])  # an unlikely token: mostly rejected
    counts, accepted = _one_step_counts(p, None, draft, 60_000, seed=13)
    assert chi_square_pvalue(counts, p) > ALPHA
    sigma = (p[draft] * (1 - p[draft]) / 60_000).sqrt()
    assert abs(accepted.float().mean() - p[draft]) < 5 * sigma  # a = p(draft) for a one-hot q
    # an explicit one-hot q must behave exactly like draft_probs=None (same random stream)
    q = torch.nn.functional.one_hot(draft[0, 0], 10).float()
    counts_explicit, _ = _one_step_counts(p, q, None, 60_000, seed=13)
    assert chi_square_pvalue(counts_explicit, p) > ALPHA


def _toy_tables(vocab: int, positions: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Markov tables P[pos, prev, :], Q[pos, prev, :]; prev == vocab is the start symbol."""
    gen = torch.Generator().manual_seed(seed)
    p = processed_probs(random_logits((positions, vocab + 1, vocab), gen, zero_frac=0.2), 1.0, top_k=3)
    q = processed_probs(random_logits((positions, vocab + 1, vocab), gen, zero_frac=0.2), 1.0)
    return p, q


def _speculative_sequences(
    p_tab: torch.Tensor,
    q_tab: torch.Tensor | None,
    n: int,
    length: int,
    k: int,
    seed: int,
    ragged: bool = False,
) -> torch.Tensor:
    """Sample n sequences of ``length`` tokens by repeated draft/verify steps over the toy chain."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p_tab.shape[-1]
    seq = torch.full((n, length + k + 2), vocab, dtype=torch.long)  # column 0: start symbol
    lens = torch.zeros(n, dtype=torch.long)  # tokens generated so far
    rows = torch.arange(n)
    while bool((lens < length).any()):
        active = lens < length  # finished rows keep their sequence (and step harmlessly)
        lens_now = lens.clamp_max(length - 1)
        prev = seq[rows, lens_now]  # token before the first draft
        drafts, dprobs, tprobs = [], [], []
        for j in range(k):
            tprobs.append(p_tab[lens_now + j, prev])
            if q_tab is None:  # deterministic drafter: argmax of a shifted table
                d = p_tab[lens_now + j, prev].roll(1, -1).argmax(-1)
            else:
                qj = q_tab[lens_now + j, prev]
                d = torch.multinomial(qj, 1, generator=gen).squeeze(-1)
                dprobs.append(qj)
            drafts.append(d)
            prev = d
        tprobs.append(p_tab[lens_now + k, prev])
        draft_lens = torch.randint(0, k + 1, (n,), generator=gen) if ragged else None
        out = verify_chain(
            torch.stack(drafts, 1),
            torch.stack(dprobs, 1) if q_tab is not None else None,
            torch.stack(tprobs, 1),
            draft_lens,
            gen,
        )
        for j in range(k + 1):
            write = active & (j < out.num_emitted)
            seq[rows[write], lens[write] + 1 + j] = out.tokens[write, j]
        lens = torch.where(active, lens + out.num_emitted, lens)
    return seq[:, 1 : length + 1]


def _sequence_probs(p_tab: torch.Tensor, length: int) -> torch.Tensor:
    """Exact probability of every sequence, indexed as ``_sequence_index`` does (base-V digits)."""
    vocab = p_tab.shape[-1]
    probs = p_tab[0, vocab]  # (V,)
    for t in range(1, length):
        last = torch.arange(probs.numel()) % vocab  # last token of each prefix
        probs = (probs.unsqueeze(-1) * p_tab[t, last]).reshape(-1)  # (V ** (t + 1),)
    return probs


def _sequence_index(seqs: torch.Tensor, vocab: int) -> torch.Tensor:
    index = torch.zeros(seqs.shape[0], dtype=torch.long)
    for t in range(seqs.shape[1]):
        index = index * vocab + seqs[:, t]
    return index


@pytest.mark.parametrize(("drafter", "ragged"), [("random", False), ("random", True), ("argmax", False)])
def test_multi_step_chain_matches_sequence_probabilities(drafter: str, ragged: bool) -> None:
    vocab, length, k, n = 4, 3, 3, 40_000
    p_tab, q_tab = _toy_tables(vocab, length + k + 2, seed=21)
    seqs = _speculative_sequences(p_tab, q_tab if drafter == "random" else None, n, length, k, 22, ragged)
    exact = _sequence_probs(p_tab, length)  # (V ** length,)
    torch.testing.assert_close(exact.sum(), torch.tensor(1.0), atol=1e-5, rtol=0)
    counts = torch.bincount(_sequence_index(seqs, vocab), minlength=vocab**length)
    assert chi_square_pvalue(counts, exact) > ALPHA


def test_greedy_accepts_iff_argmax() -> None:
    gen = torch.Generator().manual_seed(8)
    bsz, k, vocab = 32, 5, 11
    target = processed_probs(torch.randn(bsz, k + 1, vocab, generator=gen), 0.0)  # one-hot
    argmax = target.argmax(-1)  # (B, k+1)
    drafts = argmax[:, :k].clone()
    # corrupt one position per row (or none for the first 6 rows)
    wrong_at = torch.randint(0, k, (bsz,), generator=gen)
    wrong_at[:6] = k
    for b in range(bsz):
        if wrong_at[b] < k:
            drafts[b, wrong_at[b]] = (drafts[b, wrong_at[b]] + 1) % vocab
    draft_probs = processed_probs(torch.randn(bsz, k, vocab, generator=gen), 0.0)
    for probs in (None, draft_probs):
        out = verify_chain(drafts, probs, target, None, gen)
        assert torch.equal(out.num_accepted, wrong_at)
        for b in range(bsz):
            n = int(wrong_at[b])
            assert out.tokens[b, : n + 1].tolist() == argmax[b, : n + 1].tolist()  # greedy continuation
            assert torch.all(out.tokens[b, n + 1 :] == 0)
        assert torch.all(out.logprobs == 0)  # log 1 for emitted tokens, 0 padding after


def test_ragged_draft_lengths_and_outputs() -> None:
    gen = torch.Generator().manual_seed(9)
    bsz, k, vocab = 6, 4, 7
    target = processed_probs(torch.randn(bsz, k + 1, vocab, generator=gen), 1.0)
    drafts = torch.randint(0, vocab, (bsz, k), generator=gen)
    # q == p on the drafted positions: every valid draft is accepted with probability 1
    draft_probs = target[:, :k].clone()
    lens = torch.tensor([0, 1, 2, 3, 4, 2])
    out = verify_chain(drafts, draft_probs, target, lens, gen, pad_token_id=-1)
    assert torch.equal(out.num_accepted, lens)
    assert torch.equal(out.num_emitted, lens + 1)
    for b in range(bsz):
        n = int(lens[b])
        assert out.tokens[b, :n].tolist() == drafts[b, :n].tolist()
        assert torch.all(out.tokens[b, n + 1 :] == -1)
        expected = target[b, torch.arange(n + 1), out.tokens[b, : n + 1]].log()
        torch.testing.assert_close(out.logprobs[b, : n + 1], expected)
        assert torch.all(out.logprobs[b, n + 1 :] == 0)


def test_zero_draft_length_samples_target_exactly() -> None:
    gen = torch.Generator().manual_seed(10)
    p = processed_probs(random_logits((9,), gen, zero_frac=0.0), 1.0)
    n, k = 50_000, 2
    drafts = torch.full((n, k), int(p.argmax()))
    out = verify_chain(drafts, None, p.expand(n, k + 1, 9), torch.zeros(n, dtype=torch.long), gen)
    assert torch.all(out.num_accepted == 0)
    assert chi_square_pvalue(torch.bincount(out.tokens[:, 0], minlength=9), p) > ALPHA


def test_same_generator_state_same_result() -> None:
    gen = torch.Generator().manual_seed(1)
    target = processed_probs(torch.randn(8, 4, 6, generator=gen), 1.0)
    q = processed_probs(torch.randn(8, 3, 6, generator=gen), 1.0)
    drafts = torch.randint(0, 6, (8, 3), generator=gen)
    a = verify_chain(drafts, q, target, None, torch.Generator().manual_seed(99))
    b = verify_chain(drafts, q, target, None, torch.Generator().manual_seed(99))
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


def test_bad_shapes_raise() -> None:
    with pytest.raises(ValueError, match=r"target_probs must have shape"):
        verify_chain(torch.zeros(2, 3, dtype=torch.long), None, torch.rand(2, 3, 5))
    with pytest.raises(ValueError, match=r"draft_probs must have shape"):
        verify_chain(torch.zeros(2, 3, dtype=torch.long), torch.rand(2, 2, 5), torch.rand(2, 4, 5))


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.5]),
    top_k=st.integers(0, 10),
    top_p=st.floats(0.05, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_exact_identity_property(vocab: int, temperature: float, top_k: int, top_p: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    p = processed_probs(random_logits((4, vocab), gen), temperature, top_k, top_p)
    q = processed_probs(random_logits((4, vocab), gen), temperature, top_k, top_p)
    a, r = acceptance_probs(p, q), residual_probs(p, q)
    torch.testing.assert_close(q * a + (1 - (q * a).sum(-1, keepdim=True)) * r, p, atol=1e-6, rtol=0)


def test_non_finite_draft_distributions_are_rejections() -> None:
    """A NaN/inf drafter proposes nothing: never accepted, and the emitted token is distributed as p
    (today's bug: ``acceptance_probs`` sent NaN to its ``p > 0`` branch and accepted it)."""
    gen = torch.Generator().manual_seed(31)
    p = processed_probs(random_logits((10,), gen, zero_frac=0.0), 1.0)
    n, k = 40_000, 3
    tokens = torch.randint(0, 10, (n, k), generator=gen)
    q = torch.full((n, k, 10), float("nan"))
    q[: n // 2, 1:] = 0.1  # half the rows: position 0 NaN, later ones finite (still never reached)
    q[n // 2 :, :, 3] = float("inf")
    out = verify_chain(tokens, q, p.expand(n, k + 1, 10), None, gen)
    assert torch.all(out.num_accepted == 0)
    assert chi_square_pvalue(torch.bincount(out.tokens[:, 0], minlength=10), p) > ALPHA
    assert torch.equal(acceptance_probs(torch.tensor([0.5, 0.5]), torch.tensor([float("nan"), float("inf")])),
                       torch.zeros(2))


def test_a_finite_prefix_is_verified_before_a_non_finite_position() -> None:
    """Drafts before the first non-finite position are verified as usual (q = p there: all accepted)."""
    gen = torch.Generator().manual_seed(32)
    p = processed_probs(random_logits((10,), gen, zero_frac=0.0), 1.0)
    n = 5_000
    tokens = torch.multinomial(p.expand(n, 10), 2, replacement=True, generator=gen)
    q = p.expand(n, 2, 10).clone()
    q[:, 1] = float("nan")
    out = verify_chain(tokens, q, p.expand(n, 3, 10), None, gen)
    assert torch.all(out.num_accepted == 1)  # position 0 (q = p) accepted, position 1 never
    assert chi_square_pvalue(torch.bincount(out.tokens[:, 1], minlength=10), p) > ALPHA


def test_draft_vocabulary_keeps_verification_exact() -> None:
    """q over a draft vocabulary (4 of 10 tokens): the emitted token is still distributed as p, and the
    acceptance rate is its closed form sum over the draft vocabulary of min(p, q)."""
    gen = torch.Generator().manual_seed(33)
    p = processed_probs(random_logits((10,), gen, zero_frac=0.0), 1.0)
    vocab_ids = torch.tensor([1, 4, 5, 8])
    q_small = processed_probs(random_logits((4,), gen, zero_frac=0.0), 1.0)
    n = 60_000
    index = torch.multinomial(q_small.expand(n, 4), 1, replacement=True, generator=gen)  # (n, 1)
    out = verify_chain(vocab_ids[index], q_small.expand(n, 1, 4), p.expand(n, 2, 10), None, gen,
                       draft_vocab=vocab_ids, draft_index=index)
    assert chi_square_pvalue(torch.bincount(out.tokens[:, 0], minlength=10), p) > ALPHA
    rate = torch.minimum(p[vocab_ids], q_small).sum()
    sigma = (rate * (1 - rate) / n).sqrt()
    assert abs(out.num_accepted.float().mean() - rate) < 5 * sigma
    with pytest.raises(ValueError, match="draft_vocab needs draft_index"):
        verify_chain(vocab_ids[index], q_small.expand(n, 1, 4), p.expand(n, 2, 10), None, gen, draft_vocab=vocab_ids)


# ------------------------------------------------------------------------- keyed noise, coupled verification
def _keyed_sequences(
    p_tab: torch.Tensor, q_tab: torch.Tensor | None, n: int, length: int, k: int, seed: int, mode: str
) -> tuple[torch.Tensor, int]:
    """Sequences of the toy chain by draft/verify steps on keyed noise, as the engine runs them.

    ``mode``: "rejection" (`verify_chain`, drafts raced with their own `NOISE_DRAFT` numbers),
    "coupled" (`verify_coupled`, drafts raced with the verifier's `NOISE_SAMPLE` numbers: the Gumbel
    coupling) or "plain" (no drafts: one keyed race a token, as plain decoding). Returns the sequences
    and the drafts accepted in all.
    """
    vocab = p_tab.shape[-1]
    keys = torch.tensor(row_keys(seed, [[i] for i in range(n)]))
    cols = torch.arange(vocab)
    seq = torch.full((n, length + k + 2), vocab, dtype=torch.long)  # column 0: start symbol
    lens = torch.zeros(n, dtype=torch.long)
    rows = torch.arange(n)
    accepted = 0
    k = 0 if mode == "plain" else k
    while bool((lens < length).any()):
        active = lens < length
        lens_now = lens.clamp_max(length - 1)
        prev = seq[rows, lens_now]
        drafts, dprobs, tprobs = [], [], []
        for j in range(k):
            tprobs.append(p_tab[lens_now + j, prev])
            if q_tab is None:  # a deterministic drafter
                d = p_tab[lens_now + j, prev].roll(1, -1).argmax(-1)
            else:
                qj = q_tab[lens_now + j, prev]
                purpose = NOISE_SAMPLE if mode == "coupled" else NOISE_DRAFT
                d = sample_with_noise(qj, keyed_exponential(keys, lens_now + j, purpose, cols))
                dprobs.append(qj)
            drafts.append(d)
            prev = d
        tprobs.append(p_tab[lens_now + k, prev])
        draft_tokens = torch.stack(drafts, 1) if k else torch.zeros(n, 0, dtype=torch.long)
        if mode == "coupled" or mode == "plain":
            out = verify_coupled(draft_tokens, torch.stack(tprobs, 1), keys=keys, start=lens_now)
        else:
            out = verify_chain(draft_tokens, torch.stack(dprobs, 1) if q_tab is not None else None,
                               torch.stack(tprobs, 1), keys=keys, start=lens_now)
        accepted += int(out.num_accepted[active].sum())
        for j in range(k + 1):
            write = active & (j < out.num_emitted)
            seq[rows[write], lens[write] + 1 + j] = out.tokens[write, j]
        lens = torch.where(active, lens + out.num_emitted, lens)
    return seq[:, 1 : length + 1], accepted


@pytest.mark.parametrize(("mode", "drafter"), [("rejection", "random"), ("rejection", "argmax"),
                                               ("coupled", "random"), ("coupled", "argmax")])
def test_keyed_verification_matches_sequence_probabilities(mode: str, drafter: str) -> None:
    """Chi-square losslessness of both verification rules on keyed noise (the engine's randomness)."""
    vocab, length, k, n = 4, 3, 3, 40_000
    p_tab, q_tab = _toy_tables(vocab, length + k + 2, seed=21)
    seqs, accepted = _keyed_sequences(p_tab, q_tab if drafter == "random" else None, n, length, k, 23, mode)
    assert accepted > n // 10  # drafts were often accepted: verification, not plain sampling, was tested
    counts = torch.bincount(_sequence_index(seqs, vocab), minlength=vocab**length)
    assert chi_square_pvalue(counts, _sequence_probs(p_tab, length)) > ALPHA


@pytest.mark.parametrize("drafter", ["random", "argmax", "target"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_coupled_verification_emits_the_plain_samplers_tokens(drafter: str, k: int) -> None:
    """Same keys: coupled speculation gives plain keyed sampling's sequences exactly, whatever the drafts."""
    vocab, length, n = 5, 6, 2_000
    p_tab, q_tab = _toy_tables(vocab, length + k + 2, seed=31)
    plain, _ = _keyed_sequences(p_tab, None, n, length, k, 7, "plain")
    drafts = {"random": q_tab, "argmax": None, "target": p_tab}[drafter]
    spec, accepted = _keyed_sequences(p_tab, drafts, n, length, k, 7, "coupled")
    assert torch.equal(spec, plain)
    if drafter == "target":  # q == p raced with the same numbers: every draft is the winner
        assert accepted == n * k * -(-length // (k + 1))  # k accepted drafts in every step


def test_coupled_acceptance_is_the_gumbel_couplings() -> None:
    """One position, q != p: coupled accepts a q-raced draft with P(argmax q/E == argmax p/E), which lies in
    [(1 - d) / (1 + d), 1 - d] for d the total variation; a deterministic draft with p(draft)."""
    gen = torch.Generator().manual_seed(3)
    p = processed_probs(random_logits((12,), gen), 1.0, top_k=9)
    q = processed_probs(random_logits((12,), gen), 1.0, top_p=0.9)
    n = 60_000
    keys = torch.tensor(row_keys(4, [[i] for i in range(n)]))
    start = torch.zeros(n, dtype=torch.long)
    drafts = sample_keyed(q.expand(n, 12), keys, start)  # the verifier's own numbers at position 0
    out = verify_coupled(drafts[:, None], p.expand(n, 2, 12), keys=keys, start=start)
    assert chi_square_pvalue(torch.bincount(out.tokens[:, 0], minlength=12), p) > ALPHA
    rate = out.num_accepted.float().mean()
    d = 0.5 * (p - q).abs().sum()
    assert (1 - d) / (1 + d) - 0.01 < rate < 1 - d + 0.01, (float(rate), float(d))
    fixed = torch.full((n, 1), int(p.argmax()))
    out = verify_coupled(fixed, p.expand(n, 2, 12), keys=keys, start=start)
    sigma = (p.max() * (1 - p.max()) / n).sqrt()
    assert abs(out.num_accepted.float().mean() - p.max()) < 5 * sigma


def test_coupled_verification_shapes_and_ragged_drafts() -> None:
    target = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]] * 2)  # one-hot: w = 1, 2, 0
    drafts = torch.tensor([[1, 2], [1, 2]])
    out = verify_coupled(drafts, target, torch.tensor([2, 1]), noise=torch.ones(2, 3, 3), pad_token_id=-1)
    assert out.num_accepted.tolist() == [2, 1]
    assert out.tokens.tolist() == [[1, 2, 0], [1, 2, -1]]  # row 1: draft 1 is past its length, w emitted
    assert torch.all(out.logprobs == 0)
    with pytest.raises(ValueError, match="keys and start"):
        verify_coupled(drafts, target)
    with pytest.raises(ValueError, match="target_probs"):
        verify_coupled(drafts, target[:, :2])
