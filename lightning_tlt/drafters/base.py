"""What every drafter shares, and the proposal a drafter hands to verification.

The two drafters are driven differently, and the protocol does not pretend otherwise:

- `lightning_tlt.drafters.suffix.SuffixDrafter` is model-free and host-side: the engine calls its
  ``draft_rows(...)`` with each row's tokens and prompt group, which looks them up
  (``propose_batch``) and packs the lists with `DraftProposal.from_lists` (deterministic drafts,
  ``probs=None``).
- `lightning_tlt.drafters.eagle.EagleDrafter` is an ``nn.Module`` over the policy's hidden states;
  the engine runs its decoder layer itself (with its own KV cache and CUDA graphs), chaining k
  draft steps, and builds the `DraftProposal` from the sampled tokens and their processed
  probabilities.

Either way verification is `lightning_tlt.rollout.verify.verify_chain(proposal.tokens,
proposal.probs, target_probs, proposal.lens, generator)`.

Each drafter answers for itself: besides the `Drafter` protocol's members, an engine asks a drafter
for its optional capabilities (`DrafterBase` lists them with their defaults) through `capability`,
the one place where a drafter that does not declare one gets its default. A user's host drafter
with nothing but ``draft(contexts, k, sampling, generator, device) -> DraftProposal`` keeps
working: it runs on the host, reads no features and remembers nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Drafter(Protocol):
    """A source of drafted tokens for speculative rollouts.

    Attributes:
        name: the `lightning_tlt.core.types.SpeculativeConfig.method` it serves ("eagle", "suffix").
        needs_features: whether it reads the policy's hidden states (then the engine must keep the
            policy's last hidden state of each row's newest token).
    """

    name: str
    needs_features: bool

    def state_dict(self) -> Mapping[str, Any]:
        """What it learned (weights, or remembered rollouts), for checkpoints."""
        ...

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> Any:
        """Restore what `state_dict` returned."""
        ...


@dataclass(frozen=True)
class DraftRow:
    """What an engine tells a host drafter about one row it drafts for."""

    group: Hashable
    """The row's prompt group: its prompt (siblings, samples of one prompt, share it)."""
    row_id: Hashable
    """The row's identity, unique within the engine's lifetime (`DrafterBase.finish_row` names it)."""
    prompt_len: int
    """Tokens of the row's context that are its prompt."""


class DrafterBase:
    """The optional capabilities of a drafter, with their defaults: those of a host drafter.

    Subclassing is optional: `capability` gives a drafter that lacks one of these members the
    default below (bound to the drafter, for methods).

    Attributes:
        runs_on_device: ``True``: the engine runs the drafter inside the step's graph, over the
            policy's features and its own KV cache (an `lightning_tlt.drafters.eagle.EagleDrafter`,
            whose weights are published in place and can be staged); ``False``: a host drafter, whose
            `draft_rows` the engine calls with each row's tokens before every speculative step.
        feature_layers: HF ``hidden_states`` indices it reads (EAGLE-3), ``None``: the last hidden state.
    """

    name: str = "custom"
    needs_features: bool = False
    runs_on_device: bool = False
    feature_layers: Sequence[int] | None = None

    def draft_rows(
        self,
        contexts: Sequence[Sequence[int]],
        k: int,
        sampling: Any,
        generator: torch.Generator | None,
        device: torch.device,
        rows: Sequence[DraftRow],
    ) -> DraftProposal:
        """A host drafter's drafts for ``contexts`` (each row's tokens so far), ``k`` a row.

        The default calls ``self.draft(contexts, k, sampling, generator, device)`` (the host-drafter
        contract that predates ``rows``); a drafter that uses the rows' groups overrides it.

        Args:
            sampling: the call's `lightning_tlt.core.types.SamplingConfig` (temperature, top-k, top-p).
            rows: one `DraftRow` per context.
        """
        draft = getattr(self, "draft", None)
        if draft is None:
            raise TypeError(f"{type(self).__name__} is a host drafter without draft(...) or draft_rows(...)")
        proposal: DraftProposal = draft(contexts, k, sampling, generator, device)
        return proposal

    def finish_row(self, group: Hashable, row_id: Hashable) -> None:
        """Row ``row_id`` of ``group`` ended; a drafter that remembers rollouts (for the row's siblings)
        keeps it. The default remembers nothing."""


def capability(drafter: object, name: str) -> Any:
    """``drafter``'s own ``name`` (a `DrafterBase` member), or `DrafterBase`'s default, bound to it.

    The one place where the optional capabilities get their defaults: an engine never tells drafters
    apart by their type, it asks them.
    """
    if hasattr(drafter, name):
        return getattr(drafter, name)
    default = getattr(DrafterBase, name)
    return default.__get__(drafter) if callable(default) else default


@dataclass
class DraftProposal:
    """Drafted tokens for a batch of rows, in the static shape verification takes."""

    tokens: Tensor
    """``(B, k)`` long: drafted tokens; positions at or past a row's length hold ``pad_token_id``."""
    probs: Tensor | None
    """``(B, k, V)`` float: the processed distributions the tokens were sampled from, or ``None`` for
    deterministic drafts (``q`` one-hot)."""
    lens: Tensor
    """``(B,)`` long: valid drafts per row, in ``[0, k]``."""

    def __post_init__(self) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"tokens must be (B, k), got shape {tuple(self.tokens.shape)}")
        bsz, k = self.tokens.shape
        if self.lens.shape != (bsz,):
            raise ValueError(f"lens must be (B,) = ({bsz},), got shape {tuple(self.lens.shape)}")
        if self.probs is not None and (self.probs.dim() != 3 or self.probs.shape[:2] != (bsz, k)):
            raise ValueError(
                f"probs must be (B, k, V) = ({bsz}, {k}, V) or None, got {tuple(self.probs.shape)}"
            )

    @property
    def num_draft_tokens(self) -> int:
        """k, the static number of draft positions."""
        return self.tokens.shape[1]

    @classmethod
    def from_lists(
        cls,
        drafts: Sequence[Sequence[int]],
        k: int,
        *,
        device: torch.device | str | None = None,
        pad_token_id: int = 0,
    ) -> DraftProposal:
        """Pack per-row host-side drafts (each of 0..k tokens) into a deterministic proposal.

        Args:
            drafts: one list of drafted tokens per row, at most ``k`` each.
            k: the static draft length (the verify forward's width minus one).
            device: where the tensors go (one host-to-device copy per tensor).
            pad_token_id: token written past each row's drafts (must be a valid id).
        """
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k!r}")
        too_long = [len(d) for d in drafts if len(d) > k]
        if too_long:
            raise ValueError(f"each draft must have at most k={k} tokens, got lengths {too_long}")
        rows = [list(d) + [pad_token_id] * (k - len(d)) for d in drafts]
        tokens = torch.tensor(rows, dtype=torch.long).view(len(rows), k)
        lens = torch.tensor([len(d) for d in drafts], dtype=torch.long)
        if device is not None:
            tokens, lens = tokens.to(device, non_blocking=True), lens.to(device, non_blocking=True)
        return cls(tokens=tokens, probs=None, lens=lens)
