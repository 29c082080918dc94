"""The RL modules under Lightning's FSDP: ``ModelParallelStrategy`` with FSDP2's ``fully_shard``.

Why this strategy and not ``FSDPStrategy``: FSDP2 shards each parameter on its own (a ``DTensor``,
``Shard(0)`` over the data-parallel ranks), so a layer's weights can be gathered one tensor at a time
into the engine's inference copy (`lightning_tlt.rollout.inference_copy`) and its sharded checkpoint
is Lightning's distributed checkpoint (``torch.distributed.checkpoint``); FSDP1 (``FSDPStrategy``)
flattens a unit's parameters into one ``FlatParameter``, is deprecated by torch in favour of
``fully_shard``, and Lightning 2.6 refuses it on the CPU (``accelerator="cpu"``), where
``ModelParallelStrategy`` runs over gloo: the two-process tests of this kit run on it.

`RLModule.configure_model` (`lightning_tlt.rl.common`) calls `shard_modules` the Lightning way: under
``ModelParallelStrategy`` once the device mesh exists, before the optimizer is made. Each decoder layer is
one FSDP unit (gathered for its forward and backward, then freed), the rest of the model (the
embedding, the final norm, the LM head, tied or not) the root unit. Parameters stay in their dtype:
``bf16-mixed`` autocasts the forward as it does unsharded (float32 all-gathers and gradient
reduce-scatters), so a sharded step computes what an unsharded one does.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch import nn

from lightning_tlt.core.runner import unwrap_model
from lightning_tlt.core.sharding import is_dtensor, is_sharded

__all__ = [
    "STRATEGY_HINT",
    "check_sharded_training",
    "check_strategy",
    "checkpoint_layers",
    "shard_module",
    "sharded_strategy",
]

STRATEGY_HINT = (
    "strategy: {class_path: lightning.pytorch.strategies.ModelParallelStrategy, "
    "init_args: {data_parallel_size: <devices x nodes>, tensor_parallel_size: 1}}"
)
"""What a config names to shard the policy (the YAML of `configs/grpo_gpu_0.5b_fsdp.yaml`)."""


def sharded_strategy(trainer: pl.Trainer | None) -> bool:
    """Whether ``trainer`` shards the RL module's models (``ModelParallelStrategy``)."""
    return trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy)


def check_strategy(trainer: pl.Trainer) -> Any:
    """The data-parallel device mesh to shard over, or ``None`` when the strategy does not shard.

    Raises:
        ValueError: ``FSDPStrategy`` (FSDP1), or a ``ModelParallelStrategy`` with tensor parallelism;
            the message says what to write instead.
    """
    strategy = trainer.strategy
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "the RL modules shard the policy with FSDP2 (fully_shard) under Lightning's ModelParallelStrategy, "
            f"not FSDPStrategy (FSDP1, one FlatParameter per unit, which the rollout engine's gather cannot read "
            f"parameter by parameter); use {STRATEGY_HINT}"
        )
    if not isinstance(strategy, ModelParallelStrategy):
        return None
    mesh = strategy.device_mesh
    tensor_parallel = int(mesh["tensor_parallel"].size())
    if tensor_parallel != 1:
        raise ValueError(
            f"ModelParallelStrategy with tensor_parallel_size={tensor_parallel}: the RL modules shard the policy over "
            f"data-parallel ranks only (FSDP); its default 'auto' puts every device of a node into tensor "
            f"parallelism. Use {STRATEGY_HINT}"
        )
    return mesh["data_parallel"]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """An HF causal LM's decoder layers (``model.layers``), or ``[]`` when it has none there."""
    inner = getattr(unwrap_model(model), "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if isinstance(layers, nn.ModuleList) else []


def checkpoint_layers(module: nn.Module) -> int:
    """Activation checkpointing of ``module``'s decoder layers, in place: each layer's forward keeps only its
    inputs for the backward, which runs the layer again (``torch.distributed._composable.checkpoint``,
    non-reentrant: no module is wrapped, so parameter names, state dicts and checkpoints stay as they are,
    and FSDP2's ``fully_shard`` composes with it, gathering the layer again for the recompute).

    The training forward's activations then hold one hidden state per layer instead of every layer's working
    set (the 0.5 B policy at 16,384 micro-batch tokens, by `benchmarks/memory_model.py`: about 1.4 GiB, the
    hidden states and one layer recomputing, against 17 GiB), for one more forward of each layer. Only the
    training forward pays: the rollout engine reads the layers' weights, never their ``forward``. A layer
    checkpointed already (torch's own record, ``checkpoint.state``) is left as it is (``configure_model``
    may run again; torch refuses a second ``checkpoint``). The recompute runs under the SDPA kernels its
    forward ran under (`lightning_tlt.rl.attention.same_attention_contexts`).

    Returns:
        the number of layers newly checkpointed.
    """
    from torch.distributed._composable import checkpoint

    from lightning_tlt.rl.attention import same_attention_contexts

    done = 0
    for layer in decoder_layers(module):
        if checkpoint.state(layer) is None:
            checkpoint(layer, context_fn=same_attention_contexts)
            done += 1
    return done


def shard_module(module: nn.Module, mesh: Any) -> nn.Module:
    """Shard ``module`` over ``mesh`` with FSDP2, in place: each decoder layer one unit, the rest the root.

    A module that is sharded already is left as it is (``configure_model`` may run again, e.g. for
    ``validate`` after ``fit``). Frozen modules (a reference model) are sharded the same way: their
    forward gathers a layer at a time too.

    Args:
        module: an HF causal LM, or any module (then one unit).
        mesh: the one-dimensional data-parallel device mesh (`check_strategy`).
    """
    from torch.distributed.fsdp import fully_shard

    if is_sharded(module):
        return module
    for layer in decoder_layers(module):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def check_sharded_training(trainable: list[nn.Parameter], module: nn.Module) -> None:
    """Refuse a trainable parameter left unsharded: nothing would average its gradient across ranks
    (``ModelParallelStrategy`` has no DDP), so the ranks' copies would drift apart.

    Raises:
        ValueError: naming the first such parameter.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    plain = [names.get(id(p), "?") for p in trainable if not is_dtensor(p)]
    if plain:
        raise ValueError(
            f"{len(plain)} trainable parameters are not sharded (first: {plain[0]!r}): under ModelParallelStrategy "
            "nothing averages their gradients across ranks; shard the module that holds them in configure_model "
            "(RLModule.models_to_shard) or freeze them"
        )
