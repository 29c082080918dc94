"""A preallocated, per-slot KV cache with static shapes.

Layout ``(L, S, T, n_kv, hd)``: layer, slot, position, KV head, head dim. Row ``i`` of a batch is
slot ``i`` (the scheduler keeps the active rows packed at the front), so a batch of ``B`` rows
works on the views ``k[:, :B]`` and ``v[:, :B]`` without any gather, which is what makes one
captured CUDA graph per batch bucket possible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def kv_bytes_per_slot(
    num_layers: int, max_seq_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of K and V for one slot of ``max_seq_len`` positions."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * max_seq_len * num_kv_heads * head_dim * itemsize


@dataclass
class KVCache:
    """K and V of every slot, ``(L, S, T, n_kv, hd)`` each."""

    k: Tensor
    v: Tensor

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_slots: int,
        max_seq_len: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KVCache:
        if num_slots < 1 or max_seq_len < 1:
            raise ValueError(f"num_slots and max_seq_len must be >= 1, got {num_slots!r} and {max_seq_len!r}")
        shape = (num_layers, num_slots, max_seq_len, num_kv_heads, head_dim)
        return cls(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_seq_len(self) -> int:
        return self.k.shape[2]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write_prefix(self, dst_slots: Tensor, k: Tensor, v: Tensor, src_rows: Tensor) -> None:
        """Copy a prefilled prefix into slots: ``cache[:, dst_slots[j], :P] = k[:, src_rows[j]]``.

        ``k``/``v`` are ``(L, Bp, P, n_kv, hd)`` (a prefill scratch cache); one prefill of a prompt
        thus serves all its ``num_samples`` slots.
        """
        length = k.shape[2]
        self.k[:, dst_slots, :length] = k[:, src_rows]
        self.v[:, dst_slots, :length] = v[:, src_rows]

    def copy_slots(self, dst_slots: Tensor, src_slots: Tensor, length: int | None = None) -> None:
        """``cache[:, dst] = cache[:, src]`` (first ``length`` positions, default all), in one op per tensor."""
        t = self.max_seq_len if length is None else length
        self.k[:, dst_slots, :t] = self.k[:, src_slots, :t]
        self.v[:, dst_slots, :t] = self.v[:, src_slots, :t]
