"""The speculative step of `RolloutEngine`: draft k tokens per row, verify k + 1 in one forward.

TLT's adaptive speculative decoding (arXiv 2511.16665, §4) inside the engine's slot layout:

1. **Draft.** Each active row gets ``k`` drafted tokens:

   - an `EagleDrafter` runs its one decoder layer on the device, with its own one-layer KV cache
     per slot, fed with the policy's final hidden states. The engine keeps each slot's newest
     feature (``_DecodeState.hidden``), so switching speculation on needs no re-prefill: the
     drafter's history then starts at the switch (its attention is masked to the positions it has
     seen since). Each step first *catches up* on the rows the last verify accepted (true features
     and tokens; the last of them is the first draft row), then chains ``k - 1`` more draft steps
     over its own predicted features (the alignment of `lightning_tlt.drafters.eagle`: row t gets
     feature h_t, the embedding of token t+1 and position t);
   - a host-side drafter (`SuffixDrafter`, or anything with a ``draft(contexts, k, sampling,
     generator, device) -> DraftProposal`` method) proposes from each row's tokens, which the
     engine mirrors on the host while it speculates.

2. **Verify.** The policy runs ``[pending token, d_0 .. d_{k-1}]`` at positions ``L .. L + k`` of
   each row in one forward (graph profile "verify", ``k + 1`` tokens a row), and
   `lightning_tlt.rollout.verify.verify_chain` accepts per row by rejection sampling (Leviathan et
   al. 2023; Chen et al. 2023), so every emitted token is distributed exactly as plain sampling
   from the policy; greedy stays greedy. Rows advance by ``accepted + 1`` tokens (clipped at a
   stop token or ``max_new_tokens``); the KV written for rejected drafts lies past the row's new
   length and is overwritten before it is ever read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_tlt.core.kv_cache import KVCache
from lightning_tlt.core.runner import decoder_layer, rope_cos_sin
from lightning_tlt.core.sampling import processed_probs, sample
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.drafters.base import DraftProposal
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.suffix import SuffixDrafter
from lightning_tlt.rollout.cuda_graphs import GraphProfile
from lightning_tlt.rollout.gate import AdaptiveGate
from lightning_tlt.rollout.scheduler import Request
from lightning_tlt.rollout.spec_metrics import SpeculationMetrics
from lightning_tlt.rollout.tuner import DraftLengthTuner
from lightning_tlt.rollout.verify import verify_chain

if TYPE_CHECKING:
    from lightning_tlt.rollout.engine import RolloutEngine


def default_drafter(config: SpeculativeConfig, model: torch.nn.Module) -> Any:
    """The drafter a `SpeculativeConfig` asks for: a `SuffixDrafter`, or a frozen `EagleDrafter`
    (loaded from ``drafter_path``, else cold from the policy)."""
    if config.method == "suffix":
        return SuffixDrafter()
    if config.method == "eagle":
        if config.drafter_path is not None:
            return EagleDrafter.from_pretrained(config.drafter_path, model).inference_copy()
        return EagleDrafter.from_target(model).inference_copy()
    return None


@dataclass
class _SpecBuffers:
    """Static per-slot buffers of the speculative step (read and written by captured graphs)."""

    draft_tokens: Tensor  # (S, K) long
    draft_lens: Tensor  # (S,) long
    draft_probs: Tensor  # (R, K, V) float32, R = rows that may speculate
    cu_feat: Tensor  # (S, W, H): features of the last verify's rows (EAGLE catch-up)
    cu_tok: Tensor  # (S, W) long: the tokens that followed them
    cu_base: Tensor  # (S,) long: position of row 0 of the block
    cu_valid: Tensor  # (S,) long: valid rows of the block (accepted + 1)
    cu_fresh: Tensor  # (S,) bool: the block is from this slot's last step
    draft_start: Tensor  # (S,) long: first position of the drafter's history in its cache
    num_accepted: Tensor  # (S,) long: of the last verify (metrics)
    emitted: Tensor  # (S,) long: tokens each row appended in the last verify
    dcache: KVCache | None  # the drafter's one-layer cache (EAGLE)

    def state_tensors(self) -> list[Tensor]:
        """Everything a graph warm-up may change (saved and restored around a capture)."""
        return [*self.per_slot(), self.draft_probs]

    def per_slot(self) -> list[Tensor]:
        return [self.draft_tokens, self.draft_lens, self.cu_feat, self.cu_tok, self.cu_base, self.cu_valid,
                self.cu_fresh, self.draft_start, self.num_accepted, self.emitted]


class SpecDecoder:
    """Gate, tuner, drafter dispatch, draft and verify steps, and metrics for one engine.

    Args:
        engine: the engine whose state, caches, graphs and generator it uses.
        config: the speculative settings.
    """

    def __init__(self, engine: RolloutEngine, config: SpeculativeConfig) -> None:
        self.engine = engine
        self.config = config
        self.max_k = config.num_draft_tokens or max(config.draft_candidates)
        self.width = self.max_k + 1  # catch-up block rows
        self.tuner: DraftLengthTuner | None = None
        self.metrics = SpeculationMetrics(max_draft_tokens=16)
        self.gate: AdaptiveGate | None = None
        self.buffers: _SpecBuffers | None = None
        self._mirror: dict[int, list[int]] = {}  # request index -> completion tokens (host)
        self._stale = True  # plain steps ran since the mirrors / catch-up blocks were last valid
        self._call = 0
        self.speculative_steps = 0

    # ------------------------------------------------------------------ setup
    def allocate(self, num_slots: int, cache_len: int, device: torch.device, dtype: torch.dtype) -> None:
        """(Re)allocate the static buffers for the engine's slots."""
        engine = self.engine
        vocab = engine.vocab_size
        rows = min(num_slots, engine._graphs.bucket(min(self.config.threshold, num_slots)))  # type: ignore[union-attr]
        self.spec_rows = rows
        self._cache_len = cache_len
        # the metrics' states live where the verify results do: no host sync per step
        self.metrics = SpeculationMetrics(max_draft_tokens=16, device=device)
        long: dict[str, Any] = {"dtype": torch.long, "device": device}
        self.buffers = _SpecBuffers(
            draft_tokens=torch.zeros(num_slots, self.max_k, **long),
            draft_lens=torch.zeros(num_slots, **long),
            draft_probs=torch.zeros(rows, self.max_k, vocab, device=device),
            cu_feat=torch.zeros(num_slots, self.width, engine._state.hidden.shape[1], device=device, dtype=dtype),  # type: ignore[union-attr]
            cu_tok=torch.zeros(num_slots, self.width, **long),
            cu_base=torch.zeros(num_slots, **long),
            cu_valid=torch.ones(num_slots, **long),
            cu_fresh=torch.zeros(num_slots, dtype=torch.bool, device=device),
            draft_start=torch.zeros(num_slots, **long),
            num_accepted=torch.zeros(num_slots, **long),
            emitted=torch.zeros(num_slots, **long),
            dcache=None,
        )
        if isinstance(engine.drafter, EagleDrafter):
            self._ensure_drafter_cache(engine.drafter)
        on_cuda = device.type == "cuda"
        if self.config.num_draft_tokens is None and (self.tuner is None or self.tuner._cuda != on_cuda):
            # built once; rebuilt (keeping what it measured) only if the engine moved between CPU and CUDA
            state = None if self.tuner is None else self.tuner.state_dict()
            self.tuner = DraftLengthTuner(
                self.config.draft_candidates, epsilon=self.config.tuner_epsilon, device=device
            )
            if state is not None:
                self.tuner.load_state_dict(state)
        self.gate = AdaptiveGate(
            min(self.config.threshold, rows), self.config.hysteresis_steps, hard_limit=rows
        )

    def _ensure_drafter_cache(self, drafter: EagleDrafter) -> None:
        """The EAGLE drafter's one-layer cache, (re)allocated when the drafter's shapes need it."""
        buf = self.buffers
        assert buf is not None
        shape = (buf.cu_tok.shape[0], self._cache_len, drafter.num_kv_heads, drafter.head_dim)
        dtype = drafter.fc.weight.dtype
        if buf.dcache is None or tuple(buf.dcache.k[0].shape) != shape or buf.dcache.dtype != dtype:
            buf.dcache = KVCache.allocate(1, shape[0], shape[1], shape[2], shape[3],
                                          device=buf.cu_tok.device, dtype=dtype)

    def begin(self) -> None:
        """Start of a ``generate`` call: gate off, fresh metrics and mirrors."""
        assert self.gate is not None and self.buffers is not None
        self.gate.reset()
        self.metrics.reset()
        self._mirror.clear()
        self._stale = True
        self._call += 1
        self.speculative_steps = 0
        self.buffers.cu_fresh.zero_()

    def wants(self, active_rows: int) -> bool:
        """The gate's decision for a step over ``active_rows`` rows."""
        assert self.gate is not None
        return self.gate.update(active_rows)

    def plain_step(self) -> None:
        """A plain decode step ran: mirrors and catch-up blocks are out of date."""
        self._stale = True

    def move_rows(self, src: Tensor, dst: Tensor) -> None:
        """Follow the scheduler's repacking of slots."""
        assert self.buffers is not None
        for t in self.buffers.per_slot():
            t[dst] = t[src]
        if self.buffers.dcache is not None:
            self.buffers.dcache.copy_slots(dst, src)

    def finished(self, requests: Sequence[Request]) -> None:
        """Rows ended: hand their rollouts to a suffix drafter as finished siblings."""
        drafter = self.engine.drafter
        for r in requests:
            self._mirror.pop(r.index, None)
            if isinstance(drafter, SuffixDrafter):
                drafter.finish_row(r.prompt, (self._call, r.index))

    # ------------------------------------------------------------------ the step
    def step(self, n: int, sampling: SamplingConfig, sampling_key: tuple[Any, ...]) -> tuple[int, float]:
        """One speculative step over the ``n`` active rows; returns (tokens appended, seconds)."""
        engine = self.engine
        st, buf, graphs = engine._state, self.buffers, engine._graphs
        assert st is not None and buf is not None and graphs is not None
        start = time.perf_counter()
        batch = graphs.bucket(n)
        k = self.tuner.choose(n) if self.tuner is not None else self.max_k
        timing = self.tuner.start(k, n) if self.tuner is not None else None
        drafter = engine.drafter
        if self._stale:
            buf.cu_fresh.zero_()
        if isinstance(drafter, EagleDrafter):
            width = st.hidden.shape[1]
            expected = engine.hidden_size * (len(drafter.feature_layers) if drafter.feature_layers else 1)
            if width != expected:
                raise ValueError(
                    f"the drafter reads {expected}-wide features (feature_layers={drafter.feature_layers!r}) but the "
                    f"engine keeps {width}-wide ones: replace engine.drafter between generate calls, not during one"
                )
            self._ensure_drafter_cache(drafter)
            profile = GraphProfile("draft", batch, k + 1, (*sampling_key, engine._drafter_handle))
            engine._run_step(profile, lambda: self._draft_eagle(batch, k, sampling, drafter))
            probs: Tensor | None = buf.draft_probs
            host = False
        else:
            probs = buf.draft_probs if self._draft_host(n, k, sampling, drafter) else None
            host = True
        profile = GraphProfile("verify", batch, k + 1, (*sampling_key, probs is None))
        engine._run_step(profile, lambda: self._verify(batch, k, sampling, probs))
        self._stale = False
        self.speculative_steps += 1
        emitted = buf.emitted[:n]
        if timing is not None and self.tuner is not None:
            self.tuner.stop(timing, emitted)
        self.metrics.update_verify(buf.num_accepted[:n], buf.draft_lens[:n])
        if host:
            self._update_mirrors(n, k)
        tokens = int(emitted.sum())
        seconds = time.perf_counter() - start
        self.metrics.update_step(True, "speculative", tokens, seconds)
        return tokens, seconds

    def _draft_host(self, n: int, k: int, sampling: SamplingConfig, drafter: Any) -> bool:
        """Drafts from the host-side drafter for the first ``n`` slots, into the static buffers.

        Returns whether the drafts came with their distributions (else they are deterministic).
        """
        engine, buf = self.engine, self.buffers
        assert buf is not None
        active = engine._scheduler.active[:n]
        if self._stale:
            self._sync_mirrors(active)
        contexts = [list(r.prompt) + self._mirror.setdefault(r.index, []) for r in active]
        device = buf.draft_tokens.device
        if isinstance(drafter, SuffixDrafter):
            drafts = drafter.propose_batch(
                contexts, k, groups=[r.prompt for r in active],
                row_ids=[(self._call, r.index) for r in active], prompt_lens=[len(r.prompt) for r in active],
            )
            proposal = DraftProposal.from_lists(drafts, k, device=device)
        else:
            proposal = drafter.draft(contexts, k, sampling, engine._gen, device)
            if proposal.num_draft_tokens != k or proposal.tokens.shape[0] != n:
                raise ValueError(
                    f"drafter.draft must return ({n}, {k}) drafts, got {tuple(proposal.tokens.shape)}"
                )
        buf.draft_tokens[:n, :k] = proposal.tokens
        buf.draft_lens[:n] = proposal.lens
        if n < buf.draft_lens.shape[0]:
            buf.draft_lens[n:] = 0
        if proposal.probs is not None:
            buf.draft_probs[:n, :k] = proposal.probs
            return True
        return False

    def _sync_mirrors(self, active: list[Request]) -> None:
        """Read the rows' completions so far from the device (once, when speculation starts)."""
        st = self.engine._state
        assert st is not None
        n = len(active)
        counts = st.num_generated[:n].tolist()
        longest = max(counts) if counts else 0
        rows = st.out_tokens[:n, :longest].tolist() if longest else [[] for _ in range(n)]
        for r, c, row in zip(active, counts, rows):
            self._mirror[r.index] = row[:c]

    def _update_mirrors(self, n: int, k: int) -> None:
        buf, st = self.buffers, self.engine._state
        assert buf is not None and st is not None
        active = self.engine._scheduler.active[:n]
        counts = buf.emitted[:n].tolist()
        ends = st.num_generated[:n].tolist()
        rows = st.out_tokens[:n, : max(ends) if ends else 0].tolist()
        for r, c, e, row in zip(active, counts, ends, rows):
            if c:
                self._mirror[r.index] = row[:e]

    def _drafter_forward(
        self, drafter: EagleDrafter, feats: Tensor, tokens: Tensor, positions: Tensor, batch: int
    ) -> Tensor:
        """The drafter layer over ``(B, q)`` rows at ``positions``, with its cache; returns ``(B, q, H)``."""
        buf = self.buffers
        assert buf is not None and buf.dcache is not None
        x = drafter.input_hidden(feats.to(drafter.fc.weight.dtype), tokens)  # (B, q, H)
        cos, sin = rope_cos_sin(positions, drafter.inv_freq, drafter.rope_scaling, x.dtype)
        keys = torch.arange(buf.dcache.max_seq_len, device=x.device)
        start = buf.draft_start[:batch]
        mask = (keys[None, None, :] <= positions[:, :, None]) & (keys[None, None, :] >= start[:, None, None])
        return decoder_layer(
            drafter.layers[0], x, cos, sin, positions, buf.dcache.k[0], buf.dcache.v[0], mask,
            num_heads=drafter.num_heads, num_kv_heads=drafter.num_kv_heads, head_dim=drafter.head_dim,
        )

    def _draft_eagle(self, batch: int, k: int, sampling: SamplingConfig, drafter: EagleDrafter) -> None:
        """Catch up on the last verify's rows, then chain k drafts (graph-capturable, in place)."""
        st, buf = self.engine._state, self.buffers
        assert st is not None and buf is not None and buf.draft_probs is not None
        w = self.width
        fresh = buf.cu_fresh[:batch]
        pending_pos = st.positions[:batch]
        # rows whose last step was plain (or new rows): one true row, the newest feature + pending token
        single_feat = torch.zeros_like(buf.cu_feat[:batch])
        single_feat[:, 0] = st.hidden[:batch]
        single_tok = torch.zeros_like(buf.cu_tok[:batch])
        single_tok[:, 0] = st.tokens[:batch]
        feats = torch.where(fresh[:, None, None], buf.cu_feat[:batch], single_feat)  # (B, W, H)
        toks = torch.where(fresh[:, None], buf.cu_tok[:batch], single_tok)  # (B, W)
        base = torch.where(fresh, buf.cu_base[:batch], (pending_pos - 1).clamp_min(0))
        valid = torch.where(fresh, buf.cu_valid[:batch], torch.ones_like(base))
        buf.draft_start[:batch] = torch.where(fresh, buf.draft_start[:batch], base)
        positions = base[:, None] + torch.arange(w, device=base.device)[None]  # (B, W)
        pred = self._drafter_forward(drafter, feats, toks, positions, batch)  # (B, W, H)
        rows = torch.arange(batch, device=base.device)
        feature = pred[rows, valid - 1]  # (B, H): predicted feature of the pending token's position
        position = base + valid - 1  # position of the first draft row
        token = st.tokens[:batch]
        for j in range(k):
            if j > 0:
                position = position + 1
                feature = self._drafter_forward(
                    drafter, feature[:, None], token[:, None], position[:, None], batch
                )[:, 0]
            q = processed_probs(drafter.logits(feature), sampling.temperature, sampling.top_k, sampling.top_p)
            token = q.argmax(-1) if sampling.greedy else sample(q, self.engine._gen)
            buf.draft_tokens[:batch, j] = token
            buf.draft_probs[:batch, j] = q
        buf.draft_lens[:batch] = k

    def _verify(self, batch: int, k: int, sampling: SamplingConfig, probs: Tensor | None) -> None:
        """Policy forward over k + 1 tokens a row, rejection sampling, state update (graph-capturable)."""
        engine = self.engine
        st, buf, cache = engine._state, self.buffers, engine._cache
        assert st is not None and buf is not None and cache is not None and engine._compiled is not None
        pos = st.positions[:batch]
        drafts = buf.draft_tokens[:batch, :k]
        inputs = torch.cat([st.tokens[:batch, None], drafts], dim=1)  # (B, k+1)
        offsets = torch.arange(k + 1, device=pos.device)
        capture = engine._capture_layers()
        logits, hidden = engine._compiled(inputs, pos[:, None] + offsets[None], cache.k, cache.v, capture)
        target = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)  # (B, k+1, V)
        lens = buf.draft_lens[:batch]
        q = None if probs is None else probs[:batch, :k]
        result = verify_chain(drafts, q, target, lens, engine._gen)
        active = ~st.finished[:batch]
        count = st.num_generated[:batch]
        toks, logps = result.tokens, result.logprobs  # (B, k+1)
        emitted = offsets[None] < result.num_emitted[:, None]
        is_stop = (toks[:, :, None] == st.stop_ids[None, None, :]).any(-1) & emitted
        first_stop = torch.where(is_stop.any(1), is_stop.long().argmax(1) + 1, result.num_emitted)
        take = torch.minimum(first_stop, st.max_new - count)
        take = torch.where(active, take, torch.zeros_like(take))  # (B,)
        write = offsets[None] < take[:, None]
        sink = st.out_tokens.shape[1] - 1
        columns = torch.where(write, count[:, None] + offsets[None], sink)
        st.out_tokens[:batch].scatter_(1, columns, toks)
        st.out_logprobs[:batch].scatter_(1, columns, logps.float())
        new_count = count + take
        stopped = (is_stop & write).any(1)
        st.finished[:batch] = st.finished[:batch] | (active & (stopped | (new_count >= st.max_new)))
        st.num_generated[:batch] = new_count
        last = toks.gather(1, (take - 1).clamp_min(0)[:, None])[:, 0]
        st.tokens[:batch] = torch.where(active, last, st.tokens[:batch])
        st.positions[:batch] = pos + take
        rows = torch.arange(batch, device=pos.device)
        newest = hidden[rows, (take - 1).clamp_min(0)]  # (B, F): the feature that predicted the pending token
        st.hidden[:batch] = torch.where(active[:, None], newest.to(st.hidden.dtype), st.hidden[:batch])
        # the EAGLE catch-up block for the next step: true features and the tokens that followed them
        buf.cu_feat[:batch, : k + 1] = hidden.to(buf.cu_feat.dtype)
        buf.cu_tok[:batch, : k + 1] = toks
        buf.cu_base[:batch] = pos
        buf.cu_valid[:batch] = take.clamp_min(1)
        buf.cu_fresh[:batch] = active
        buf.num_accepted[:batch] = torch.where(active, result.num_accepted, torch.zeros_like(take))
        buf.emitted[:batch] = take

    def stats(self) -> dict[str, float]:
        """Speculation figures for ``RolloutOutput.stats``."""
        out = self.metrics.stats()
        out["spec/steps"] = float(self.speculative_steps)
        if self.gate is not None:
            out["spec/gate_switches"] = float(self.gate.switches)
        if self.tuner is not None:
            out.update(self.tuner.summary())
        return out
