"""`DrafterHosting`: the engine's drafter, as the `lightning_tlt.core.types.DrafterHost` contract sees it.

What speculation drafts with (`engine.drafter`), its publication (`set_drafter`: finite-checked,
weights copied in place where the layout matches, so captured graphs stay valid), the staging of
an EAGLE drafter that takes over later (`stage_drafter`), and what the engine learned about
speculating (`adaptive_state_dict`). Drafters are told apart by what they declare
(`lightning_tlt.drafters.base.capability`), never by their type.
"""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch

from lightning_tlt.drafters.base import Drafter, capability
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.rollout.engine_state import EngineState
from lightning_tlt.rollout.spec_step import eagle_handle


class DrafterHosting(EngineState):
    """The drafter part of the engine (see the module's docstring)."""

    def draft_vocab_ids(self) -> torch.Tensor | None:
        """The token ids an EAGLE drafter drafts from in the next ``generate`` (``(Vd,)`` long, on the
        CPU), or ``None`` when it drafts from the whole vocabulary (`SpeculativeConfig.draft_vocab_size`)."""
        return None if self._vocab.full else self._vocab.ids()

    # ------------------------------------------------------------------ the drafter
    @property
    def drafter(self) -> Drafter | None:
        """What speculation drafts with (`SuffixDrafter`, a frozen `EagleDrafter`, ...), or ``None``.

        Assigning replaces it (the graphs captured for the old one are freed); `set_drafter`
        publishes new weights, in place where it can.
        """
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        if drafter is self._drafter:
            return
        self._drafter = drafter
        if self._staged is not None and drafter is self._staged[0]:
            self._drafter_handle, self._staged = self._staged[1], None  # its graphs are kept: captured already
        else:
            self._handles += 1
            self._drafter_handle = self._handles
        if self._graphs is not None:
            keep = {self._drafter_handle, *(() if self._staged is None else (self._staged[1],))}
            self._graphs.drop(lambda profile: profile.phase == "spec" and eagle_handle(profile) not in keep)

    def stage_drafter(self, drafter: EagleDrafter) -> None:
        """Get ready for an EAGLE drafter that `set_drafter` will publish later.

        While a model-free drafter speculates (TLT's cold start: the suffix drafter until the EAGLE
        drafter's acceptance beats it), the engine keeps a frozen copy of ``drafter`` under a graph
        handle of its own; publishing copies the weights into that copy, so the graphs captured for
        it stay valid across every later publication. Nothing drafts with it until then. Its step
        functions are compiled (once, for every batch bucket and draft length) at the first
        speculative step of the drafter it will take over from, so that its hand-over, typically an
        RL step or two later, compiles nothing; no graph is captured for it ahead of use: each
        profile is captured when first met.

        Args:
            drafter: the drafter to be published (a training drafter is copied, never held).
        """
        if not capability(drafter, "runs_on_device"):
            raise TypeError(f"stage_drafter takes an EagleDrafter, got {type(drafter).__name__}")
        if not self._spec_on or self._drafter_on_device():
            return  # nothing speculates, or publishing copies into the current EAGLE drafter in place
        if tuple(drafter.feature_layers or ()) != self._capture_layers():
            return  # an EAGLE-3 drafter needs other feature buffers: its hand-over rebuilds them anyway
        if self._needs_copy(drafter):
            drafter = self._frozen_copy(drafter)
        self._handles += 1
        self._staged = (drafter, self._handles)
        self._staged_compiled = False

    def set_drafter(self, drafter: Drafter | None, version: int | None = None) -> bool:
        """Publish ``drafter`` to the engine; returns whether it was taken.

        An `EagleDrafter` whose weights are not all finite is refused with a warning (the engine
        keeps drafting with what it has: a diverged co-trained drafter never reaches a rollout).
        When the engine already drafts with an `EagleDrafter` of the same layout, the weights are
        copied into it in place (captured graphs stay valid); when one of the same layout was
        staged (`stage_drafter`), they are copied into that and it takes over, graphs and all;
        otherwise the engine takes a frozen `EagleDrafter.inference_copy` (or ``drafter`` itself
        when it is frozen already, or not an EAGLE drafter).

        Args:
            drafter: the drafter (a training `EagleDrafter` is copied, never held).
            version: the version to record; ``None`` advances `drafter_version` by one.
        """
        if drafter is not None and capability(drafter, "runs_on_device"):
            drafter = cast(EagleDrafter, drafter)  # the one device drafter: weights published in place
            bad = [name for name, t in drafter.state_dict().items() if not bool(torch.isfinite(t).all())]
            if bad:
                warnings.warn(
                    f"refusing to publish a drafter with non-finite weights ({', '.join(bad[:3])}"
                    f"{', ...' if len(bad) > 3 else ''}); the engine keeps drafter version {self.drafter_version}",
                    stacklevel=2,
                )
                return False
            current, staged = self._drafter, None if self._staged is None else self._staged[0]
            if self._drafter_on_device() and current is not drafter and cast(EagleDrafter, current).same_layout(drafter):
                cast(EagleDrafter, current).copy_weights_from(drafter)
            elif staged is not None and staged is not drafter and staged.same_layout(drafter):
                staged.copy_weights_from(drafter)
                self.drafter = staged
            elif self._needs_copy(drafter):
                self.drafter = self._frozen_copy(drafter)
            else:
                self.drafter = drafter
        else:
            self.drafter = drafter
        self.drafter_version = self.drafter_version + 1 if version is None else int(version)
        return True

    @property
    def drafter_handle(self) -> int:
        """The current drafter's graph handle: a new one whenever the drafter object is replaced."""
        return self._drafter_handle

    @property
    def staged_drafter(self) -> EagleDrafter | None:
        """The frozen copy `stage_drafter` holds for a later hand-over (``None``: nothing staged)."""
        return None if self._staged is None else self._staged[0]

    def _needs_copy(self, drafter: EagleDrafter) -> bool:
        """Whether the engine drafts with a frozen copy of ``drafter`` rather than the object itself: one in
        training (never held), or one that reads another model's embedding than the one decoded (a co-trained
        drafter built over the float32 master weights, where the engine decodes a bf16 copy). The copy reads
        the decoded model's embedding and head: the drafts embed tokens as decoding does, and the compiled
        drafter steps see the embedding a background compile's child sees (its float32 master's made
        the parent compile the catch-up and chained row again, 11.7 s on the H100)."""
        decoded = self._decoded_model()
        return any(p.requires_grad for p in drafter.parameters()) or (decoded is not None and not drafter.shares(decoded))

    def _frozen_copy(self, drafter: EagleDrafter) -> EagleDrafter:
        """`_needs_copy`'s copy: frozen, in the engine's dtype, over the decoded model's embedding and head."""
        return drafter.inference_copy(self.dtype, target=self._decoded_model())

    def _decoded_model(self) -> Any:
        """The HF model the engine's compiled steps decode from, ``None`` for an engine without them."""
        return self._hf if self._runner is not None else None

    def _drafter_on_device(self) -> bool:
        """Whether the current drafter runs inside the step's graph (an EAGLE drafter), not on the host."""
        return self._drafter is not None and bool(capability(self._drafter, "runs_on_device"))

    # ------------------------------------------------------------------ adaptive state
    def adaptive_state_dict(self) -> dict[str, Any]:
        """What the engine learned about speculating (gate, tuner, draft vocabulary), for checkpoints."""
        if not self._spec_on:
            return {}
        return {
            "gate": None if self._gate is None else self._gate.state_dict(),
            "tuner": None if self._tuner is None else self._tuner.state_dict(),
            "draft_vocab": self._vocab.state_dict(),
        }

    def load_adaptive_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `adaptive_state_dict` returned."""
        if not state_dict or not self._spec_on:
            return
        if state_dict.get("gate") is not None and self._gate is not None:
            self._gate.load_state_dict(state_dict["gate"])
        if state_dict.get("tuner") is not None and self._tuner is not None:
            self._tuner.load_state_dict(state_dict["tuner"])
        if state_dict.get("draft_vocab") is not None:
            self._vocab.load_state_dict(state_dict["draft_vocab"])
