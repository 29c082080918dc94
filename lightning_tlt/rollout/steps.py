"""The device work of one engine step, as functions ``torch.compile`` fuses and a CUDA graph replays.

Each function reads and writes only static buffers (`lightning_tlt.rollout.slot_state.SlotState`)
and tensors handed in, and never syncs with the host. Its randomness is keyed noise
(`lightning_tlt.core.sampling.keyed_exponential`) computed inside the function from each row's key
(``SlotState.keys``) and completion position (``SlotState.num_generated``): no generator is traced
or captured, and a row draws the same numbers in any batch, slot or step kind. The policy's forward
is compiled on its own, by region (`PolicyRegions`: the embeddings, one decoder layer that every
layer runs, the head), or as one graph (`policy_step`); these are the rest of a step:

- `decode_update`: the head's sampling (temperature, top-k, top-p, the exponential race, the
  logprob) and the state update of a plain decode step;
- `verify_update`: the target's processed distributions, `verify_chain` (rejection sampling) or
  `verify_coupled` (the plain sampler's tokens), the state update (stop tokens, length caps), the
  EAGLE catch-up block and the speculation counters;
- `draft_sample`: one EAGLE draft token per row from a predicted feature, over the draft
  vocabulary's head.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_tlt.core.compile_cache import env_off
from lightning_tlt.core.runner import FusedProjections, decoder_layer_split, rms_norm, rope_cos_sin
from lightning_tlt.core.sampling import (
    NOISE_DRAFT,
    NOISE_SAMPLE,
    PROB_FLOOR,
    keyed_exponential,
    processed_probs,
    sample_with_noise,
)
from lightning_tlt.rollout.slot_state import SlotState
from lightning_tlt.rollout.verify import verify_chain, verify_coupled

if TYPE_CHECKING:
    from lightning_tlt.core.runner import ModelRunner
    from lightning_tlt.core.stored_compile import CompileStore, DynamicDims

RECOMPILE_LIMIT = 64
"""Compiled versions allowed per step function (torch's default is 8)."""


def allow_recompiles(limit: int = RECOMPILE_LIMIT) -> None:
    """Raise Dynamo's recompile limits (never lower them) for the engine's compiled steps.

    Even ``dynamic=True`` specialises on batch 1, on sizes equal to another size, on ``None``
    inputs and on each sampling key: a speculating engine meets a dozen versions of a step over
    its batch buckets, draft lengths and sampling keys. At torch's default of 8 the ninth raises
    (``fullgraph=True``) and the engine would then run uncompiled for the rest of its life.
    """
    import torch._dynamo.config as dynamo_config

    dynamo_config.recompile_limit = max(int(dynamo_config.recompile_limit), limit)
    dynamo_config.accumulated_recompile_limit = max(int(dynamo_config.accumulated_recompile_limit), 16 * limit)


def compile_settings() -> contextlib.AbstractContextManager[None]:
    """The symbolic-shape settings the engine's steps compile under (a context around their calls).

    Duck sizing off: by default Dynamo assumes two sizes that were equal at the first compile stay
    equal (the batch and the slot count, the draft length and its maximum), so the first step that
    breaks the equality recompiles every step function, in the middle of a rollout (measured on the
    H200: 53 s of one RL step). Without it the steps' versions are all compiled in the first rollout
    (on the CPU: none after it, against seven). Scoped to the engine's calls: nothing else is affected.
    """
    import torch.fx.experimental._config as fx_config

    return cast(contextlib.AbstractContextManager[None], fx_config.patch(use_duck_shape=False))  # type: ignore[attr-defined]


def rows_dynamic(runner: Any, tokens: Tensor, positions: Tensor, *rest: Any) -> dict[int, list[int]]:
    """`policy_step`'s dynamic sizes (a `lightning_tlt.core.stored_compile.DynamicDims`): the rows, and a
    verify's tokens per row above one, of ``tokens`` and ``positions`` (its arguments 1 and 2).

    Without them the first batch compiles a static version and the second a dynamic one (and the
    first verify another static one): one trace of the whole policy each. Sizes 0 and 1 cannot be
    dynamic (Dynamo specialises them): a decode's single token per row stays static.
    """
    dims = [d for d in (0, 1) if tokens.shape[d] > 1]
    return {1: dims, 2: dims}


def policy_step(
    runner: ModelRunner, tokens: Tensor, positions: Tensor, k_cache: Sequence[Tensor], v_cache: Sequence[Tensor],
    capture: tuple[int, ...], kv_len: int | None,
) -> tuple[Tensor, Tensor]:
    """The policy's forward of a decode or verify step: logits ``(B, q, V)`` and features ``(B, q, F)``
    (the last hidden state, or the EAGLE-3 concatenation of the ``capture`` layers' hidden states).

    Every argument of ``runner.forward`` is passed, none left to its default: a compiled version
    stored on disk must not guard on a default's value (torch 2.11 could not load such guards back).
    """
    out = runner.forward(tokens, positions, k_cache, v_cache, prefill=False, logits=True, capture_layers=capture,
                         kv_len=kv_len)
    assert out.logits is not None
    if not capture:
        return out.logits, out.hidden
    return out.logits, torch.cat([out.layer_hidden[i] for i in capture], dim=-1)


REGIONS_ENV_VAR = "LIGHTNING_TLT_COMPILE_REGIONS"
"""``0``, ``false``, ``off`` or ``no``: compile the policy's forward as one graph (`policy_step`) instead of by
region (`PolicyRegions`)."""


def regions_enabled() -> bool:
    """Whether a compiled engine compiles its policy's forward by region (the default; `REGIONS_ENV_VAR`)."""
    return not env_off(REGIONS_ENV_VAR)


def policy_embed(runner: ModelRunner, tokens: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The first region of `PolicyRegions`: the embeddings ``(B, q, H)`` and the RoPE tables of ``positions``."""
    x = runner.embed(tokens)
    cos, sin = rope_cos_sin(positions, runner.inv_freq, runner.rope_scaling, x.dtype)
    return x, cos, sin


def policy_layer(
    runner: ModelRunner, layer: nn.Module, fused: FusedProjections | None, x: Tensor, delta: Tensor | None,
    cos: Tensor, sin: Tensor, positions: Tensor, k_cache: Tensor, v_cache: Tensor, kv_len: int | None,
) -> tuple[Tensor, Tensor]:
    """Any one of the policy's decoder layers in a decode or verify step (`decoder_layer_split`): its stream
    after attention and its MLP output, whose sum is its output. One compiled version serves every layer:
    the layer's parameters are inputs of the graph, not constants of it."""
    spec = runner.spec
    return decoder_layer_split(
        layer, x, delta, cos, sin, positions, k_cache, v_cache, num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, prefill=False, attention=runner.attention,
        kv_len=kv_len, hole=None, mask=None, fused=fused,
    )


def policy_head(runner: ModelRunner, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
    """The last region of `PolicyRegions`: the last layer's output (``x + delta``) through the final norm:
    logits ``(B, q, V)`` and the final hidden state ``(B, q, H)``."""
    hidden = rms_norm(x + delta, runner.model.model.norm)
    return runner.lm_head(hidden), hidden


def _rows_dynamic_at(*indices: int) -> DynamicDims:
    """A region's dynamic sizes: the rows, and a verify's tokens per row above one, of its arguments at
    ``indices`` that are tensors (as `rows_dynamic`; every tensor of the same rows marked alike, so that
    no operation between them specialises one)."""

    def dims(*args: Any) -> dict[int, list[int]]:
        first = next(args[i] for i in indices if args[i] is not None)
        sizes = [d for d in (0, 1) if first.shape[d] > 1]
        return {i: sizes for i in indices if args[i] is not None}

    return dims


class PolicyRegions:
    """`policy_step` compiled by region: the embeddings, one decoder layer, and the head, each compiled on
    its own, called from Python in a loop over the layers.

    Compiled as one graph (`policy_step`), the forward is traced and code-generated through every layer;
    by region, Dynamo traces and Inductor compiles one layer, which every layer then runs (the 0.5 B
    policy's 24 on the CPU: 41.9 s to the first token against 64.7 s,
    ``benchmarks/results/cold_start_cpu_20261206_0.5b_regions.json``). The loop's
    Python runs only in warm-up and capture: a captured step's CUDA graph replays the same kernels, and
    the residual add between two layers still shares a kernel with the next layer's input norm
    (`decoder_layer_split`). Off with `REGIONS_ENV_VAR`.

    Args:
        store: where the three regions' compiled versions are kept (`CompileStore`).
    """

    def __init__(self, store: CompileStore) -> None:
        self.embed = store.compile(policy_embed, dynamic_dims=_rows_dynamic_at(1, 2))
        self.layer = store.compile(policy_layer, dynamic_dims=_rows_dynamic_at(3, 4, 5, 6, 7))
        self.head = store.compile(policy_head, dynamic_dims=_rows_dynamic_at(1, 2))

    def __call__(
        self, runner: ModelRunner, tokens: Tensor, positions: Tensor, k_cache: Sequence[Tensor],
        v_cache: Sequence[Tensor], capture: tuple[int, ...], kv_len: int | None,
    ) -> tuple[Tensor, Tensor]:
        """What `policy_step` returns, from the same arguments."""
        num_layers = runner.spec.num_layers
        fused = runner.layer_fusions()
        x, cos, sin = self.embed(runner, tokens, positions)
        layer_hidden = {0: x} if 0 in capture else {}
        # the first layer adds zeros (exact): with ``None`` there, every layer function compiled twice
        delta = torch.zeros_like(x)
        for i, layer in enumerate(runner.layers):
            x, delta = self.layer(runner, layer, fused[i], x, delta, cos, sin, positions, k_cache[i], v_cache[i],
                                  kv_len)  # fmt: skip
            if i + 1 in capture and i + 1 < num_layers:
                layer_hidden[i + 1] = x + delta
        logits, hidden = self.head(runner, x, delta)
        if not capture:
            return logits, hidden
        layer_hidden[num_layers] = hidden  # HF's last hidden_states entry is after the norm
        return logits, torch.cat([layer_hidden[i] for i in capture], dim=-1)


@dataclass(frozen=True)
class SamplingKey:
    """The sampling settings a compiled step is specialised on (hashable: part of graph keys)."""

    temperature: float
    top_k: int
    top_p: float

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_tokens(logits: Tensor, sampling: SamplingKey, noise: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(B, V)`` logits -> tokens ``(B,)``, their logprobs ``(B,)`` and the processed probabilities.

    Greedy takes the argmax (logprob 0, the one-hot distribution's).
    """
    if sampling.greedy:
        tokens = logits.argmax(-1)
        return tokens, torch.zeros(tokens.shape, device=logits.device), logits
    probs = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    assert noise is not None
    tokens = sample_with_noise(probs, noise)
    logp = probs.gather(-1, tokens[:, None]).squeeze(-1).clamp_min(PROB_FLOOR).log()
    return tokens, logp, probs


def row_noise(keys: Tensor, positions: Tensor, vocab: int, purpose: int = NOISE_SAMPLE) -> Tensor:
    """``(B, V)`` keyed ``Exp(1)`` noise of each row's token at its completion position."""
    return keyed_exponential(keys, positions, purpose, torch.arange(vocab, device=keys.device))


def _slots(t: Tensor, batch: int) -> Tensor:
    """Rows ``0..batch-1`` of a slot buffer, exactly ``batch`` of them. To the compiler ``t[:batch]`` is
    ``min(batch, len(t))`` rows: compiled size-oblivious, torch 2.11 could not compile the step with it, and
    otherwise a batch of 1 kept a version of its own."""
    return t.narrow(0, 0, batch)


def _packed(t: Tensor) -> Tensor:
    """A copy of ``t`` with the strides of its sizes (``clone(contiguous_format)``: no contiguity to decide)."""
    return t.clone(memory_format=torch.contiguous_format)


def _slot_rows(*forward_outputs: Tensor) -> Callable[[Tensor], Tensor]:
    """`_slots` for the step forward's rows, after tying its outputs' rows together (``torch._check``: one
    size to the compiler, not several it would guard apart).

    The batch is read from the tensors, not passed as an int: Dynamo gives an int of 0 or 1 a version of
    its own (a batch of 1, a draft length of 1), while a size of 1 is compiled size-oblivious."""
    batch = forward_outputs[0].shape[0]
    for tensor in forward_outputs[1:]:
        torch._check(tensor.shape[0] == batch)
    return functools.partial(_slots, batch=batch)


def decode_update(st: SlotState, logits: Tensor, hidden: Tensor, sampling: SamplingKey) -> None:
    """Sample the next token of slots ``0..B-1`` and advance them (in place).

    The race's noise is keyed by each row's key and completion position (`row_noise`).

    Args:
        logits: ``(B, 1, V)`` of the step's forward; ``hidden``: ``(B, 1, F)`` its features.
    """
    rows = _slot_rows(logits, hidden)

    tokens, positions = rows(st.tokens), rows(st.positions)
    count = rows(st.num_generated)
    noise = None if sampling.greedy else row_noise(rows(st.keys), count, logits.shape[-1])
    new, logp, _ = sample_tokens(logits[:, -1], sampling, noise)
    active = ~rows(st.finished)
    rows(st.hidden).copy_(hidden[:, -1].to(st.hidden.dtype))
    sink = st.out_tokens.shape[1] - 1
    column = torch.where(active, count, torch.full_like(count, sink))[:, None]
    rows(st.out_tokens).scatter_(1, column, new[:, None])
    rows(st.out_logprobs).scatter_(1, column, logp[:, None].float())
    count = count + active.long()
    stop = (new[:, None] == st.stop_ids[None, :]).any(-1)
    rows(st.finished).copy_(rows(st.finished) | (active & (stop | (count >= st.max_new))))
    rows(st.num_generated).copy_(count)
    rows(st.tokens).copy_(torch.where(active, new, tokens))
    rows(st.positions).copy_(positions + active.long())


def verify_update(
    st: SlotState,
    logits: Tensor,
    hidden: Tensor,
    draft_probs: Tensor | None,
    sampling: SamplingKey,
    draft_vocab: Tensor | None = None,
    coupled: bool = False,
) -> None:
    """Verify the drafts of slots ``0..B-1`` and advance each row by what it accepted.

    Args:
        logits, hidden: ``(B, k + 1, V)`` and ``(B, k + 1, F)`` of the verify forward over
            ``[pending token, d_0 .. d_{k-1}]`` (the batch and the draft length are read from them: see
            `_slot_rows`).
        draft_probs: ``(B, k, V or Vd)`` the drafts' distributions, ``None`` for deterministic drafts.
        draft_vocab: ``(Vd,)`` target ids of ``draft_probs``' columns, or ``None``.
        coupled: `verify_coupled` (the plain sampler's tokens) instead of rejection sampling
            (`verify_chain`); both draw keyed noise at the rows' completion positions.
    """
    spec = st.spec
    assert spec is not None and st.counters is not None
    rows = _slot_rows(logits, hidden, *(() if draft_probs is None else (draft_probs,)))
    k = logits.shape[1] - 1
    torch._check(hidden.shape[1] == k + 1)  # the forward's queries k + 1, the drafts k: one size each
    if draft_probs is not None:
        torch._check(draft_probs.shape[1] == k)

    pos = rows(st.positions)
    count = rows(st.num_generated)
    # the drafts copied out of their wider buffer: views of the slice's strides made the compile guard on a
    # draft length of 1 and on a batch above 1 (a version of its own for each, 14 s each on an H100)
    drafts = _packed(rows(spec.draft_tokens).narrow(1, 0, k))
    target = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # (B, k+1, V)
    lens = rows(spec.draft_lens)
    keys = rows(st.keys)
    if sampling.greedy:  # one-hot targets: accept iff the draft is the argmax, emit the argmax
        result = verify_coupled(drafts, target, lens, noise=torch.ones_like(target))
    elif coupled:
        result = verify_coupled(drafts, target, lens, keys=keys, start=count)
    else:
        result = verify_chain(
            drafts, draft_probs, target, lens,
            draft_vocab=draft_vocab, draft_index=None if draft_vocab is None else _packed(rows(spec.draft_index).narrow(1, 0, k)),
            keys=keys, start=count,
        )  # fmt: skip
    active = ~rows(st.finished)
    offsets = torch.arange(k + 1, device=pos.device)
    toks, logps = result.tokens, result.logprobs  # (B, k+1)
    emitted = offsets[None] < result.num_emitted[:, None]
    is_stop = (toks[:, :, None] == st.stop_ids[None, None, :]).any(-1) & emitted
    first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1) + 1, result.num_emitted)
    take = torch.minimum(first_stop, st.max_new - count)
    take = torch.where(active, take, torch.zeros_like(take))  # (B,)
    write = offsets[None] < take[:, None]
    sink = st.out_tokens.shape[1] - 1
    columns = torch.where(write, count[:, None] + offsets[None], torch.full_like(toks, sink))
    rows(st.out_tokens).scatter_(1, columns, toks)
    rows(st.out_logprobs).scatter_(1, columns, logps.float())
    new_count = count + take
    stopped = (is_stop & write).any(1)
    rows(st.finished).copy_(rows(st.finished) | (active & (stopped | (new_count >= st.max_new))))
    rows(st.num_generated).copy_(new_count)
    last = toks.gather(1, (take - 1).clamp_min(0)[:, None])[:, 0]
    rows(st.tokens).copy_(torch.where(active, last, rows(st.tokens)))
    rows(st.positions).copy_(pos + take)
    row_ids = torch.arange(logits.shape[0], device=pos.device)
    newest = hidden[row_ids, (take - 1).clamp_min(0)]  # (B, F): the feature that predicted the pending token
    rows(st.hidden).copy_(torch.where(active[:, None], newest.to(st.hidden.dtype), rows(st.hidden)))
    # the EAGLE catch-up block of the next step: true features and the tokens that followed them
    # (the whole width written, zeros past k + 1, never read: a copy into a view of k + 1 columns made the
    # compiler guard on a batch of 1, and index_copy_ hit a bug of Inductor's C++ code on the CPU)
    pad = spec.cu_feat.shape[1] - (k + 1)
    rows(spec.cu_feat).copy_(F.pad(hidden.to(spec.cu_feat.dtype), (0, 0, 0, pad)))
    rows(spec.cu_tok).copy_(F.pad(toks, (0, pad)))
    rows(spec.cu_base).copy_(pos)
    rows(spec.cu_valid).copy_(take.clamp_min(1))
    rows(spec.cu_fresh).copy_(active)
    accepted = torch.where(active, result.num_accepted, torch.zeros_like(take))
    rows(spec.num_accepted).copy_(accepted)
    rows(spec.emitted).copy_(take)
    # speculation counters: rows verified, tokens emitted, per position reached / accepted
    act = active.double()
    c = st.counters
    c[0, 0] += act.sum()
    c[0, 1] += ((accepted + 1).double() * act).sum()
    c[0, 2] += take.double().sum()
    pos_k = offsets.narrow(0, 0, k)[None]
    reached = ((accepted[:, None] >= pos_k) & (lens[:, None] > pos_k)).double() * act[:, None]
    c[1].narrow(0, 0, k).add_(reached.sum(0))
    c[2].narrow(0, 0, k).add_(((accepted[:, None] > pos_k).double() * act[:, None]).sum(0))


def draft_sample(
    feature: Tensor,
    head: Tensor,
    bias: Tensor | None,
    keys: Tensor | None,
    positions: Tensor,
    coupled: bool,
    columns: Tensor | None,
    sampling: SamplingKey,
) -> tuple[Tensor, Tensor]:
    """One draft per row from a predicted feature over the draft vocabulary.

    Args:
        feature: ``(B, H)`` the drafter's predicted feature.
        head: ``(Vd, H)`` the policy's LM-head rows of the draft vocabulary (all ``V`` rows without one).
        bias: ``(Vd,)`` or ``None``.
        keys: ``(B,)`` the rows' noise keys, ``None`` when greedy (argmax).
        positions: ``(B,)`` completion position of the drafted token.
        coupled: the noise stream: coupled verification races with the verifier's own numbers
            (`NOISE_SAMPLE`: the Gumbel coupling), rejection sampling with independent ones
            (`NOISE_DRAFT`). A bool, which Dynamo specialises: an int stream id would be a symbolic
            size under ``dynamic=True``, and Inductor's CPU vectorizer typed the hash mixing it as
            float (a C++ compile error, torch 2.13).
        columns: ``(Vd,)`` target ids of the draft vocabulary (``None``: the whole vocabulary): column
            ``c`` draws the noise of token ``columns[c]``.

    Returns:
        ``(B,)`` long column in the draft vocabulary and ``(B, Vd)`` float32 the processed
        distribution it was drawn from (one-hot when greedy).
    """
    logits = F.linear(feature, head.to(feature.dtype), None if bias is None else bias.to(feature.dtype))
    q = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
    if sampling.greedy or keys is None:
        return q.argmax(-1), q
    ids = torch.arange(q.shape[-1], device=q.device) if columns is None else columns
    purpose = NOISE_SAMPLE if coupled else NOISE_DRAFT
    return sample_with_noise(q, keyed_exponential(keys, positions, purpose, ids)), q
