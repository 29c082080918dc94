"""The SDPA kernels a training forward may use (GRPO, PPO, the SFT warm start).

cuDNN's SDPA backward returns NaN query gradients on H100/H200 since torch 2.11 when a mask is
passed (every padded batch), the length is 64 past a multiple of 128 and a row's attention logits
are all very negative (pytorch/pytorch#196678; met through Qwen2.5-0.5B's attention sinks). The
training forwards therefore run without cuDNN's kernels unless asked
(`lightning_tlt.rl.config.OptimConfig.cudnn_attention`); the backward runs the kernel its forward
chose, so wrapping the forward is enough, except where the backward runs the forward again: a
checkpointed layer's recompute (`lightning_tlt.rl.fsdp.checkpoint_layers`) happens in the backward,
outside the forward's ``with``, so it restores the forward's kernels itself (`same_attention_contexts`).
The rollout engine's attention is its own.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["same_attention_contexts", "training_attention"]


def training_attention(cudnn: bool = False) -> contextlib.AbstractContextManager[Any]:
    """The SDPA kernels a training forward may use: every backend but cuDNN's unless ``cudnn``
    (see `lightning_tlt.rl.config.OptimConfig.cudnn_attention`). The backward uses the kernel the
    forward chose, so wrapping the forward is enough."""
    if cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _enabled_backends() -> list[Any]:
    """The SDPA backends enabled now (what an enclosing ``sdpa_kernel`` left on), in torch's own flags."""
    import torch
    from torch.nn.attention import SDPBackend

    flags = {
        SDPBackend.FLASH_ATTENTION: torch.backends.cuda.flash_sdp_enabled,
        SDPBackend.EFFICIENT_ATTENTION: torch.backends.cuda.mem_efficient_sdp_enabled,
        SDPBackend.CUDNN_ATTENTION: torch.backends.cuda.cudnn_sdp_enabled,
        SDPBackend.MATH: torch.backends.cuda.math_sdp_enabled,
    }
    return [backend for backend, enabled in flags.items() if enabled()]


def same_attention_contexts() -> tuple[contextlib.AbstractContextManager[Any], contextlib.AbstractContextManager[Any]]:
    """The ``context_fn`` of a non-reentrant checkpoint whose recompute must pick the SDPA kernel its forward
    picked: called at the forward, it returns no context for the forward and, for the recompute, the
    backends enabled at that forward (``training_attention``'s choice, or a user's ``sdpa_kernel``).

    Without it the recompute, run by the backward outside the forward's ``with``, may pick another kernel
    (on an H100 at 16,384 micro-batch tokens: cuDNN's, whose saved statistics differ in shape from
    flash's, so torch raised ``CheckpointError``; a kernel of the same shapes would have mixed two
    kernels' rounding into one gradient silently).
    """
    from torch.nn.attention import sdpa_kernel

    backends = _enabled_backends()
    return contextlib.nullcontext(), (sdpa_kernel(backends) if backends else contextlib.nullcontext())
