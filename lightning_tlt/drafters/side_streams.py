"""Side streams of a number of SMs: CUDA green contexts, one per device and SM count, kept for the process.

The co-trained drafter's steps run on a side stream beside decoding
(`lightning_tlt.drafters.trainer.DrafterTrainer`); with ``DrafterTrainConfig.side_stream_sms`` that
stream belongs to a green context (`torch.cuda.green_contexts`) of that many SMs, so drafter work cannot
take the SMs decode needs. Contexts are shared by every trainer of the process and never destroyed.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_tlt.core.streams import EXCLUSIVE_STREAMS


class GreenContexts:
    """CUDA green contexts by (device index, SMs), each created on first use and never destroyed: memory
    the caching allocator keeps for its streams outlives any trainer (freeing it into a destroyed context
    aborts the process, seen on the H200)."""

    def __init__(self) -> None:
        self._contexts: dict[tuple[int, int], Any] = {}

    def stream(self, device: torch.device, sms: int | None, owner: object | None = None) -> Any:
        """A new stream on ``device``: of the green context of ``sms`` SMs (one per device and count), or
        of the whole device (``None``: a pool stream no graph group or other drafter shares, held while
        ``owner`` lives; see `lightning_tlt.core.streams`)."""
        if sms is None:
            return EXCLUSIVE_STREAMS.acquire(device, "a drafter's side stream", owner=owner)
        from torch.cuda import green_contexts

        total = torch.cuda.get_device_properties(device).multi_processor_count
        if sms > total:
            raise ValueError(f"side_stream_sms must be at most the device's {total} SMs, got {sms}")
        if not getattr(green_contexts, "SUPPORTED", False):
            raise RuntimeError(f"side_stream_sms={sms} needs CUDA green contexts, which this torch "
                               f"({torch.__version__}) was not built with; leave it None")  # fmt: skip
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, sms)
        if key not in self._contexts:
            self._contexts[key] = green_contexts.GreenContext.create(num_sms=sms, device_id=index)
        return self._contexts[key].Stream()


GREEN_CONTEXTS = GreenContexts()
"""The process's green contexts (the side streams of `DrafterTrainConfig.side_stream_sms` SMs)."""
