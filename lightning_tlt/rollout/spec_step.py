"""The speculative step: draft ``k`` tokens per row, verify ``k + 1`` in one forward, lossless.

TLT's adaptive speculative decoding (arXiv 2511.16665, §4) as one component with an explicit
interface: the engine hands it a `StepContext` (the slot state, the KV cache, the compiled policy
forward, the graph cache, a generator for host drafters) and the drafter; it launches the step's
device work and never reaches into the engine. The engine loop stays the one orchestrator (admission, the gate and
the tuner's choice of ``k``, harvesting finished rows).

1. **Draft.**
   - An `EagleDrafter` runs on the device, inside the step's CUDA graph: it first *catches up* on
     the rows the last verify appended (true features and tokens, in a block of ``K + 1`` rows of
     which the appended ones are valid: one width for every step, whatever the last step's ``k``,
     so a batch bucket and ``k`` need one graph, not one per last ``k``), then chains ``k - 1``
     more draft steps over its own predicted
     features (the alignment of `lightning_tlt.drafters.eagle`: row t gets feature h_t, the
     embedding of token t+1 and position t). RoPE tables of the whole chain are computed once.
     Each draft token comes from the policy's LM-head rows of the *draft vocabulary*
     (`DraftVocabulary`: EAGLE-3's reduced head, the most frequent tokens of the policy's own
     rollouts), so a drafted token costs a small fraction of a policy step at a large vocabulary.
     The drafter's history lives in its own one-layer KV cache (see
     `lightning_tlt.rollout.slot_state`): the prompt, run through it at prefill, then the rows
     drafted since the row's speculation last (re)started.
   - A host drafter (`SuffixDrafter`, or anything with ``draft(contexts, k, sampling, generator,
     device) -> DraftProposal``) proposes from each row's tokens, which this component mirrors on
     the host, one step's new tokens at a time (the host work per step does not grow with the
     rollout).
2. **Verify.** The policy runs ``[pending token, d_0 .. d_{k-1}]`` at positions ``L .. L + k`` of
   each row in one forward, and `lightning_tlt.rollout.verify.verify_chain` accepts per row by
   rejection sampling (Leviathan et al. 2023; Chen et al. 2023), or
   `lightning_tlt.rollout.verify.verify_coupled` by coupling with the plain sampler
   (``SpeculativeConfig.verification``): every emitted token is distributed exactly as plain
   sampling from the policy (coupled: it *is* plain sampling's token for the row's keyed noise),
   greedy stays greedy, and a non-finite draft is a rejection. Rows advance by the tokens they
   accepted plus one (clipped at a stop token or ``max_new_tokens``); the KV written for rejected
   drafts lies past the row's new length and is overwritten before it is ever read.

The EAGLE path needs no host read at all (the engine reads finish flags and emitted counts one
step late, as for plain decoding); a host drafter needs the new tokens before it can draft again,
so its steps read them back (a few integers a row).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from lightning_tlt.core.kv_cache import KVCache
from lightning_tlt.core.runner import rope_cos_sin
from lightning_tlt.core.stored_compile import CompileStore, FrozenViewCache
from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.drafters.base import Drafter, DraftRow, capability
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.rollout.cuda_graphs import CUDAGraphProfileCache, GraphProfile
from lightning_tlt.rollout.scheduler import Request
from lightning_tlt.rollout.slot_state import SlotState
from lightning_tlt.rollout.steps import SamplingKey, allow_recompiles, draft_sample, verify_update

ForwardFn = Callable[..., tuple[Tensor, Tensor]]
"""``(tokens (B, q), positions (B, q), k_cache, v_cache, capture_layers, kv_len) -> (logits, features)``."""


@dataclass
class StepContext:
    """What a step runs on, handed in by the engine (nothing else of the engine is read)."""

    state: SlotState
    cache: KVCache
    forward: ForwardFn
    graphs: CUDAGraphProfileCache
    run: Callable[[GraphProfile, Callable[[], None]], None]
    """Replays a profile's graph (capturing ``fn`` on a miss): the engine's ``_run_step``."""
    generator: torch.Generator
    """Seeded per call from the caller's generator: only host drafters' own ``draft`` draws from it."""
    capture_layers: tuple[int, ...]
    attention: str
    """The resolved cached-attention backend ("triton" or "sdpa"), also used by the drafter's layer."""


class DraftVocabulary:
    """The draft vocabulary: the ``size`` most frequent tokens of the policy's own rollouts.

    EAGLE-3's ``d2t`` map: the drafter's head is the policy's LM head restricted to these rows, so
    a draft step costs ``size / V`` of a full head. Before any rollout is counted it is the first
    ``size`` ids (the kit's tokenizer uses the first ids of a large vocabulary). Verification stays
    exact: tokens outside it have draft probability 0.

    Args:
        size: rows of the draft head; ``None`` or ``>= vocab_size``: the whole vocabulary.
        vocab_size: the policy's vocabulary.
    """

    def __init__(self, size: int | None, vocab_size: int) -> None:
        if size is not None and size < 1:
            raise ValueError(f"draft vocabulary size must be >= 1 or None, got {size!r}")
        self.vocab_size = vocab_size
        self.size = vocab_size if size is None else min(size, vocab_size)
        self.counts = torch.zeros(vocab_size, dtype=torch.long)

    @property
    def full(self) -> bool:
        return self.size >= self.vocab_size

    def observe(self, completions: Sequence[Sequence[int]]) -> None:
        """Count the tokens of finished rollouts."""
        flat = [t for c in completions for t in c]
        if flat:
            self.counts += torch.bincount(torch.tensor(flat, dtype=torch.long), minlength=self.vocab_size)

    def ids(self) -> Tensor:
        """``(size,)`` long token ids: most frequent first, ties (and never-seen tokens) by id."""
        order = torch.argsort(-self.counts, stable=True)  # count descending, id ascending within ties
        return order[: self.size].sort().values

    def state_dict(self) -> dict[str, Any]:
        return {"size": self.size, "counts": self.counts.clone()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict["size"]) != self.size or state_dict["counts"].shape != self.counts.shape:
            raise ValueError(
                f"draft vocabulary state is for size {state_dict['size']} over {state_dict['counts'].shape[0]} "
                f"tokens, this one has {self.size} over {self.vocab_size}"
            )
        self.counts = state_dict["counts"].clone().long()


def _draft_rows(feature: Tensor, head: Tensor, bias: Tensor | None, keys: Tensor | None, positions: Tensor,
                *_: Any) -> dict[int, list[int]]:
    """`draft_sample`'s dynamic sizes: its rows (feature, keys, positions); the draft vocabulary is static."""
    return {i: [0] for i, t in ((0, feature), (3, keys), (4, positions)) if t is not None}


def eagle_profile(batch: int, k: int, sampling: SamplingKey, drafter_handle: int, kv_len: int | None) -> GraphProfile:
    """The graph key of an EAGLE step: its drafter's handle is part of it (`eagle_handle`)."""
    return GraphProfile("spec", batch, k + 1, (sampling, drafter_handle, kv_len))


def eagle_handle(profile: GraphProfile) -> int:
    """The drafter handle of an EAGLE step's profile (`eagle_profile`)."""
    return int(profile.extra[1])


def graph_group(profile: GraphProfile) -> Hashable:
    """The engine's graph groups (`CUDAGraphProfileCache`'s ``group_of``): an EAGLE step's graphs by drafter
    (a replaced drafter's are dropped together), any other step's by phase."""
    return ("spec", eagle_handle(profile)) if profile.phase == "spec" else profile.phase


class SpeculativeStep:
    """Launches speculative steps (draft, verify, state update) for an engine; see the module docstring.

    Args:
        max_draft_tokens: the largest ``k`` (the state's buffers are sized for it).
        vocab: the draft vocabulary (shared with the engine, which counts rollouts into it).
        compiler: compile the step's device functions in this store (``torch.compile(fullgraph=True)``,
            each version stored: `lightning_tlt.core.stored_compile`), or ``None``: run them uncompiled.
        coupled: verify by coupling with the plain sampler (`verify_coupled`; an EAGLE drafter then
            races with the verifier's own noise), else by rejection sampling.
    """

    def __init__(
        self, max_draft_tokens: int, vocab: DraftVocabulary, *, compiler: CompileStore | None, coupled: bool = False
    ) -> None:
        self.max_k = max_draft_tokens
        self.vocab = vocab
        self.coupled = coupled
        # the device functions: eager (`use_eager`) or compiled and stored (`CompileStore.compile`)
        self._verify_update: Callable[..., Any]
        self._draft_sample: Callable[..., Any]
        self._catch_up_rows: Callable[..., Any]
        self._chain_row: Callable[..., Any]
        self.use_eager()
        if compiler is not None:
            allow_recompiles()
            # dynamic from the start: few compilations per function serve every batch bucket and k
            # (the catch-up block and the chained single row are compiled apart: their q differs, and
            # two functions keep two caches, where one function compiled twice would share one)
            self._verify_update = compiler.compile(verify_update, dynamic=True)
            # the rows only: with the draft vocabulary symbolic too, Inductor could not split its reduction on
            # the H100 ("CantSplit: s23 not divisible by s21*s23") and every process compiled it again
            self._draft_sample = compiler.compile(draft_sample, dynamic_dims=_draft_rows)
            self._catch_up_rows = compiler.compile(catch_up_rows, dynamic=True)
            self._chain_row = compiler.compile(chain_row, dynamic=True)
        self._head: tuple[Tensor, Tensor | None, Tensor | None] | None = None  # (rows, bias, ids)
        self._host_probs: Tensor | None = None  # (R, K, V) a host drafter's distributions
        self._contexts: dict[int, list[int]] = {}  # request index -> prompt + completion (host drafters)
        self._k_prev = 0  # k of the last step, 0 after a plain step (then no catch-up block is current)
        self._call = 0
        self._views = FrozenViewCache()  # the drafter's frozen view

    def use_eager(self) -> None:
        """Run the step's device functions uncompiled (also the fallback after a compiler failure)."""
        self._verify_update = verify_update
        self._draft_sample = draft_sample
        self._catch_up_rows, self._chain_row = drafter_rows, chain_row

    # ------------------------------------------------------------------ per generate call
    def begin(self, lm_head: Any) -> None:
        """Start of a ``generate`` call: fresh mirrors; the draft head refreshed from the policy's."""
        self._contexts.clear()
        self._k_prev = 0
        self._call += 1
        weight = lm_head.weight.detach()
        bias = getattr(lm_head, "bias", None)
        bias = None if bias is None else bias.detach()
        if self.vocab.full:
            self._head = (weight, bias, None)
            return
        ids = self.vocab.ids().to(weight.device)
        if self._head is None or self._head[2] is None or self._head[0].shape != (ids.numel(), weight.shape[1]):
            # static buffers: graphs captured on them stay valid, the contents follow the policy
            rows = torch.empty(ids.numel(), weight.shape[1], device=weight.device, dtype=weight.dtype)
            self._head = (rows, None if bias is None else torch.empty_like(bias[: ids.numel()]), torch.empty_like(ids))
        rows, bias_rows, id_buf = self._head
        assert id_buf is not None
        id_buf.copy_(ids)
        rows.copy_(weight[ids])
        if bias_rows is not None and bias is not None:
            bias_rows.copy_(bias[ids])

    @property
    def last_k(self) -> int:
        """Tokens drafted a row by the last step (0 after a plain step: no catch-up block is current)."""
        return self._k_prev

    def plain_step(self) -> None:
        """A plain decode step ran: the catch-up blocks and host mirrors are out of date."""
        self._k_prev = 0

    def finished(self, requests: Sequence[Request], drafter: Drafter | None) -> None:
        """Rows ended: a drafter that remembers rollouts (the suffix drafter) keeps them for their siblings."""
        finish_row = capability(drafter, "finish_row") if drafter is not None else None
        for r in requests:
            self._contexts.pop(r.index, None)
            if finish_row is not None:
                finish_row(r.prompt, (self._call, r.index))

    # ------------------------------------------------------------------ prefill
    def prefill_drafter(
        self, ctx: StepContext, drafter: EagleDrafter, features: Tensor, next_tokens: Tensor, lengths: Tensor
    ) -> KVCache:
        """Run the drafter over prompt rows (its history starts at the row's own prefill).

        Args:
            features: ``(Bp, P, F)`` the policy's features at positions ``0..P-1`` of each prefilled prefix.
            next_tokens: ``(Bp, P)`` the token after each of those positions (``x_{t+1}``).
            lengths: ``(Bp,)`` real rows of each prefix.

        Returns:
            A scratch one-layer cache ``(Bp, P, n_kv, hd)`` to copy into the rows' slots.
        """
        bsz, width = next_tokens.shape
        scratch = KVCache.allocate(1, bsz, width, drafter.num_kv_heads, drafter.head_dim,
                                   device=features.device, dtype=drafter.fc.weight.dtype)
        positions = torch.arange(width, device=features.device)[None].expand(bsz, width)
        x = drafter.input_hidden(features.to(drafter.fc.weight.dtype), next_tokens)
        drafter.layer_forward(x, positions, scratch.k[0], scratch.v[0], prefill=True)
        return scratch

    # ------------------------------------------------------------------ the step
    def run(
        self,
        ctx: StepContext,
        active: Sequence[Request],
        batch: int,
        k: int,
        sampling: SamplingKey,
        drafter: Drafter,
        drafter_handle: int,
        kv_len: int | None,
    ) -> list[list[int]] | None:
        """Launch one speculative step over the ``len(active)`` active rows (padded to ``batch``).

        Returns:
            ``None`` for a device drafter (nothing was read back); for a host drafter, each active
            row's tokens appended by this step (read back: the next draft needs them).
        """
        st = ctx.state
        assert st.spec is not None
        if capability(drafter, "runs_on_device"):
            drafter = cast(EagleDrafter, drafter)  # the one device drafter
            self._check_features(st, drafter)
            st.ensure_drafter_cache(drafter.num_kv_heads, drafter.head_dim, ctx.cache.max_seq_len,
                                    drafter.fc.weight.dtype)
            if self._k_prev == 0:  # after a plain step no slot's catch-up block is current
                st.spec.cu_fresh.zero_()
            # the widest block, always: a block of the last step's k + 1 rows made every (bucket, k)
            # one graph per last k (167 captures and 50 s in one RL step of the 0.5 B e2e run on the H200)
            width = self.max_k + 1
            profile = eagle_profile(batch, k, sampling, drafter_handle, kv_len)
            ctx.run(profile, lambda: self.eagle_step(ctx, batch, k, width, sampling, drafter, kv_len))
            self._k_prev = k
            return None
        with_probs = self._draft_host(ctx, active, k, sampling, drafter)
        profile = GraphProfile("verify", batch, k + 1, (sampling, with_probs, kv_len))
        probs = self._host_probs if with_probs else None
        ctx.run(profile, lambda: self._verify(ctx, batch, k, sampling, probs, None, kv_len))
        self._k_prev = k
        return self._read_back(st, active, k)

    def _frozen(self, drafter: EagleDrafter) -> EagleDrafter:
        """The drafter as its compiled regions take it (`frozen_view`: a co-trained drafter's ``.grad`` kept a
        version from being stored); one view while the drafter object and its weights' storage stay."""
        return cast(EagleDrafter, self._views(drafter))

    def versions_stored(self) -> bool:
        """Whether the compile store holds versions of the verify update already (another process compiled the
        speculative steps of these shapes): the background compile's test of a cold store."""
        fn = self._verify_update
        folder = getattr(fn, "folder", None)
        return folder is None or (folder.is_dir() and any(folder.glob("*.bin")))

    def compile_ahead(
        self, ctx: StepContext, batch: int, k: int, sampling: SamplingKey, drafter: EagleDrafter, kv_len: int | None
    ) -> None:
        """Run ``drafter``'s step once, uncaptured, so that its functions compile now (the caller
        snapshots the state before and restores it after: the step's writes are undone)."""
        st = ctx.state
        assert st.spec is not None
        self._check_features(st, drafter)
        st.ensure_drafter_cache(drafter.num_kv_heads, drafter.head_dim, ctx.cache.max_seq_len,
                                drafter.fc.weight.dtype)
        st.spec.cu_fresh.zero_()  # every row takes the one-true-row path: no stale block is read
        self.eagle_step(ctx, batch, k, self.max_k + 1, sampling, drafter, kv_len)

    def _check_features(self, st: SlotState, drafter: EagleDrafter) -> None:
        width = st.hidden.shape[1]
        expected = drafter.config.hidden_size * (len(drafter.feature_layers) if drafter.feature_layers else 1)
        if width != expected:
            raise ValueError(
                f"the drafter reads {expected}-wide features (feature_layers={drafter.feature_layers!r}) but the "
                f"engine keeps {width}-wide ones: replace engine.drafter between generate calls, not during one"
            )

    # ------------------------------------------------------------------ EAGLE (device) drafting
    def eagle_step(
        self, ctx: StepContext, batch: int, k: int, width: int, sampling: SamplingKey, drafter: EagleDrafter,
        kv_len: int | None,
    ) -> None:
        """Catch up, chain k drafts, verify: one graph-capturable step, in place on the static state."""
        drafter = self._frozen(drafter)  # the compiled regions take a view without autograd state
        st = ctx.state
        spec = st.spec
        assert spec is not None and spec.dcache is not None and self._head is not None
        head, bias, ids = self._head
        keys = None if sampling.greedy else st.keys[:batch]
        count = st.num_generated[:batch]  # draft j is the row's token at completion position count + j
        # rows whose last step was plain (or new rows): one true row, the newest feature + pending token
        # (after a plain step `run` has cleared every slot's flag: no catch-up block is current)
        fresh = spec.cu_fresh[:batch] & ~st.finished[:batch]  # padding rows: stale blocks are never read
        pending = st.positions[:batch]
        base = torch.where(fresh, spec.cu_base[:batch], (pending - 1).clamp_min(0))
        valid = torch.where(fresh, spec.cu_valid[:batch], torch.ones_like(base)).clamp(1, width)
        feats = torch.where(fresh[:, None, None], spec.cu_feat[:batch, :width],
                            _first_row(st.hidden[:batch], width))  # (B, W, F)
        toks = torch.where(fresh[:, None], spec.cu_tok[:batch, :width], _first_row(st.tokens[:batch], width))
        spec.draft_start[:batch] = torch.where(fresh, spec.draft_start[:batch], base)
        lo = spec.prefix_end[:batch] + 1
        hole = torch.stack([lo, torch.maximum(spec.draft_start[:batch], lo)], dim=1)  # (B, 2)
        # positions and RoPE of the whole chain, once: the catch-up block, then the chained rows. Laid out for
        # the longest chain whatever k is: the functions below take slices of it, and a slice's strides are
        # its base's (a width that varied with k made the catch-up and the chained row compile a version per
        # draft length; on the CPU the catch-up compiled two for k = 1 and 2, as on the H100's e2e step 0)
        steps = torch.arange(width + self.max_k - 1, device=base.device)
        chain_pos = base[:, None] + steps[None]  # catch-up rows at base + 0..W-1
        chain_pos[:, width:] = (base + valid - 1)[:, None] + steps[None, 1 : self.max_k]
        cos, sin = rope_cos_sin(chain_pos, drafter.inv_freq, drafter.rope_scaling, drafter.fc.weight.dtype)
        dk, dv = spec.dcache.k[0], spec.dcache.v[0]
        pred = self._catch_up_rows(drafter, feats, toks, chain_pos[:, :width], dk, dv, hole,
                                  cos[:, :width], sin[:, :width], ctx.attention)  # (B, W, H)
        rows = torch.arange(batch, device=base.device)
        feature = pred[rows, valid - 1]  # (B, H): the predicted feature of the pending token's position
        token = st.tokens[:batch]
        probs, indices, tokens = [], [], []
        for j in range(k):
            if j > 0:
                p = width + j - 1
                feature = self._chain_row(drafter, feature, token, chain_pos[:, p : p + 1], dk, dv, hole,
                                          cos[:, p : p + 1], sin[:, p : p + 1], ctx.attention)
            index, q = self._draft_sample(feature, head, bias, keys, count + j, self.coupled, ids, sampling)
            token = index if ids is None else ids[index]
            probs.append(q)
            indices.append(index)
            tokens.append(token)
        spec.draft_index[:batch, :k] = torch.stack(indices, 1)
        spec.draft_tokens[:batch, :k] = torch.stack(tokens, 1)
        spec.draft_lens[:batch] = k
        self._verify(ctx, batch, k, sampling, torch.stack(probs, 1), ids, kv_len)

    # ------------------------------------------------------------------ verification
    def _verify(
        self, ctx: StepContext, batch: int, k: int, sampling: SamplingKey, probs: Tensor | None,
        draft_vocab: Tensor | None, kv_len: int | None,
    ) -> None:
        """The policy's forward over k + 1 tokens a row, then `verify_update` (graph-capturable)."""
        st, cache = ctx.state, ctx.cache
        spec = st.spec
        assert spec is not None
        pos = st.positions[:batch]
        inputs = torch.cat([st.tokens[:batch, None], spec.draft_tokens[:batch, :k]], dim=1)  # (B, k+1)
        offsets = torch.arange(k + 1, device=pos.device)
        logits, hidden = ctx.forward(inputs, pos[:, None] + offsets[None], cache.k, cache.v, ctx.capture_layers,
                                     kv_len)
        if probs is not None:
            probs = probs[:batch, :k]
        self._verify_update(st, logits, hidden, probs, sampling, draft_vocab, self.coupled)

    # ------------------------------------------------------------------ host drafting
    def _draft_host(
        self, ctx: StepContext, active: Sequence[Request], k: int, sampling: SamplingKey, drafter: Drafter
    ) -> bool:
        """Drafts of a host-side drafter into the static buffers; returns whether they came with probabilities."""
        st = ctx.state
        spec = st.spec
        assert spec is not None
        n = len(active)
        missing = [i for i, r in enumerate(active) if r.index not in self._contexts]
        if missing:  # rows that start speculating: their tokens so far, read once
            self._sync_contexts(st, active, missing)
        contexts = [self._contexts[r.index] for r in active]
        device = spec.draft_tokens.device
        config = SamplingConfig(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p)
        rows = [DraftRow(r.prompt, (self._call, r.index), len(r.prompt)) for r in active]
        proposal = capability(drafter, "draft_rows")(contexts, k, config, ctx.generator, device, rows)
        if proposal.num_draft_tokens != k or proposal.tokens.shape[0] != n:
            raise ValueError(f"drafter.draft must return ({n}, {k}) drafts, got {tuple(proposal.tokens.shape)}")
        spec.draft_tokens[:n, :k] = proposal.tokens
        spec.draft_lens[:n] = proposal.lens
        spec.draft_lens[n:] = 0
        if proposal.probs is None:
            return False
        vocab = proposal.probs.shape[-1]
        if self._host_probs is None or self._host_probs.shape[1:] != (self.max_k, vocab):
            self._host_probs = torch.zeros(st.num_slots, self.max_k, vocab, device=device)
        self._host_probs[:n, :k] = proposal.probs
        return True

    def _sync_contexts(self, st: SlotState, active: Sequence[Request], rows: list[int]) -> None:
        idx = torch.tensor(rows, device=st.tokens.device)
        counts = st.num_generated[idx].tolist()
        longest = max(counts) if counts else 0
        tokens = st.out_tokens[idx, :longest].tolist() if longest else [[] for _ in rows]
        for i, c, row in zip(rows, counts, tokens):
            self._contexts[active[i].index] = list(active[i].prompt) + row[:c]

    def _read_back(self, st: SlotState, active: Sequence[Request], k: int) -> list[list[int]]:
        """The tokens each active row appended in the step just launched (one small read)."""
        spec = st.spec
        assert spec is not None
        n = len(active)
        emitted = spec.emitted[:n]
        start = (st.num_generated[:n] - emitted)[:, None] + torch.arange(k + 1, device=emitted.device)[None]
        new = st.out_tokens[:n].gather(1, start.clamp_max(st.out_tokens.shape[1] - 1))
        host = torch.cat([emitted[:, None], new], dim=1).tolist()
        out = []
        for r, row in zip(active, host):
            tokens = row[1 : 1 + row[0]]
            self._contexts[r.index].extend(tokens)
            out.append(tokens)
        return out


def drafter_rows(
    drafter: EagleDrafter,
    feats: Tensor,
    tokens: Tensor,
    positions: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    hole: Tensor,
    cos: Tensor,
    sin: Tensor,
    attention: str,
) -> Tensor:
    """The drafter's layer over ``(B, q)`` rows against its cache (catch-up block or one chained row)."""
    x = drafter.input_hidden(feats.to(drafter.fc.weight.dtype), tokens)
    # every argument passed: a stored compiled version must not guard on a default (`policy_step`)
    return drafter.layer_forward(x, positions, k_cache, v_cache, prefill=False, attention=attention, hole=hole,
                                 rope=(cos, sin), keep=None)


def catch_up_rows(*args: Any, **kwargs: Any) -> Tensor:
    """`drafter_rows` over a catch-up block (its own code object: its own compile cache)."""
    return drafter_rows(*args, **kwargs)


def chain_row(drafter: EagleDrafter, feature: Tensor, token: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """`drafter_rows` over one chained row: ``(B, H)`` feature and ``(B,)`` token -> ``(B, H)``.

    Its own code object (its own compile cache). The row dimension is added and dropped inside: a
    view made outside (``feature[:, None]`` of the last row's ``[:, 0]``) carries its base's strides,
    on which Dynamo guards, and the second chained row recompiled the function.
    """
    return drafter_rows(drafter, feature[:, None], token[:, None], *args, **kwargs)[:, 0]



def _first_row(x: Tensor, width: int) -> Tensor:
    """``x`` (``(B, ...)``) as row 0 of a ``(B, width, ...)`` block of zeros."""
    out = x.new_zeros((x.shape[0], width, *x.shape[1:]))
    out[:, 0] = x
    return out

