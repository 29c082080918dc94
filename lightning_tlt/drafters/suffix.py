"""A model-free drafter: continue the current suffix where it occurred before.

Reasoning rollouts repeat themselves: they quote the prompt, restate intermediate results, and the
G sibling rollouts of one prompt (GRPO's group) share long stretches (Seer, "grouped
speculation"; RhymeRL's HistoSpec and SPEC-RL draft from earlier rollouts of the same prompt).
`SuffixDrafter` finds the longest match of a row's current suffix (at least ``min_match``, at most
``max_match`` tokens) in

- the prompt and the row's own history,
- the other rows of the same prompt group, as they are being generated,
- the ``max_recent`` most recent finished rollouts of the same group,

and proposes the tokens that followed the match (prompt lookup decoding generalised to a group).
It runs on the host in pure Python: no GPU compute, so it costs nothing while the learned drafter
is cold. Drafts are deterministic (``q`` one-hot), which `lightning_tlt.rollout.verify` verifies
losslessly at any temperature.

Index: every sequence keeps a dict from each ``min_match``-gram to the positions right after its
occurrences, extended incrementally as the row grows (one dict insert per new token); a lookup
checks the most recent ``max_candidates`` occurrences per sequence and extends each match
backwards up to ``max_match`` tokens. Cost per proposal: O(sequences in the group x candidates x
max_match), independent of the rollout length.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from lightning_tlt.drafters.base import DrafterBase, DraftProposal, DraftRow

# sources, from most to least preferred when two matches are equally long
_OWN, _SIBLING, _FINISHED, _PROMPT = 3, 2, 1, 0


class _Tail(Sequence[int]):
    """``seq[start:]`` without the copy: a growing row's completion inside its context list, so a
    step's indexing reads only the new tokens (the per-step host work does not grow with the row)."""

    __slots__ = ("seq", "start")

    def __init__(self, seq: Sequence[int], start: int) -> None:
        self.seq = seq
        self.start = start

    def __len__(self) -> int:
        return len(self.seq) - self.start

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            lo, hi, step = i.indices(len(self))
            return self.seq[self.start + lo : self.start + hi : step]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self.seq[self.start + i]


class SequenceIndex:
    """One token sequence and its n-gram -> end positions index (appends are incremental)."""

    __slots__ = ("n", "tokens", "ends")

    def __init__(self, n: int, tokens: Sequence[int] = ()) -> None:
        self.n = n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, new_tokens: Sequence[int]) -> None:
        toks = self.tokens
        n = self.n
        for tok in new_tokens:
            toks.append(int(tok))
            end = len(toks)
            if end >= n:
                self.ends.setdefault(tuple(toks[end - n : end]), []).append(end)

    def sync(self, tokens: Sequence[int]) -> None:
        """Make this the index of ``tokens``: append the new tail, or rebuild if it is not an extension.

        Only the length and the last known token are compared (O(1)): a row's tokens only grow
        while it decodes; a reused row id with different content is caught by either check.
        """
        old = len(self.tokens)
        if len(tokens) >= old and (old == 0 or tokens[old - 1] == self.tokens[-1]):
            self.extend(tokens[old:])
        else:
            self.tokens, self.ends = [], {}
            self.extend(tokens)


@dataclass
class PromptGroup:
    """What the drafter remembers of one prompt group: its prompt, its rows in flight, its finished rollouts."""

    prompt: SequenceIndex | None = None
    rows: dict[Hashable, SequenceIndex] = field(default_factory=dict)
    finished: deque[SequenceIndex] = field(default_factory=deque)


class SuffixDrafter(DrafterBase):
    """Prompt- and group-lookup drafter (model-free, host-side).

    Typical use by an engine, per speculative step, for each active row: ``propose(context, k,
    group=prompt_index, row_id=slot, prompt_len=len(prompt))`` (or `propose_batch` for all rows
    at once), then `finish_row` when the row ends, so that its siblings of later samples of the same
    prompt can draft from it.

    Args:
        max_match: longest suffix that is matched (longer matches are not distinguished).
        min_match: shortest suffix that counts as a match (the n of the n-gram index), >= 1.
        max_recent: finished rollouts kept per prompt group (oldest dropped first).
        max_candidates: most recent occurrences examined per sequence per lookup.
        max_groups: prompt groups remembered (least recently used dropped first).
    """

    name: str = "suffix"
    needs_features: bool = False

    def __init__(
        self,
        max_match: int = 8,
        min_match: int = 2,
        max_recent: int = 16,
        max_candidates: int = 16,
        max_groups: int = 4096,
    ) -> None:
        if min_match < 1:
            raise ValueError(f"min_match must be >= 1, got {min_match!r}")
        if max_match < min_match:
            raise ValueError(f"max_match must be >= min_match={min_match}, got {max_match!r}")
        if max_recent < 0:
            raise ValueError(f"max_recent must be >= 0, got {max_recent!r}")
        if max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {max_candidates!r}")
        if max_groups < 1:
            raise ValueError(f"max_groups must be >= 1, got {max_groups!r}")
        self.max_match = max_match
        self.min_match = min_match
        self.max_recent = max_recent
        self.max_candidates = max_candidates
        self.max_groups = max_groups
        self._groups: OrderedDict[Hashable, PromptGroup] = OrderedDict()

    # ----------------------------------------------------------------- registration
    def _group(self, group: Hashable) -> PromptGroup:
        entry = self._groups.get(group)
        if entry is None:
            entry = self._groups[group] = PromptGroup(finished=deque(maxlen=self.max_recent))
            while len(self._groups) > self.max_groups:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(group)
        return entry

    def set_prompt(self, group: Hashable, prompt: Sequence[int]) -> None:
        """Register (or replace) the prompt shared by a group's rows."""
        entry = self._group(group)
        if entry.prompt is None:
            entry.prompt = SequenceIndex(self.min_match, prompt)
        else:
            entry.prompt.sync(prompt)

    def update_group(self, group: Hashable, row_id: Hashable, tokens: Sequence[int]) -> None:
        """Register a row's generated tokens so far (its completion, without the prompt).

        Call it as the row grows; only the new tail is indexed. A ``row_id`` reused for a new
        sample is detected (the tokens are not an extension) and re-indexed.
        """
        entry = self._group(group)
        index = entry.rows.get(row_id)
        if index is None:
            entry.rows[row_id] = SequenceIndex(self.min_match, tokens)
        else:
            index.sync(tokens)

    def add_finished(self, group: Hashable, tokens: Sequence[int]) -> None:
        """Remember a finished rollout (completion tokens) of the group; keeps the ``max_recent`` newest."""
        if self.max_recent:
            self._group(group).finished.append(SequenceIndex(self.min_match, tokens))

    def finish_row(self, group: Hashable, row_id: Hashable) -> None:
        """Move a registered row to the group's finished rollouts (its index is reused, not rebuilt)."""
        entry = self._groups.get(group)
        if entry is None or row_id not in entry.rows:
            return
        index = entry.rows.pop(row_id)
        if self.max_recent:
            entry.finished.append(index)

    def clear(self) -> None:
        """Forget every group."""
        self._groups.clear()

    @property
    def groups(self) -> Mapping[Hashable, PromptGroup]:
        """The remembered prompt groups, least recently used first (a read-only view)."""
        return MappingProxyType(self._groups)

    # ----------------------------------------------------------------- lookup
    def _best_in(
        self, index: SequenceIndex, context: Sequence[int], k: int, source: int, best: tuple[int, ...] | None
    ) -> tuple[tuple[int, ...] | None, list[int]]:
        """Best match of ``context``'s suffix in ``index``: (key, continuation), or (best, [])."""
        n = self.min_match
        ends = index.ends.get(tuple(context[-n:]))
        if not ends:
            return best, []
        toks = index.tokens
        limit = min(self.max_match, len(context))
        found: list[int] = []
        for end in reversed(ends[-self.max_candidates :]):
            if end >= len(toks):
                continue  # nothing follows (e.g. the row's own current suffix)
            length = n
            while length < limit and end - length - 1 >= 0 and toks[end - length - 1] == context[-length - 1]:
                length += 1
            cont = min(k, len(toks) - end)
            key = (length, cont, source, end)
            if best is None or key > best:
                best, found = key, toks[end : end + k]
        return best, found

    def propose(
        self,
        context: Sequence[int],
        k: int,
        *,
        group: Hashable | None = None,
        row_id: Hashable | None = None,
        prompt_len: int | None = None,
    ) -> list[int]:
        """Draft up to ``k`` tokens continuing ``context``.

        Args:
            context: the row's tokens so far, prompt included (``prompt + completion``).
            k: most tokens to propose (>= 0).
            group: the prompt group key (e.g. the prompt's index in the batch, or a hash of its
                ids); ``None`` searches ``context`` alone (builds a throwaway index: O(len)).
            row_id: the row within the group (e.g. its slot). With ``group``, the row's completion
                ``context[prompt_len:]`` is registered (`update_group`) before the lookup.
            prompt_len: length of the prompt inside ``context``; with ``group``, registers the
                prompt on first sight (`set_prompt`). ``None``: 0 with a ``row_id``.

        Returns:
            0..k tokens: the continuation after the longest match (ties: the longer continuation,
            then the own row, siblings, finished rollouts, the prompt, then the most recent).
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k!r}")
        if prompt_len is not None and not 0 <= prompt_len <= len(context):
            raise ValueError(f"prompt_len must be in [0, len(context)={len(context)}], got {prompt_len!r}")
        if k == 0 or len(context) < self.min_match:
            return []
        if group is None:
            _, found = self._best_in(SequenceIndex(self.min_match, context), context, k, _OWN, None)
            return found
        entry = self._group(group)
        start = prompt_len or 0
        if prompt_len is not None and entry.prompt is None:
            entry.prompt = SequenceIndex(self.min_match, context[:prompt_len])
        if row_id is not None:
            self.update_group(group, row_id, _Tail(context, start))
        best: tuple[int, ...] | None = None
        result: list[int] = []
        for rid, index in entry.rows.items():
            best, found = self._best_in(index, context, k, _OWN if rid == row_id else _SIBLING, best)
            result = found or result
        for index in entry.finished:
            best, found = self._best_in(index, context, k, _FINISHED, best)
            result = found or result
        if entry.prompt is not None:
            best, found = self._best_in(entry.prompt, context, k, _PROMPT, best)
            result = found or result
        return list(result)

    def propose_batch(
        self,
        contexts: Sequence[Sequence[int]],
        k: int,
        *,
        groups: Sequence[Hashable | None] | None = None,
        row_ids: Sequence[Hashable | None] | None = None,
        prompt_lens: Sequence[int | None] | None = None,
    ) -> list[list[int]]:
        """`propose` for each row; pack the result with `DraftProposal.from_lists(drafts, k)`."""
        rows = len(contexts)
        for name, values in (("groups", groups), ("row_ids", row_ids), ("prompt_lens", prompt_lens)):
            if values is not None and len(values) != rows:
                raise ValueError(f"{name} must have one entry per context ({rows}), got {len(values)}")
        return [
            self.propose(
                contexts[i],
                k,
                group=None if groups is None else groups[i],
                row_id=None if row_ids is None else row_ids[i],
                prompt_len=None if prompt_lens is None else prompt_lens[i],
            )
            for i in range(rows)
        ]

    def draft_rows(
        self,
        contexts: Sequence[Sequence[int]],
        k: int,
        sampling: Any,
        generator: torch.Generator | None,
        device: torch.device,
        rows: Sequence[DraftRow],
    ) -> DraftProposal:
        """`propose_batch` over the rows' groups, packed as a deterministic `DraftProposal` (the
        engine's host-drafter call; ``sampling`` and ``generator`` are not used: lookups are greedy)."""
        drafts = self.propose_batch(
            contexts, k, groups=[r.group for r in rows], row_ids=[r.row_id for r in rows],
            prompt_lens=[r.prompt_len for r in rows],
        )  # fmt: skip
        return DraftProposal.from_lists(drafts, k, device=device)

    # ----------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict[str, Any]:
        """The remembered prompts and finished rollouts per group (rows in flight are not saved)."""
        return {
            "config": {
                "max_match": self.max_match,
                "min_match": self.min_match,
                "max_recent": self.max_recent,
                "max_candidates": self.max_candidates,
                "max_groups": self.max_groups,
            },
            "groups": [
                (
                    key,
                    None if g.prompt is None else list(g.prompt.tokens),
                    [list(f.tokens) for f in g.finished],
                )
                for key, g in self._groups.items()
            ],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore `state_dict` (re-indexing the remembered sequences with this drafter's settings)."""
        self.clear()
        for key, prompt, finished in state_dict["groups"]:
            if prompt is not None:
                self.set_prompt(key, prompt)
            for tokens in finished:
                self.add_finished(key, tokens)
