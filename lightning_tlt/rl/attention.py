"""The SDPA kernels a training forward may use (GRPO, PPO, the SFT warm start).

cuDNN's SDPA backward returns NaN query gradients on H100/H200 since torch 2.11 when a mask is
passed (every padded batch), the length is 64 past a multiple of 128 and a row's attention logits
are all very negative (pytorch/pytorch#196678; met through Qwen2.5-0.5B's attention sinks). The
training forwards therefore run without cuDNN's kernels unless asked
(`lightning_tlt.rl.config.OptimConfig.cudnn_attention`); the backward runs the kernel its forward
chose, so wrapping the forward is enough. The rollout engine's attention is its own.
"""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["training_attention"]


def training_attention(cudnn: bool = False) -> contextlib.AbstractContextManager[Any]:
    """The SDPA kernels a training forward may use: every backend but cuDNN's unless ``cudnn``
    (see `lightning_tlt.rl.config.OptimConfig.cudnn_attention`). The backward uses the kernel the
    forward chose, so wrapping the forward is enough."""
    if cudnn:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
