"""The one engine factory: the rollout backend a configuration names (``engine: native | vllm``).

Used by `lightning_tlt.data.datamodule.RolloutDataModule`, by TRL's ``rollout_func``
(`lightning_tlt.integrations.trl`) and by users: each backend takes the policy, ``max_seq_len`` and
``speculative``, and is a `lightning_tlt.core.types.RolloutBackend`.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from torch import nn

from lightning_tlt.core.types import RolloutBackend

__all__ = ["ENGINE_KINDS", "EngineKind", "make_engine"]

EngineKind = Literal["native", "vllm"]
ENGINE_KINDS: tuple[str, ...] = ("native", "vllm")


def make_engine(
    kind: EngineKind, model: nn.Module | str | os.PathLike[str], *, tokenizer: Any = None, **kwargs: Any
) -> RolloutBackend:
    """Build the rollout engine named by configuration.

    Args:
        kind: "native" (`lightning_tlt.rollout.engine.RolloutEngine`, in-process over the policy's
            own parameters) or "vllm" (`lightning_tlt.rollout.vllm_engine.VLLMRolloutEngine` on a
            colocated ``vllm.LLM``; vLLM is imported only then).
        model: the policy (a path is accepted by "vllm" only).
        tokenizer: the policy's tokenizer (needed by "vllm").
        **kwargs: the chosen engine's keyword arguments (both take ``max_seq_len``, ``max_batch_size``
            and ``speculative``).
    """
    if kind == "native":
        if not isinstance(model, nn.Module):
            raise ValueError(f"engine 'native' needs the policy module, got {type(model).__name__}")
        from lightning_tlt.rollout.engine import RolloutEngine

        return RolloutEngine(model, **kwargs)
    if kind == "vllm":
        from lightning_tlt.rollout.vllm_engine import VLLMRolloutEngine

        return VLLMRolloutEngine(model, tokenizer, **kwargs) if tokenizer is not None else VLLMRolloutEngine(model, **kwargs)
    raise ValueError(f"engine must be 'native' or 'vllm', got {kind!r}")
