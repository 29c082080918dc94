"""`SlotState`: every per-slot tensor of the engine, in one place.

A captured CUDA graph reads and writes static buffers; all of the engine's per-slot buffers live
here, so that admitting a request (`SlotState.reset_rows`), repacking the active rows after some
finished (`SlotState.move_rows`) and protecting the state from a graph warm-up
(`SlotState.snapshot`) each touch every tensor, and no buffer can be forgotten. Row ``i`` of a step
is slot ``i`` (the scheduler keeps active rows packed at the front).

Three groups:

- the decode state (what plain decoding reads and writes);
- the speculation state (drafts, the EAGLE catch-up block, the drafter's history and KV cache),
  present when the engine speculates;
- device counters of speculation (accepted drafts per position, emitted tokens), updated inside
  the captured steps and read once per ``generate``.

The EAGLE drafter's history in its own one-layer KV cache: positions ``[0, prefix_end]`` hold the
prompt (run through the drafter at prefill), positions ``[draft_start, ...]`` the rows drafted
since the row's speculation last (re)started; the positions in between (decoded by plain steps,
which never run the drafter) are a hole its attention skips.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from lightning_tlt.core.kv_cache import KVCache

MAX_STOP_IDS = 8
"""Most stop tokens a sampling configuration may name."""


@dataclass
class SpecSlots:
    """Per-slot buffers of speculation (static: captured graphs read and write them in place)."""

    draft_tokens: Tensor  # (S, K + 1) long: drafted tokens (target ids; the last column is never written)
    draft_index: Tensor  # (S, K + 1) long: their columns in the draft vocabulary
    draft_lens: Tensor  # (S,) long
    cu_feat: Tensor  # (S, W, F): features of the last verify's rows (EAGLE catch-up block)
    cu_tok: Tensor  # (S, W) long: the tokens that followed them
    cu_base: Tensor  # (S,) long: position of row 0 of the block
    cu_valid: Tensor  # (S,) long: valid rows of the block (tokens the last verify appended)
    cu_fresh: Tensor  # (S,) bool: the block is from this slot's last step
    prefix_end: Tensor  # (S,) long: last prompt position in the drafter's cache (-1: none)
    draft_start: Tensor  # (S,) long: first position of the drafter's recent history
    num_accepted: Tensor  # (S,) long: of the last verify
    emitted: Tensor  # (S,) long: tokens each row appended in the last verify
    dcache: KVCache | None = None  # the EAGLE drafter's one-layer cache

    def per_slot(self) -> list[Tensor]:
        out = [getattr(self, f.name) for f in fields(self) if f.name != "dcache"]
        if self.dcache is not None:
            out += [*self.dcache.k, *self.dcache.v]
        return out


@dataclass
class SlotState:
    """The engine's per-slot state; see the module docstring.

    Decode state: ``tokens`` (the next input token of each slot), ``positions`` (its position, the
    slot's KV length), ``num_generated``, ``finished`` (finished, or an empty slot), ``out_tokens``
    and ``out_logprobs`` (``(S, M + 1)``: column ``M`` is a sink for inactive rows), ``hidden`` (the
    policy's feature at each slot's last fed token: what an EAGLE drafter reads), ``keys`` (each
    row's noise key, `lightning_tlt.core.sampling.row_keys`: with ``num_generated`` it names the
    numbers a row's next token is drawn with); per call: ``stop_ids`` (padded with -1) and ``max_new``.
    """

    tokens: Tensor
    positions: Tensor
    num_generated: Tensor
    finished: Tensor
    out_tokens: Tensor
    out_logprobs: Tensor
    hidden: Tensor
    keys: Tensor
    stop_ids: Tensor
    max_new: Tensor
    spec: SpecSlots | None = None
    counters: Tensor | None = None
    """``(3, K + 1)`` float64 speculation counters: ``[0, :3]`` rows verified, accepted drafts + 1
    summed over them (the acceptance length's numerator), tokens appended; ``[1, j]`` / ``[2, j]``
    rows that reached / accepted draft position ``j``."""

    @classmethod
    def allocate(
        cls,
        num_slots: int,
        max_new_tokens: int,
        feature_width: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        max_draft_tokens: int = 0,
    ) -> SlotState:
        """Buffers for ``num_slots`` slots; speculation buffers when ``max_draft_tokens > 0``."""
        long: dict[str, Any] = {"dtype": torch.long, "device": device}
        state = cls(
            tokens=torch.zeros(num_slots, **long),
            positions=torch.zeros(num_slots, **long),
            num_generated=torch.zeros(num_slots, **long),
            finished=torch.ones(num_slots, dtype=torch.bool, device=device),
            out_tokens=torch.zeros(num_slots, max_new_tokens + 1, **long),
            out_logprobs=torch.zeros(num_slots, max_new_tokens + 1, dtype=torch.float32, device=device),
            hidden=torch.zeros(num_slots, feature_width, dtype=dtype, device=device),
            keys=torch.zeros(num_slots, **long),
            stop_ids=torch.full((MAX_STOP_IDS,), -1, **long),
            max_new=torch.zeros((), **long),
        )
        if max_draft_tokens > 0:
            # every buffer a step slices by k one column wider than the widest slice (k drafts, a catch-up
            # block of k + 1 rows): a slice ``[:, :k]`` that takes a buffer's whole width makes Dynamo guard
            # on it, and the compiled update compiled one more version for k = max_draft_tokens (on the H100,
            # 2026-12-06, the 0.5 B policy's verify update compiled 4 versions in 51 s)
            k, w = max_draft_tokens, max_draft_tokens + 2
            state.spec = SpecSlots(
                draft_tokens=torch.zeros(num_slots, k + 1, **long),
                draft_index=torch.zeros(num_slots, k + 1, **long),
                draft_lens=torch.zeros(num_slots, **long),
                cu_feat=torch.zeros(num_slots, w, feature_width, dtype=dtype, device=device),
                cu_tok=torch.zeros(num_slots, w, **long),
                cu_base=torch.zeros(num_slots, **long),
                cu_valid=torch.ones(num_slots, **long),
                cu_fresh=torch.zeros(num_slots, dtype=torch.bool, device=device),
                prefix_end=torch.full((num_slots,), -1, **long),
                draft_start=torch.zeros(num_slots, **long),
                num_accepted=torch.zeros(num_slots, **long),
                emitted=torch.zeros(num_slots, **long),
            )
            state.counters = torch.zeros(3, k + 1, dtype=torch.float64, device=device)
        return state

    @property
    def num_slots(self) -> int:
        return int(self.tokens.shape[0])

    def per_slot(self) -> list[Tensor]:
        """Every tensor indexed by slot (what `move_rows` moves)."""
        out = [self.tokens, self.positions, self.num_generated, self.finished, self.out_tokens,
               self.out_logprobs, self.hidden, self.keys]
        if self.spec is not None:
            out += self.spec.per_slot()
        return out

    def all_tensors(self) -> list[Tensor]:
        """Everything a step may write (what `snapshot` saves)."""
        out = [*self.per_slot(), self.stop_ids, self.max_new]
        if self.counters is not None:
            out.append(self.counters)
        return out

    # ------------------------------------------------------------------ row operations
    def begin(self, stop_ids: list[int], max_new_tokens: int) -> None:
        """Start of a ``generate`` call: every slot empty, the call's stop ids and length cap set."""
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids are supported, got {stop_ids!r}")
        self.finished.fill_(True)
        self.positions.zero_()
        self.tokens.zero_()
        self.stop_ids.fill_(-1)
        if stop_ids:
            self.stop_ids[: len(stop_ids)] = torch.tensor(stop_ids, device=self.stop_ids.device)
        self.max_new.fill_(max_new_tokens)
        if self.counters is not None:
            self.counters.zero_()
        if self.spec is not None:
            self.spec.cu_fresh.zero_()

    def reset_rows(
        self,
        slots: Tensor,
        last_tokens: Tensor,
        positions: Tensor,
        features: Tensor,
        prefix_end: Tensor | None = None,
        keys: Tensor | None = None,
    ) -> None:
        """Admit requests into ``slots``: a fresh row state, nothing inherited from the slot's previous request.

        Args:
            slots: ``(n,)`` long slot indices.
            last_tokens: ``(n,)`` each prompt's last token (fed by the next step).
            positions: ``(n,)`` its position (prompt length - 1).
            features: ``(n, F)`` the policy's feature at the position before it.
            prefix_end: ``(n,)`` last prompt position the drafter has cached (``None``: none, -1).
            keys: ``(n,)`` the rows' noise keys (``None``: 0).
        """
        self.tokens[slots] = last_tokens
        self.positions[slots] = positions
        self.hidden[slots] = features.to(self.hidden.dtype)
        self.num_generated[slots] = 0
        self.keys[slots] = 0 if keys is None else keys
        self.finished[slots] = False
        spec = self.spec
        if spec is not None:
            spec.cu_fresh[slots] = False
            spec.cu_valid[slots] = 1
            spec.cu_base[slots] = (positions - 1).clamp_min(0)
            spec.draft_lens[slots] = 0
            spec.num_accepted[slots] = 0
            spec.emitted[slots] = 0
            spec.prefix_end[slots] = -1 if prefix_end is None else prefix_end
            # the history starts at the row's own prefill: no hole until a plain step opens one
            spec.draft_start[slots] = (positions - 1).clamp_min(0)

    def move_rows(self, src: Tensor, dst: Tensor) -> None:
        """``state[dst] = state[src]`` for every per-slot tensor (the scheduler's repacking)."""
        for t in self.per_slot():
            t[dst] = t[src]

    def snapshot(self) -> Callable[[], None]:
        """Save every tensor a step may write; returns the function that restores them."""
        tensors = self.all_tensors()
        saved = [t.clone() for t in tensors]

        def restore() -> None:
            for t, s in zip(tensors, saved):
                t.copy_(s)

        return restore

    def ensure_drafter_cache(self, num_kv_heads: int, head_dim: int, cache_len: int, dtype: torch.dtype) -> KVCache:
        """The EAGLE drafter's one-layer cache, (re)allocated when a drafter's shapes need it."""
        assert self.spec is not None, "the drafter cache belongs to the speculation state"
        shape = (self.num_slots, cache_len, num_kv_heads, head_dim)
        cache = self.spec.dcache
        if cache is None or tuple(cache.k[0].shape) != shape or cache.dtype != dtype:
            cache = KVCache.allocate(1, shape[0], shape[1], shape[2], shape[3], device=self.tokens.device, dtype=dtype)
            self.spec.dcache = cache
        return cache
