"""Lossless verification of drafted tokens: rejection sampling, or coupling with the plain sampler.

Speculative sampling (Leviathan, Kalman and Matias 2023, "Fast Inference from Transformers via
Speculative Decoding", Algorithm 1 and Theorem 3.5; Chen et al. 2023, "Accelerating Large Language
Model Decoding with Speculative Sampling", Algorithm 2): a drafter proposes ``x ~ q``; the target
accepts it with probability

    a(x) = min(1, p(x) / q(x))                                   (acceptance, Leviathan eq. in §2.3)

and on rejection samples from the residual

    r(x) = (p(x) - q(x))+ / sum_y (p(y) - q(y))+                 (Chen et al., the "(.)+" operator)

Then ``P(emit x) = q(x) a(x) + (1 - sum_y q(y) a(y)) r(x) = min(p, q) + (p - q)+ = p(x)``: the
emitted token is distributed exactly as ``p``, at any temperature, top-k and top-p, as long as
``p`` and ``q`` are the distributions after the same processing
(`lightning_tlt.core.sampling.processed_probs`). A chain of k drafts is verified left to right:
the first rejection emits a residual sample and discards the rest; if all k are accepted, one
bonus token is sampled from the target's distribution at position k. Every row therefore emits
between 1 and k + 1 tokens per verify forward.

Deterministic drafts (the suffix drafter, or an argmax drafter) are the special case
``q = one_hot(draft)``: ``a = p(draft)`` and ``r = p`` with the draft token removed, renormalised.
At temperature 0 ``p`` is one-hot, so the same code accepts iff ``draft == argmax`` and the
correction is the argmax: greedy stays greedy.

A draft distribution that is not finite (a drafter with NaN or infinite weights, a diverged
co-trained drafter) proposes nothing: from its first non-finite position on, a row's drafts count
as "no draft", so they are rejected and the emitted token is sampled from ``p`` itself. Speculation
can cost speed, never the distribution.

A drafter may draft over a *draft vocabulary* (EAGLE-3's reduced head: the ``Vd`` most frequent
tokens): ``q`` is then ``(B, k, Vd)`` over the target ids ``draft_vocab`` and 0 on every other
token, which the formulas above handle as they are.

Coupled verification (`verify_coupled`) is the other lossless rule, for keyed noise
(`lightning_tlt.core.sampling`): plain decoding picks the token at position ``t`` as the exponential
race's winner ``w_t = argmax(p_t / E_t)``, its noise ``E_t`` a function of the row's key and ``t``
alone. The verifier computes the same winners from the target's distributions at the k + 1 positions,
accepts drafts while they equal the winners and emits the winner at the first mismatch (or the bonus
winner after k accepted drafts). The emitted tokens are the plain sampler's for those keys, whatever
the drafter proposed: distributed exactly as ``p`` (each ``w_t ~ p_t``, the race being exact and the
``E_t`` independent across positions), and speculation on or off gives the same tokens. A drafted
token is accepted with probability ``p(d)`` for a deterministic draft (as in rejection sampling); a
drafter that races its own ``q`` with the same ``E_t`` is accepted with the Gumbel coupling's
probability ``P(argmax q/E = argmax p/E)``: at least ``(1 - d) / (1 + d)`` for the total variation
``d`` between ``p`` and ``q`` (Daliri et al. 2024, "Coupling without Communication"), below rejection
sampling's ``1 - d``, and 1 when ``q == p``.

Everything here is vectorised over rows, never syncs with the host, and draws its randomness from
keyed noise (``keys``, ``start``: what a compiled step uses), from noise drawn beforehand
(``uniforms``, ``noise``), or from an explicit ``torch.Generator``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_tlt.core.sampling import (
    NOISE_ACCEPT,
    NOISE_SAMPLE,
    PROB_FLOOR,
    exponential_noise,
    keyed_exponential,
    keyed_uniform,
    sample_with_noise,
)


@dataclass
class VerifyResult:
    """What one verify step decided, per row (all tensors on the device of the inputs)."""

    num_accepted: Tensor
    """``(B,)`` long: how many drafted tokens were accepted, in ``[0, draft_len]``."""
    tokens: Tensor
    """``(B, k + 1)`` long: the accepted drafts, then the correction (on a rejection) or bonus token
    (when all drafts were accepted), then ``pad_token_id``."""
    logprobs: Tensor
    """``(B, k + 1)`` float32: log-probability of each emitted token under the target's (processed)
    distribution at its position, the distribution it is exactly distributed as; 0 after the emitted
    tokens."""
    num_emitted: Tensor
    """``(B,)`` long: ``num_accepted + 1``, the tokens each row appends (and its KV length advance)."""


def acceptance_probs(p: Tensor, q: Tensor) -> Tensor:
    """Probability of accepting a drafted token, ``min(1, p / q)`` (Leviathan et al. 2023, §2.3).

    Works elementwise, so it serves both the drafted token's values (``(B, k)``) and whole
    distributions (``(..., V)``, used by the exactness test). Where ``q == 0`` the token cannot have
    been drafted from ``q``; the limit of the ratio is used: 1 if ``p > 0`` and 0 if ``p == 0`` (a
    token the target cannot emit is never accepted). ``q * a`` is 0 there either way, so the
    identity ``q·a + (1 - Σ q·a)·r = p`` is unaffected.

    Args:
        p: target probabilities, any shape.
        q: draft probabilities, same shape.

    Returns:
        Acceptance probabilities in ``[0, 1]``, same shape and dtype as ``p``.
    """
    ratio = (p / q.clamp_min(torch.finfo(q.dtype).tiny)).clamp_max(1.0)
    accept = torch.where(q > 0, ratio, (p > 0).to(p.dtype))
    return torch.where(torch.isfinite(q), accept, torch.zeros_like(accept))  # a NaN/inf draft: never accepted


def residual_probs(p: Tensor, q: Tensor) -> Tensor:
    """The distribution sampled after a rejection, ``normalise((p - q)+)`` (Chen et al. 2023, Alg. 2).

    When the residual mass is 0 (``p == q``, so a rejection has probability 0 and the value does
    not matter for correctness) ``p`` is returned, which also makes "no draft" (``q = 0``) the plain
    target distribution.

    Args:
        p: ``(..., V)`` target probabilities.
        q: ``(..., V)`` draft probabilities.

    Returns:
        ``(..., V)`` probabilities summing to 1.
    """
    diff = (p - q).clamp_min(0.0)
    mass = diff.sum(-1, keepdim=True)
    return torch.where(mass > 0, diff / mass.clamp_min(torch.finfo(diff.dtype).tiny), p)


def _chain_shape(draft_tokens: Tensor, target_probs: Tensor) -> tuple[int, int]:
    """``(B, k)`` of the drafts, checked against the target's ``(B, k + 1, V)``."""
    bsz, k = draft_tokens.shape
    if torch.compiler.is_compiling():  # the engine's own shapes; a compiled check would guard on every size
        return bsz, k
    if target_probs.dim() != 3 or target_probs.shape[:2] != (bsz, k + 1):
        raise ValueError(
            f"target_probs must have shape (B, k + 1, V) = ({bsz}, {k + 1}, V), got {tuple(target_probs.shape)}"
        )
    return bsz, k


def verify_chain(
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    target_probs: Tensor,
    draft_lens: Tensor | None = None,
    generator: torch.Generator | None = None,
    *,
    pad_token_id: int = 0,
    draft_vocab: Tensor | None = None,
    draft_index: Tensor | None = None,
    uniforms: Tensor | None = None,
    noise: Tensor | None = None,
    keys: Tensor | None = None,
    start: Tensor | None = None,
) -> VerifyResult:
    """Verify a chain of drafted tokens per row by speculative rejection sampling.

    Row ``b`` drafted ``draft_tokens[b, :draft_lens[b]]``; the target's forward over
    ``[last_token, d_0, ..., d_{k-1}]`` gave ``target_probs[b, j]``, the distribution of the token at
    draft position ``j`` (so ``target_probs[b, k]`` is the bonus distribution after all k drafts).
    Positions ``>= draft_lens[b]`` count as "no draft": they are always rejected and their residual
    is ``p`` itself, so rows with different draft lengths (including 0) share one call and one
    static shape.

    Args:
        draft_tokens: ``(B, k)`` long drafted tokens (any id in ``[0, V)`` at positions past the row's
            length, e.g. 0).
        draft_probs: ``(B, k, V)`` (or ``(B, k, Vd)`` with ``draft_vocab``) the drafter's processed
            distributions the drafts were sampled from, or ``None`` for deterministic drafts (``q``
            one-hot at the drafted token). Rows whose distribution at a position is not finite
            propose nothing from that position on.
        target_probs: ``(B, k + 1, V)`` the target's processed distributions (same temperature,
            top-k and top-p as the drafter's).
        draft_lens: ``(B,)`` long number of valid drafts per row, in ``[0, k]``; ``None`` means k.
        generator: source of all randomness (uniforms for acceptance, exponentials for the
            correction sample); on the tensors' device.
        pad_token_id: value written in ``tokens`` after each row's emitted tokens.
        draft_vocab: ``(Vd,)`` long target ids of ``draft_probs``' columns (a draft vocabulary), or
            ``None`` when ``draft_probs`` spans the whole vocabulary.
        draft_index: ``(B, k)`` long column of each drafted token in ``draft_probs`` (needed with
            ``draft_vocab``).
        uniforms: ``(B, k)`` uniform draws for the acceptance tests (``None``: from ``generator``).
        noise: ``(B, V)`` ``Exp(1)`` draws for the correction sample (``None``: from ``generator``).
        keys: ``(B,)`` row keys of keyed noise (`lightning_tlt.core.sampling.row_keys`), with
            ``start``, ``(B,)`` the completion position of draft 0: the acceptance uniforms of position
            ``t`` are ``keyed_uniform(key, t, NOISE_ACCEPT)`` and the correction (or bonus) token at
            position ``t`` races with ``keyed_exponential(key, t, NOISE_SAMPLE)``, plain decoding's
            numbers. Used where ``uniforms`` / ``noise`` are not given.

    Returns:
        A `VerifyResult`.
    """
    bsz, k = _chain_shape(draft_tokens, target_probs)
    vocab = target_probs.shape[-1]
    width = vocab if draft_vocab is None else draft_vocab.shape[0]
    if not torch.compiler.is_compiling() and draft_probs is not None and draft_probs.shape != (bsz, k, width):
        raise ValueError(
            f"draft_probs must have shape (B, k, V) = ({bsz}, {k}, {width}) or be None, "
            f"got {tuple(draft_probs.shape)}"
        )
    if not torch.compiler.is_compiling() and draft_vocab is not None and (
        draft_index is None or draft_index.shape != (bsz, k)
    ):
        raise ValueError("draft_vocab needs draft_index, the (B, k) column of each drafted token in draft_probs")
    device = target_probs.device
    positions = torch.arange(k + 1, device=device)  # (k+1,)
    if draft_lens is None:
        valid = torch.ones(bsz, k, dtype=torch.bool, device=device)
    else:
        valid = positions[:k].unsqueeze(0) < draft_lens.unsqueeze(1)  # (B, k)
    if draft_probs is not None:  # a non-finite distribution proposes nothing, from there on
        finite = torch.isfinite(draft_probs).all(-1)  # (B, k)
        valid = valid & finite.long().cumprod(dim=1).bool()
    lens = valid.long().sum(dim=1)  # (B,) valid drafts (a prefix of each row)

    # acceptance of each drafted token, then the first rejection per row
    p_draft = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # (B, k)
    if draft_probs is None:
        q_draft = torch.ones_like(p_draft)
    else:
        column = draft_tokens if draft_vocab is None else draft_index
        assert column is not None
        q_draft = draft_probs.gather(-1, column.unsqueeze(-1)).squeeze(-1)  # (B, k)
    accept_p = acceptance_probs(p_draft, q_draft)
    if uniforms is None and keys is not None:
        assert start is not None, "keyed noise needs the start positions"
        uniforms = keyed_uniform(keys[:, None], start[:, None] + positions[None, :k], NOISE_ACCEPT)
    if uniforms is None:
        uniforms = torch.rand(bsz, k, generator=generator, device=device, dtype=accept_p.dtype)
    accepted = (uniforms < accept_p) & valid  # (B, k)
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # (B,)

    # the correction (residual after a rejected draft) or bonus (plain p) token at position n
    row = torch.arange(bsz, device=device)
    p_n = target_probs[row, num_accepted]  # (B, V)
    n_is_draft = num_accepted < lens
    n_clamped = num_accepted.clamp_max(k - 1) if k > 0 else num_accepted
    if k == 0:
        q_n = torch.zeros_like(p_n)
    elif draft_probs is None:
        q_n = torch.nn.functional.one_hot(draft_tokens[row, n_clamped], vocab).to(p_n.dtype)
    elif draft_vocab is None:
        q_n = draft_probs[row, n_clamped].to(p_n.dtype)  # (B, V)
    else:
        q_n = p_n.new_zeros(bsz, vocab).index_copy(1, draft_vocab, draft_probs[row, n_clamped].to(p_n.dtype))
    # "no draft" there (none proposed, or a non-finite one): residual = p (and no NaN reaches it)
    q_n = torch.where(n_is_draft.unsqueeze(-1), q_n, torch.zeros_like(q_n))
    if noise is None and keys is not None:
        assert start is not None, "keyed noise needs the start positions"
        noise = keyed_exponential(keys, start + num_accepted, NOISE_SAMPLE, torch.arange(vocab, device=device))
    if noise is None:
        noise = exponential_noise((bsz, vocab), generator, device)
    correction = sample_with_noise(residual_probs(p_n, q_n), noise)  # (B,)

    # assemble emitted tokens and their log-probabilities under the target
    at_n = positions.unsqueeze(0) == num_accepted.unsqueeze(1)  # (B, k+1)
    emitted = positions.unsqueeze(0) <= num_accepted.unsqueeze(1)  # (B, k+1)
    chosen = torch.cat([draft_tokens, correction.unsqueeze(1)], dim=1)  # (B, k+1), valid ids everywhere
    chosen = torch.where(at_n, correction.unsqueeze(1), chosen)
    logp = target_probs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).float().clamp_min(PROB_FLOOR).log()
    tokens = torch.where(emitted, chosen, torch.full_like(chosen, pad_token_id))
    logprobs = torch.where(emitted, logp, torch.zeros_like(logp))
    return VerifyResult(
        num_accepted=num_accepted, tokens=tokens, logprobs=logprobs, num_emitted=num_accepted + 1
    )


def verify_coupled(
    draft_tokens: Tensor,
    target_probs: Tensor,
    draft_lens: Tensor | None = None,
    *,
    noise: Tensor | None = None,
    keys: Tensor | None = None,
    start: Tensor | None = None,
    pad_token_id: int = 0,
) -> VerifyResult:
    """Verify drafts by coupling with the plain sampler: accept while a draft is the race's winner.

    The token at draft position ``j`` of row ``b`` is ``w[b, j] = argmax(target_probs[b, j] / E[b, j])``
    (the exponential race, as plain decoding runs it); drafts are accepted while they equal it, and
    the first mismatch (or position ``k`` after k accepted drafts) emits the winner. See the module
    docstring for why this is lossless; with keyed noise it emits exactly plain decoding's tokens.

    Args:
        draft_tokens: ``(B, k)`` long drafted tokens.
        target_probs: ``(B, k + 1, V)`` the target's processed distributions.
        draft_lens: ``(B,)`` valid drafts per row (``None``: k); positions past it are never accepted.
        noise: ``(B, k + 1, V)`` ``Exp(1)`` draws; ``None``: keyed, from ``keys`` and ``start``.
        keys: ``(B,)`` row keys (`lightning_tlt.core.sampling.row_keys`).
        start: ``(B,)`` completion position of draft 0 (each row's tokens generated so far).
        pad_token_id: value written after each row's emitted tokens.

    Returns:
        A `VerifyResult`.
    """
    bsz, k = _chain_shape(draft_tokens, target_probs)
    device = target_probs.device
    positions = torch.arange(k + 1, device=device)  # (k+1,)
    if noise is None:
        if keys is None or start is None:
            raise ValueError("verify_coupled needs noise, or keys and start to compute it")
        columns = torch.arange(target_probs.shape[-1], device=device)
        noise = keyed_exponential(keys[:, None], start[:, None] + positions[None], NOISE_SAMPLE, columns)
    winners = sample_with_noise(target_probs, noise)  # (B, k+1): the plain sampler's tokens
    valid = torch.ones(bsz, k, dtype=torch.bool, device=device)
    if draft_lens is not None:
        valid = positions[None, :k] < draft_lens[:, None]
    accepted = (draft_tokens == winners[:, :k]) & valid
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # (B,)
    emitted = positions[None] <= num_accepted[:, None]  # (B, k+1)
    logp = target_probs.gather(-1, winners.unsqueeze(-1)).squeeze(-1).float().clamp_min(PROB_FLOOR).log()
    return VerifyResult(
        num_accepted=num_accepted,
        tokens=torch.where(emitted, winners, torch.full_like(winners, pad_token_id)),
        logprobs=torch.where(emitted, logp, torch.zeros_like(logp)),
        num_emitted=num_accepted + 1,
    )
