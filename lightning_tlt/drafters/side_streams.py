"""Side streams of a number of SMs: CUDA green contexts, one per device and SM count, kept for the process.

The co-trained drafter's steps run on a side stream beside decoding
(`lightning_tlt.drafters.trainer.DrafterTrainer`); with ``DrafterTrainConfig.side_stream_sms`` that
stream belongs to a green context (`torch.cuda.green_contexts`) of that many SMs, so drafter work cannot
take the SMs decode needs (``"auto"``, the default: `auto_sms`). Contexts are shared by every trainer of the process and never destroyed.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from lightning_tlt.core.streams import EXCLUSIVE_STREAMS

AUTO_SHARE = 4
"""``side_stream_sms="auto"``: a quarter of the device's SMs (`auto_sms`)."""

AUTO_MIN_SMS = 32
"""Devices with fewer SMs are not split by ``"auto"``: a quarter of them would leave the drafter too few."""


def is_setting(value: object) -> bool:
    """Whether ``value`` is a ``side_stream_sms`` setting: ``"auto"``, ``None`` (every SM) or a count >= 1."""
    return value is None or value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)


def auto_sms(total: int) -> int | None:
    """``side_stream_sms="auto"`` on a device of ``total`` SMs: a quarter of them in steps of 8 (green contexts
    partition SMs in groups; 32 of an H100's or H200's 132), or ``None`` (every SM) below `AUTO_MIN_SMS`.

    The share is measured, not derived: at 0.5 B on the H200 a drafter step on 16, 32 and 64 SMs slowed a decode
    step beside it by 13, 17 and 36 % (every SM: 353 %) and took 47, 25 and 14 ms, so a pacer holding decode to a
    5 % slowdown admits about 8, 12 and 10 drafter steps a stall-second (every SM: 1.5); the e2e on an H100 then
    ran 2.1-2.8x the drafter steps an RL step of every SM at the same 5 % with 32 (docs/benchmarks.md).
    """
    if total < AUTO_MIN_SMS:
        return None
    return max(8, total // AUTO_SHARE // 8 * 8)


class GreenContexts:
    """CUDA green contexts by (device index, SMs), each created on first use and never destroyed: memory
    the caching allocator keeps for its streams outlives any trainer (freeing it into a destroyed context
    aborts the process, seen on the H200)."""

    def __init__(self) -> None:
        self._contexts: dict[tuple[int, int], Any] = {}

    @staticmethod
    def resolve(device: torch.device, sms: int | str | None) -> int | None:
        """``side_stream_sms`` as a count: ``"auto"`` is `auto_sms` of the device where torch has green
        contexts, else ``None`` (every SM: an explicit count on such a torch is an error, in `stream`)."""
        if sms != "auto":
            return None if sms is None else int(sms)
        from torch.cuda import green_contexts

        if not getattr(green_contexts, "SUPPORTED", False):
            return None
        return auto_sms(torch.cuda.get_device_properties(device).multi_processor_count)

    def side_stream(self, device: torch.device, setting: int | str | None, owner: object | None = None) -> tuple[Any, int | None]:
        """The side stream of ``side_stream_sms=setting`` and the SMs it got (``None``: every SM). ``"auto"`` falls back
        to every SM, with one warning, where the green context cannot be made (a driver without them, say): a
        default never stops a run that every SM would serve."""
        sms = self.resolve(device, setting)
        try:
            return self.stream(device, sms, owner), sms
        except Exception as err:  # noqa: BLE001 - whatever the driver says, every SM still works
            if setting != "auto" or sms is None:
                raise  # asked for explicitly (or every SM already): the error is the user's to see
            warnings.warn(f"side_stream_sms='auto': no green context of {sms} SMs could be made ({err!r}); the "
                          "drafter's side stream uses every SM", stacklevel=3)
            return self.stream(device, None, owner), None

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
