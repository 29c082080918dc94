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

**A sharded policy** (FSDP2 ``fully_shard`` under Lightning's ``ModelParallelStrategy``,
`lightning_tlt.rl.fsdp`): each rank holds a slice of every parameter, which the engine cannot read in
place. The copy is then built empty, whole, in ``dtype`` from the policy's config (on the meta device
first: nothing is allocated twice), and `sync` gathers the policy into it one parameter at a time
(`gathered_parameters`: at most one layer's matrix, or the embedding, is ever held whole in the
policy's dtype, and it is freed once cast into the copy): never a second full float32 copy. Every rank
gathers (the gather is a collective, once per ``generate``, on every rank together). The gather's wall
time, bytes and memory are in `InferenceCopy.stats` (the engine adds them to the call's statistics,
logged as ``rollout/gather_*``).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tlt.core.runner import unwrap_model
from lightning_tlt.core.sharding import is_dtensor, is_sharded, param_device, unsharded_class
from lightning_tlt.core.types import DTYPES

__all__ = ["InferenceCopy", "empty_replica", "gathered_parameters", "resolve_dtype"]


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """``dtype`` as a `torch.dtype` (the names of `lightning_tlt.core.types.DTYPES` accepted);
    ``None`` stays ``None``."""
    if dtype is None:
        return None
    resolved = DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPES.values():
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} (or None: the policy's), got {dtype!r}")
    return resolved


def gathered_parameters(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """``(name, whole tensor)`` for each parameter of ``model`` (tied ones once), one at a time.

    A sharded parameter (``DTensor``) is gathered across the ranks (a collective: every rank must
    iterate, in the same order) and cast to ``dtype``; a plain one passes through (cast). Each whole
    tensor is the caller's to drop before asking for the next, so at most one is held at a time: the
    layer-by-layer gather behind `InferenceCopy` and the vLLM push of a sharded policy.
    """
    for name, param in unwrap_model(model).named_parameters():
        whole = param.detach().full_tensor() if is_dtensor(param) else param.detach()
        if dtype is not None:
            whole = whole.to(dtype)
        yield name, whole
        del whole  # before the next piece is gathered (the caller drops its reference too)


def empty_replica(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """An unsharded, frozen, eval-mode replica of a sharded HF model: parameters whole, in ``dtype``,
    allocated but not filled (`InferenceCopy.sync` fills them); buffers copied as they are.

    Built from the model's config on the meta device (no weight is initialised, nothing is allocated
    twice), its parameters then made whole-sized on the device of this rank's shards; tied parameters
    stay tied (one tensor under both names, as in the policy).
    """
    source: Any = unwrap_model(model)
    cls = unsharded_class(source)
    config = getattr(source, "config", None)
    if config is None or not hasattr(cls, "_from_config"):
        raise TypeError(
            f"a sharded policy is rolled out from an unsharded replica built from its HF config; "
            f"{cls.__name__} is not an HF PreTrainedModel"
        )
    with torch.device("meta"):
        replica: Any = cls._from_config(copy.deepcopy(config))
    if getattr(source, "generation_config", None) is not None:
        replica.generation_config = copy.deepcopy(source.generation_config)
    made: dict[int, nn.Parameter] = {}  # by the source parameter: tied ones map to one new tensor
    mine = dict(replica.named_modules())
    for module_name, module in source.named_modules():
        target = mine.get(module_name)
        if target is None:
            raise RuntimeError(f"the replica of {cls.__name__} has no module {module_name!r}")  # not expected
        for leaf, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in made:
                empty = torch.empty(param.shape, dtype=dtype, device=param_device(param))
                made[id(param)] = nn.Parameter(empty, requires_grad=False)
            target._parameters[leaf] = made[id(param)]
        for leaf, buffer in module._buffers.items():
            if buffer is not None:
                whole = buffer.full_tensor() if is_dtensor(buffer) else buffer
                target._buffers[leaf] = whole.detach().clone()
        for attr, value in vars(module).items():  # plain tensor attributes (HF RoPE's original_inv_freq)
            if isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
                setattr(target, attr, value.detach().clone())
    left = [n for n, t in [*replica.named_parameters(), *replica.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the replica of {cls.__name__} has tensors the policy does not: {left[:3]}")
    return replica.eval()


class InferenceCopy:
    """A frozen copy of an HF model's parameters in ``dtype`` (see the module docstring).

    Args:
        model: the policy (DDP-style wrappers unwrapped; FSDP2-sharded or not); read, never changed.
        dtype: the copy's parameter dtype.
    """

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        source: Any = unwrap_model(model)
        self.sharded = is_sharded(source)
        """Whether the policy is sharded (then `sync` gathers it, a collective on every rank)."""
        if self.sharded:
            self.module: Any = empty_replica(source, dtype)
        else:
            # the new parameters in place of the old in the deep copy: no float32 duplicate on the way
            memo: dict[int, Any] = {
                id(p): nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in source.parameters()
            }
            self.module = copy.deepcopy(source, memo).eval()
        self.dtype = dtype
        names = [name for name, _ in source.named_parameters()]
        if names != [name for name, _ in self.module.named_parameters()]:
            raise RuntimeError("the inference copy's parameters do not mirror the policy's")  # not expected
        # the same Parameter objects for the copy's life (`nn.Module.to` replaces their data, not them)
        self._copies: list[Tensor] = list(self.module.parameters())
        self._sources: list[Tensor] = list(source.parameters())
        self._source = source
        self.stats: dict[str, float] = {}
        """The last gather of a sharded policy: ``gather/time_s`` (wall, the device synchronised),
        ``gather/bytes`` (written into the copy), ``gather/buffer_bytes`` (the largest piece held
        whole, in the policy's dtype) and, on CUDA, ``gather/peak_bytes`` (the allocator's peak above
        what was allocated before: the gather's own memory). Empty for an unsharded policy."""

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._copies)

    @torch.no_grad()
    def sync(self) -> None:
        """Cast the policy's current weights into the copy, in place (following it to its device first;
        gathering them one parameter at a time when the policy is sharded)."""
        if self.sharded:
            self._gather()
            return
        if self._copies[0].device != self._sources[0].device:
            self.module.to(self._sources[0].device)
        torch._foreach_copy_(self._copies, self._sources)

    def _gather(self) -> None:
        device = self._copies[0].device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)  # the gather's peak is read from the allocator's
            before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        largest = 0
        targets = dict(self.module.named_parameters())
        # the policy's own parameters each time: FSDP2 swaps the module's attributes while unsharded
        for name, whole in gathered_parameters(self._source):
            largest = max(largest, whole.numel() * whole.element_size())
            targets[name].copy_(whole)
            del whole  # freed before the next piece is gathered
        if cuda:
            torch.cuda.synchronize(device)
        self.stats = {
            "gather/time_s": time.perf_counter() - start,
            "gather/bytes": float(self.nbytes),
            "gather/buffer_bytes": float(largest),
        }
        if cuda:
            self.stats["gather/peak_bytes"] = float(torch.cuda.max_memory_allocated(device) - before)
