"""A bounded replay buffer of the policy's features and tokens, for training the drafter in stalls.

Where the features come from: the policy's forward in the RL training step
(`lightning_tlt.rl.common.RLModule.harvest_features` -> ``last_policy_features``). That forward
runs anyway to compute the loss, and it already computes the last hidden state of every prompt and
completion token, so harvesting costs one device copy of a tensor that exists, not a forward. The
alternative, keeping the engine's hidden state at each decode step, would add a write per step
inside the captured decode graphs and keep features of rows whose rollouts may never be trained on.
The features are those of the policy that generated the rollouts (the first, on-policy pass),
which is exactly the distribution the drafter must imitate at the next rollout.

Each entry is one sequence with its padding stripped (prompt + completion, positions from 0), the
completion mask and the RL step it came from; the oldest entries are dropped beyond the capacity.
A fixed share of entries (chosen by an explicit generator) is held out, never trained on, to
measure the drafter's acceptance before publishing it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_tlt.drafters.eagle import EagleBatch


@dataclass
class _Entry:
    features: Tensor  # (T, F)
    last_features: Tensor | None  # (T, H) when features are EAGLE-3's concatenation
    tokens: Tensor  # (T,) long
    completion_mask: Tensor  # (T,) bool
    step: int


class FeatureReplayBuffer:
    """Bounded FIFO of per-sequence (features, tokens, completion mask), tagged with the RL step.

    Args:
        capacity: most sequences kept (oldest dropped first).
        heldout_fraction: share of added sequences kept out of training, for held-out acceptance.
        max_len: longest training window; longer sequences are cut to a random window of this many
            tokens (positions keep their true values, so RoPE sees what the engine sees).
        seed: seeds the buffer's generator (held-out choice, sampling) when none is given.
        generator: the buffer's randomness (a CPU ``torch.Generator``).
    """

    def __init__(
        self,
        capacity: int = 256,
        heldout_fraction: float = 0.1,
        max_len: int = 512,
        seed: int = 0,
        generator: torch.Generator | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction!r}")
        if max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {max_len!r}")
        self.capacity = capacity
        self.heldout_fraction = heldout_fraction
        self.max_len = max_len
        self._generator = generator if generator is not None else torch.Generator().manual_seed(seed)
        self._train: deque[_Entry] = deque()
        self._heldout: deque[_Entry] = deque()
        self._added = 0

    # ------------------------------------------------------------------ filling
    @torch.no_grad()
    def add(
        self,
        features: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        completion_mask: Tensor,
        step: int,
        *,
        last_features: Tensor | None = None,
    ) -> int:
        """Add a batch of sequences (padding anywhere; real tokens must be contiguous per row).

        Args:
            features: ``(N, T, F)`` the policy's features (detached; kept on their device).
            input_ids: ``(N, T)`` tokens.
            attention_mask: ``(N, T)`` 1 on real tokens (e.g. left-padded prompt + right-padded completion).
            completion_mask: ``(N, T)`` 1 on completion tokens.
            step: the RL step the rollouts belong to.
            last_features: ``(N, T, H)`` last-layer features when ``features`` are EAGLE-3's.

        Returns:
            Sequences added (rows with fewer than 2 real tokens or no completion are skipped).
        """
        if features.shape[:2] != input_ids.shape or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"features (N, T, F), input_ids (N, T) and attention_mask (N, T) must agree, got "
                f"{tuple(features.shape)}, {tuple(input_ids.shape)}, {tuple(attention_mask.shape)}"
            )
        lengths = attention_mask.sum(1).tolist()
        starts = attention_mask.long().argmax(1).tolist()  # first real token of each row
        has_completion = (completion_mask.bool() & attention_mask.bool()).any(1).tolist()
        added = 0
        for i, (start, length, any_completion) in enumerate(zip(starts, lengths, has_completion)):
            if length < 2 or not any_completion:
                continue
            sl = slice(start, start + length)
            entry = _Entry(
                features=features[i, sl].detach().clone(),
                last_features=None if last_features is None else last_features[i, sl].detach().clone(),
                tokens=input_ids[i, sl].clone(),
                completion_mask=completion_mask[i, sl].bool().clone(),
                step=int(step),
            )
            heldout = bool(torch.rand((), generator=self._generator) < self.heldout_fraction)
            (self._heldout if heldout else self._train).append(entry)
            self._added += 1
            added += 1
        self._evict()
        return added

    def _evict(self) -> None:
        heldout_cap = max(1, round(self.capacity * self.heldout_fraction)) if self.heldout_fraction else 0
        while len(self._heldout) > heldout_cap:
            self._heldout.popleft()
        while len(self._train) > self.capacity - len(self._heldout) and self._train:
            self._train.popleft()

    def __len__(self) -> int:
        return len(self._train) + len(self._heldout)

    @property
    def num_train(self) -> int:
        return len(self._train)

    @property
    def num_heldout(self) -> int:
        return len(self._heldout)

    def clear(self) -> None:
        self._train.clear()
        self._heldout.clear()

    # ------------------------------------------------------------------ batches
    def sample(self, batch_size: int, device: torch.device | str | None = None) -> EagleBatch:
        """A training batch of ``batch_size`` sequences drawn uniformly (with replacement), aligned.

        Raises:
            ValueError: the buffer holds no training sequence yet.
        """
        if not self._train:
            raise ValueError("the replay buffer has no training sequences yet")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        picks = torch.randint(len(self._train), (batch_size,), generator=self._generator).tolist()
        return self._collate([self._train[i] for i in picks], device, crop=True)

    def heldout(
        self, device: torch.device | str | None = None, max_sequences: int | None = None
    ) -> EagleBatch | None:
        """The held-out sequences as one aligned batch (the newest ``max_sequences``), or ``None``."""
        if not self._heldout:
            return None
        entries = list(self._heldout)[-max_sequences:] if max_sequences else list(self._heldout)
        return self._collate(entries, device, crop=True)

    def _collate(self, entries: list[_Entry], device: torch.device | str | None, crop: bool) -> EagleBatch:
        windows = []
        for e in entries:
            n = e.tokens.shape[0]
            start = 0
            if crop and n > self.max_len:
                # a window whose rows include completion tokens: its last token at or after the
                # first completion token, its second token at or before the last one
                completion = e.completion_mask.nonzero().flatten()
                lo = max(0, int(completion.min()) - (self.max_len - 1))
                hi = max(lo, min(n - self.max_len, int(completion.max()) - 1))
                start = lo + int(torch.randint(hi - lo + 1, (), generator=self._generator))
            windows.append((e, start, min(n, start + self.max_len)))
        width = max(stop - start for _, start, stop in windows)
        ref = entries[0]
        dev = torch.device(device) if device is not None else ref.features.device
        feat_dim = ref.features.shape[-1]
        last_dim = ref.last_features.shape[-1] if ref.last_features is not None else feat_dim
        bsz = len(windows)
        feats = torch.zeros(bsz, width, feat_dim, dtype=ref.features.dtype, device=dev)
        last = (
            torch.zeros(bsz, width, last_dim, dtype=ref.features.dtype, device=dev)
            if ref.last_features is not None
            else None
        )
        tokens = torch.zeros(bsz, width, dtype=torch.long, device=dev)
        cmask = torch.zeros(bsz, width, dtype=torch.bool, device=dev)
        positions = torch.zeros(bsz, width, dtype=torch.long, device=dev)
        real = torch.zeros(bsz, width, dtype=torch.bool, device=dev)
        for i, (e, start, stop) in enumerate(windows):
            n = stop - start
            feats[i, :n] = e.features[start:stop].to(dev)
            if last is not None and e.last_features is not None:
                last[i, :n] = e.last_features[start:stop].to(dev)
            tokens[i, :n] = e.tokens[start:stop].to(dev)
            cmask[i, :n] = e.completion_mask[start:stop].to(dev)
            positions[i, :n] = torch.arange(start, stop, device=dev)
            real[i, :n] = True
        target = feats if last is None else last
        # alignment of `align_for_eagle`: row t = (h_t, x_{t+1}, position t) -> h_{t+1}
        return EagleBatch(
            features=feats[:, :-1],
            input_ids=tokens[:, 1:],
            position_ids=positions[:, :-1],
            target_features=target[:, 1:],
            loss_mask=cmask[:, 1:] & real[:, 1:],
            attention_mask=real[:, :-1],
        )

    # ------------------------------------------------------------------ checkpointing
    def summary(self) -> dict[str, Any]:
        """What a checkpoint keeps of the buffer (its contents are rebuilt from later rollouts)."""
        entries = list(self._train) + list(self._heldout)
        steps = [e.step for e in entries]
        return {
            "sequences": len(entries),
            "train_sequences": len(self._train),
            "heldout_sequences": len(self._heldout),
            "tokens": int(sum(e.tokens.shape[0] for e in entries)),
            "completion_tokens": int(sum(int(e.completion_mask.sum()) for e in entries)),
            "min_step": min(steps) if steps else None,
            "max_step": max(steps) if steps else None,
            "added": self._added,
            "capacity": self.capacity,
        }

    def state_dict(self) -> dict[str, Any]:
        """The summary and the generator's state (the entries are not saved: they are large and
        belong to a policy that has moved on)."""
        return {"summary": self.summary(), "generator": self._generator.get_state(), "added": self._added}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._generator.set_state(state_dict["generator"])
        self._added = int(state_dict["added"])
