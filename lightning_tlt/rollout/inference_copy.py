"""`InferenceCopy`: the policy's weights in the rollout dtype, refreshed in place before every ``generate``.

RL with float32 master weights (Lightning's ``bf16-mixed``) keeps the policy's parameters in float32,
and an engine that reads them decodes in float32: twice the bytes of every weight read, in a loop
that is bound by them. Training the weights in bf16 instead does not work at RL's learning rates:
an AdamW step of 1e-5 is below half a bf16 unit of any weight above about 2.6e-3 in magnitude, so
most weights never move (measured: 15 % of a 0.02-scale matrix changed at all over 10 steps, no norm
weight did). The 0.5 B end-to-end run on the H200 trained that way, and its correctness curves did
not move in 20 steps.

This is the split RL frameworks make (verl's float32 FSDP weights synced into a bf16 vLLM): the
engine keeps its own copy of the parameters in ``dtype`` (buffers as they are: RoPE frequencies stay
float32), built once (never a second float32 copy on the way), and `sync` casts the policy's
current weights into it in place before each call, one pass over the weights. The copy's
tensors keep their addresses (captured CUDA graphs stay valid); when the policy has moved to another
device, the copy follows it first.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tlt.core.runner import unwrap_model
from lightning_tlt.core.types import DTYPES

__all__ = ["InferenceCopy", "resolve_dtype"]


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a `torch.dtype` (the names of `lightning_tlt.core.types.DTYPES` accepted);
    ``None`` stays ``None``."""
    if dtype is None:
        return None
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (or None: the policy's), got {dtype!r}")
    return resolved


class InferenceCopy:
    """A frozen copy of an HF model's parameters in ``dtype`` (see the module docstring).

    Args:
        model: the policy (DDP-style wrappers unwrapped); read, never changed.
        dtype: the copy's parameter dtype.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        source: Any = unwrap_model(model)
        # the new parameters in place of the old in the deep copy: no float32 duplicate on the way
        memo: dict[int, Any] = {
            id(p): nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in source.parameters()
        }
        self.module: Any = copy.deepcopy(source, memo).eval()
        self.dtype = dtype
        names = [name for name, _ in source.named_parameters()]
        if names != [name for name, _ in self.module.named_parameters()]:
            raise RuntimeError("the inference copy's parameters do not mirror the policy's")  # not expected
        # the same Parameter objects for the copy's life (`nn.Module.to` replaces their data, not them)
        self._copies: list[Tensor] = list(self.module.parameters())
        self._sources: list[Tensor] = list(source.parameters())

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._copies)

    @torch.no_grad()
    def sync(self) -> None:
        """Cast the policy's current weights into the copy, in place (following it to its device first)."""
        if self._copies[0].device != self._sources[0].device:
            self.module.to(self._sources[0].device)
        torch._foreach_copy_(self._copies, self._sources)
