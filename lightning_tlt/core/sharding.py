"""What every layer needs to know about a sharded policy: FSDP2's ``DTensor`` parameters.

Under Lightning's ``ModelParallelStrategy`` the policy is sharded with FSDP2's ``fully_shard``
(`lightning_tlt.rl.fsdp`): each parameter becomes a ``DTensor`` of which a rank holds one slice
(``Shard(0)``), and the module's class becomes a subclass of ``FSDPModule``. Code that reads
weights (the engine's inference copy, the vLLM push, the gradient norm, checksums) asks here
whether a module is sharded and how to see a tensor whole or locally; nothing here gathers
without being asked.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["is_dtensor", "is_sharded", "local_tensor", "param_device", "unsharded_class"]


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a sharded or replicated tensor of ``torch.distributed``)."""
    return isinstance(tensor, DTensor)


def is_sharded(module: nn.Module) -> bool:
    """Whether any parameter of ``module`` is a ``DTensor`` (FSDP2 ``fully_shard`` made it one)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's slice of a ``DTensor`` (a plain tensor passes through)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def unsharded_class(module: nn.Module) -> type[Any]:
    """The class ``module`` had before ``fully_shard`` (which swaps in ``FSDP<Name>``, a subclass of
    ``FSDPModule`` and of the original); the module's own class when it is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    cls: type[Any] = type(module)
    if not isinstance(module, FSDPModule):
        return cls
    for base in cls.__mro__[1:]:
        if not issubclass(base, FSDPModule):
            return base
    raise TypeError(f"{cls.__name__} has no class under its FSDPModule")  # not expected: fully_shard subclasses


def param_device(param: Tensor) -> torch.device:
    """Where this rank's part of ``param`` lives."""
    return local_tensor(param).device
