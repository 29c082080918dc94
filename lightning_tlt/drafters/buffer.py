"""A token-bounded replay buffer of the policy's features, packed into static-shape drafter batches.

Where the features come from: the policy's forward in the RL training step (the RL module hands
them over through `lightning_tlt.rl.common.PolicyFeatureSource`). That forward runs anyway to
compute the loss and already computes the last hidden state of every prompt and completion token,
so harvesting costs one device copy of a tensor that exists, not a forward. The features are those
of the policy that generated the rollouts, which is what the drafter must imitate next.

Storage is compact and bounded by tokens, because it goes into checkpoints: one preallocated ring
of ``capacity_tokens`` slots holding the features in the policy's dtype, the tokens as int32 and
the completion mask as bool, plus host metadata per sequence (where it lies, its first position,
its RL step, whether it is held out). The ring never moves (captured CUDA graphs read it at fixed
addresses); the oldest sequences are overwritten first.

Batches have one static shape: ``rows x length`` draft rows, each row packing windows of one or
more sequences (block-causal attention, true RoPE positions). The host only draws *which* windows
(with an explicit generator) and writes a small ``(rows, segments, 3)`` plan; `FeatureReplayBuffer.gather`
expands the plan and gathers the rows on the device with no host sync, so it can run inside a
captured train step.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import astuple, dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_tlt.drafters.eagle import EagleBatch

PLAN_FIELDS = 3
"""A plan row is ``(first ring slot, first position, draft rows)`` of one window (``-1, 0, 0``: unused)."""


@dataclass
class StoredSequence:
    """Where one sequence lies in the ring, and what it is (host metadata, one per stored sequence)."""

    offset: int  # first ring slot
    length: int  # tokens stored
    position: int  # position of the first stored token
    first_target: int  # first index i >= 1 whose token is a completion token (the target of draft row i - 1)
    last_target: int  # last such index
    step: int  # RL step of the rollout
    heldout: bool


class FeatureReplayBuffer:
    """Ring of (feature, token, completion flag) slots, one sequence after the other, FIFO.

    Args:
        capacity_tokens: ring size in tokens (sequences longer than this keep their first
            ``capacity_tokens`` tokens).
        heldout_fraction: share of added sequences kept out of training, for held-out acceptance.
        seed: seeds the buffer's generator (held-out choice, batch draws) when none is given.
        generator: the buffer's randomness (a CPU ``torch.Generator``).
        dtype: storage dtype of the features; ``None``: the dtype of the first features added.
        device: where the ring lives; ``None``: where the first features added live.
    """

    def __init__(
        self,
        capacity_tokens: int = 65536,
        heldout_fraction: float = 0.1,
        seed: int = 0,
        generator: torch.Generator | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if capacity_tokens < 2:
            raise ValueError(f"capacity_tokens must be >= 2, got {capacity_tokens!r}")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
        self.capacity_tokens = capacity_tokens
        self.heldout_fraction = heldout_fraction
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else None
        self._generator = generator if generator is not None else torch.Generator().manual_seed(seed)
        self._seqs: deque[StoredSequence] = deque()
        self._train: list[StoredSequence] | None = None  # cached training sequences (rebuilt after add)
        self._head = 0  # next free ring slot
        self._added = 0
        self.features: Tensor | None = None  # (C, F) ring, the policy's dtype
        self.tokens: Tensor | None = None  # (C,) int32
        self.completion: Tensor | None = None  # (C,) bool

    # ------------------------------------------------------------------ storage
    def place(self, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
        """Where the features will be stored (and in which dtype; ``None``: the first features' own).

        Before the first `add` only: the storage is allocated there then, and never moved.
        """
        if self.features is not None:
            raise RuntimeError(f"FeatureReplayBuffer.place: the buffer is allocated already (on {self.device}); "
                               "place it before the first add")  # fmt: skip
        self.device, self.dtype = torch.device(device), dtype

    def _allocate(self, feature_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.dtype = self.dtype or dtype
        self.device = self.device or device
        c = self.capacity_tokens
        self.features = torch.zeros(c, feature_dim, dtype=self.dtype, device=self.device)
        self.tokens = torch.zeros(c, dtype=torch.int32, device=self.device)
        self.completion = torch.zeros(c, dtype=torch.bool, device=self.device)

    def _place(self, length: int) -> int:
        """Ring offset for ``length`` tokens; evicts the sequences it overwrites (the oldest)."""
        if self._head + length > self.capacity_tokens:  # wrap: the tail end of the ring goes unused
            while self._seqs and self._seqs[0].offset >= self._head:
                self._seqs.popleft()
            self._head = 0
        start, stop = self._head, self._head + length
        while self._seqs and self._seqs[0].offset < stop and self._seqs[0].offset + self._seqs[0].length > start:
            self._seqs.popleft()
        self._head = stop
        return start

    # ------------------------------------------------------------------ filling
    @torch.no_grad()
    def add(
        self, features: Tensor, input_ids: Tensor, attention_mask: Tensor, completion_mask: Tensor, step: int,
        *, heldout: bool | None = None,
    ) -> int:
        """Add a batch of sequences (padding anywhere; real tokens must be contiguous per row).

        Args:
            features: ``(N, T, F)`` the policy's features (detached).
            input_ids: ``(N, T)`` tokens.
            attention_mask: ``(N, T)`` 1 on real tokens (e.g. left-padded prompt + right-padded completion).
            completion_mask: ``(N, T)`` 1 on completion tokens.
            step: the RL step the rollouts belong to.
            heldout: hold every added sequence out (``True``) or none (``False``); ``None`` draws each with
                probability ``heldout_fraction``. The draw is made either way, so the buffer's later draws
                do not depend on it.

        Returns:
            Sequences added (rows with fewer than 2 real tokens or no completion token after the
            first are skipped).
        """
        if features.dim() != 3 or features.shape[:2] != input_ids.shape or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"features (N, T, F), input_ids (N, T) and attention_mask (N, T) must agree, got "
                f"{tuple(features.shape)}, {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}"
            )
        if completion_mask.shape != input_ids.shape:
            raise ValueError(
                f"completion_mask must be (N, T) like input_ids {tuple(input_ids.shape)}, got {tuple(completion_mask.shape)}"
            )
        if self.features is None:
            self._allocate(features.shape[-1], features.dtype, features.device)
        assert self.features is not None and self.tokens is not None and self.completion is not None
        if features.shape[-1] != self.features.shape[-1]:
            raise ValueError(f"features are {features.shape[-1]} wide, the buffer holds {self.features.shape[-1]}")
        real = attention_mask.bool()
        width = real.shape[1]
        cols = torch.arange(width, device=real.device)
        start = real.long().argmax(1)  # first real token per row
        target = completion_mask.bool() & real & (cols[None] > start[:, None])  # completion tokens after the first
        big = torch.full_like(cols, width)[None]
        first = torch.where(target, cols[None], big).amin(1) - start
        last = torch.where(target, cols[None], -big).amax(1) - start
        meta = torch.stack([start, real.sum(1), first, last, target.any(1).long()], 1).tolist()  # one host read
        placed: list[tuple[StoredSequence, int, int]] = []  # (sequence, source row, its first column)
        for i, (row_start, length, first_t, last_t, any_target) in enumerate(meta):
            if length < 2 or not any_target:
                continue
            length = min(length, self.capacity_tokens)
            if first_t >= length:  # its completion lies beyond the stored prefix
                continue
            offset = self._place(length)
            drawn = bool(torch.rand((), generator=self._generator) < self.heldout_fraction)
            held = drawn if heldout is None else heldout
            seq = StoredSequence(offset, length, 0, first_t, min(last_t, length - 1), int(step), held)
            self._seqs.append(seq)
            placed.append((seq, i, row_start))
        # a harvest larger than the ring laps it: write only the sequences still held, so every slot is
        # written once (duplicate indices in one index_put_ are undefined on CUDA: parallel writes)
        live = {id(q) for q in self._seqs}
        placed = [p for p in placed if id(p[0]) in live]
        added = len(placed)
        if added:
            src_rows = [i for seq, i, _ in placed for _ in range(seq.length)]
            src_cols = [c for seq, _, row_start in placed for c in range(row_start, row_start + seq.length)]
            dst = [c for seq, _, _ in placed for c in range(seq.offset, seq.offset + seq.length)]
            dev = self.features.device
            d = torch.tensor(dst, device=dev)
            r = torch.tensor(src_rows, device=features.device)
            c = torch.tensor(src_cols, device=features.device)
            self.features[d] = features[r, c].to(device=dev, dtype=self.features.dtype)
            self.tokens[d] = input_ids[r, c].to(device=dev, dtype=torch.int32)
            self.completion[d] = completion_mask[r, c].to(device=dev).bool()
        self._added += added
        self._train = None
        return added

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def sequences(self) -> tuple[StoredSequence, ...]:
        """The stored sequences, oldest first: where each lies in the ring, its RL step, whether it is held out."""
        return tuple(self._seqs)

    @property
    def num_train(self) -> int:
        return len(self._train_seqs())

    @property
    def num_heldout(self) -> int:
        return sum(1 for s in self._seqs if s.heldout)

    @property
    def num_tokens(self) -> int:
        """Tokens held (live sequences)."""
        return sum(s.length for s in self._seqs)

    def clear(self) -> None:
        self._seqs.clear()
        self._train = None
        self._head = 0

    def _train_seqs(self) -> list[StoredSequence]:
        if self._train is None:
            self._train = [s for s in self._seqs if not s.heldout]
        return self._train

    # ------------------------------------------------------------------ plans (host) and batches (device)
    def plan(self, rows: int, length: int, segments: int) -> Tensor:
        """Draw one training batch: a ``(rows, segments, 3)`` int64 plan (host; see `PLAN_FIELDS`).

        Each row packs windows of uniformly drawn training sequences until its ``length`` draft
        rows are full (or ``segments`` windows are used); a whole sequence when it fits, else a
        random window of it whose draft rows include completion targets (true positions kept).
        The randomness is one draw from the buffer's generator (the host work stays in the tens of
        microseconds: this runs in the decode loop's listener).

        Raises:
            ValueError: the buffer holds no training sequence yet.
        """
        train = self._train_seqs()
        if not train:
            raise ValueError("the replay buffer has no training sequences yet")
        draws = iter(torch.rand(rows * segments * 2, generator=self._generator, dtype=torch.float64).tolist())
        plan = array("q", [-1, 0, 0]) * (rows * segments)  # flat (rows, segments, 3)
        for r in range(rows):
            free, k = length, 0
            while free >= 1 and k < segments:
                seq = train[min(int(next(draws) * len(train)), len(train) - 1)]
                u = next(draws)
                if seq.length - 1 <= free:
                    begin, window = 0, seq.length
                else:  # a window of free + 1 tokens with at least one completion target among its rows
                    window = free + 1
                    lo = max(0, seq.first_target - (window - 1))
                    hi = max(lo, min(seq.length - window, seq.last_target - 1))
                    begin = lo + min(int(u * (hi - lo + 1)), hi - lo)
                i = 3 * (r * segments + k)
                plan[i : i + 3] = array("q", (seq.offset + begin, seq.position + begin, window - 1))
                free -= window - 1
                k += 1
        return torch.frombuffer(plan, dtype=torch.int64).view(rows, segments, 3)

    def heldout_plans(self, rows: int, length: int, segments: int, max_sequences: int | None = None) -> list[Tensor]:
        """The newest ``max_sequences`` held-out sequences, every draft row once, packed into plans.

        Deterministic (no draw): each sequence is cut into consecutive windows of at most
        ``length`` draft rows, placed first-fit into rows of ``rows x length`` batches.
        """
        heldout = [s for s in self._seqs if s.heldout]
        if max_sequences is not None:
            heldout = heldout[-max_sequences:] if max_sequences > 0 else []
        windows = []
        for s in heldout:
            for begin in range(0, s.length - 1, length):
                windows.append((s.offset + begin, s.position + begin, min(length, s.length - 1 - begin)))
        batches: list[list[list[tuple[int, int, int]]]] = []
        row: list[tuple[int, int, int]] = []
        used = 0
        packed: list[list[tuple[int, int, int]]] = []
        for w in windows:
            if used + w[2] > length or len(row) == segments:
                packed.append(row)
                row, used = [], 0
            row.append(w)
            used += w[2]
        if row:
            packed.append(row)
        for start in range(0, len(packed), rows):
            chunk = packed[start : start + rows]
            batches.append([r + [(-1, 0, 0)] * (segments - len(r)) for r in chunk] +
                           [[(-1, 0, 0)] * segments] * (rows - len(chunk)))  # fmt: skip
        return [torch.tensor(b, dtype=torch.int64) for b in batches]

    def gather(self, plan: Tensor, length: int) -> EagleBatch:
        """Expand a ``(R, S, 3)`` plan on the device into ``(R, length)`` aligned, packed draft rows
        (an `EagleBatch`), with no host sync.

        Draft row ``j`` of a window starting at ring slot ``a`` and position ``p`` gets the feature
        at ``a + j``, the token at ``a + j + 1`` (its input), position ``p + j`` and the target
        feature at ``a + j + 1`` (vLLM's alignment, `lightning_tlt.drafters.eagle.align_for_eagle`);
        it counts in the loss when that next token is a completion token. Attention is causal
        within a window and never crosses windows.
        """
        assert self.features is not None and self.tokens is not None and self.completion is not None
        rows, segments, _ = plan.shape
        start, pos, count = plan.unbind(-1)  # (R, S) each
        ends = count.cumsum(-1)  # (R, S)
        j = torch.arange(length, device=plan.device).expand(rows, length)  # (R, L)
        seg = torch.searchsorted(ends, j.contiguous(), right=True)  # the window of each draft row
        real = seg < segments
        seg_c = seg.clamp_max(segments - 1)
        within = j - (ends - count).gather(1, seg_c)
        real = real & (within < count.gather(1, seg_c)) & (start.gather(1, seg_c) >= 0)
        src = torch.where(real, start.gather(1, seg_c) + within, 0)  # (R, L) ring slot of h_t
        nxt = torch.where(real, src + 1, 0)
        keep = (seg[:, :, None] == seg[:, None, :]) & (j[:, None, :] <= j[:, :, None]) & real[:, None, :]
        return EagleBatch(
            features=self.features[src],
            input_ids=self.tokens[nxt].long(),
            position_ids=torch.where(real, pos.gather(1, seg_c) + within, 0),
            target_features=self.features[nxt],
            loss_mask=self.completion[nxt] & real,
            attention_mask=keep,  # (R, L, L) block-causal
        )

    def sample(self, rows: int, length: int, segments: int = 32) -> EagleBatch:
        """A training batch drawn as `plan` does, gathered at once (tests, offline use)."""
        return self.gather(self.plan(rows, length, segments).to(self.device), length)

    # ------------------------------------------------------------------ checkpointing
    def summary(self) -> dict[str, Any]:
        """Counts for logs: sequences, tokens, steps held."""
        steps = [s.step for s in self._seqs]
        return {
            "sequences": len(self._seqs),
            "train_sequences": self.num_train,
            "heldout_sequences": self.num_heldout,
            "tokens": self.num_tokens,
            "min_step": min(steps) if steps else None,
            "max_step": max(steps) if steps else None,
            "added": self._added,
            "capacity_tokens": self.capacity_tokens,
        }

    def state_dict(self) -> dict[str, Any]:
        """The contents (compact: features in their storage dtype, tokens int32), the ring layout,
        and the generator, so a resumed run draws the same batches from the same data."""
        seqs = list(self._seqs)
        slots = [i for s in seqs for i in range(s.offset, s.offset + s.length)]
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        contents = [None if t is None else t[index].cpu() for t in (self.features, self.tokens, self.completion)]
        return {
            "format": 2,
            "capacity_tokens": self.capacity_tokens,
            "sequences": torch.tensor([astuple(s) for s in seqs], dtype=torch.long).reshape(-1, 7),
            "features": contents[0],
            "tokens": contents[1],
            "completion": contents[2],
            "head": self._head,
            "added": self._added,
            "generator": self._generator.get_state(),
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore `state_dict`'s contents at the same ring offsets."""
        if state_dict.get("format") != 2:
            raise ValueError(
                f"FeatureReplayBuffer: a state of format {state_dict.get('format')!r}; this version reads format 2 only"
            )
        if int(state_dict["capacity_tokens"]) != self.capacity_tokens:
            raise ValueError(
                f"the checkpoint's buffer holds {state_dict['capacity_tokens']} tokens, this one "
                f"{self.capacity_tokens}: resume with the same buffer_tokens"
            )
        self._generator.set_state(state_dict["generator"])
        self._added = int(state_dict["added"])
        self.clear()
        self._head = int(state_dict["head"])
        seqs = [StoredSequence(row[0], row[1], row[2], row[3], row[4], row[5], bool(row[6]))
                for row in state_dict["sequences"].tolist()]  # fmt: skip
        if not seqs:
            return
        features = state_dict["features"]
        if self.features is None:
            self._allocate(features.shape[-1], features.dtype, self.device or torch.device("cpu"))
        assert self.features is not None and self.tokens is not None and self.completion is not None
        index = torch.tensor([i for s in seqs for i in range(s.offset, s.offset + s.length)], device=self.device)
        self.features[index] = features.to(device=self.features.device, dtype=self.features.dtype)
        self.tokens[index] = state_dict["tokens"].to(self.tokens.device)
        self.completion[index] = state_dict["completion"].to(self.completion.device)
        self._seqs.extend(seqs)
