"""The decode/verify attention kernel against softmax(QK^T)V over each row's valid prefix.

The Triton kernels run through Triton's CPU interpreter (``TRITON_INTERPRET=1``, set in
``tests/conftest.py`` before Triton is imported), so these are tests of the GPU code itself.
Tolerances: float32 inputs, relative error <= 1e-5 (IEEE dot products on the CPU); bfloat16
inputs, <= 1e-2 (bf16 rounding of q, k, v, of the probabilities before the PV product and of the
output, against a float64 reference of the same bf16 inputs).
"""

from __future__ import annotations

import pytest
import torch

from lightning_tlt.core.attention import (
    cached_attention,
    reference_cached_attention,
    split_size_for,
    triton_available,
    triton_cached_attention,
)

pytestmark = pytest.mark.skipif(not triton_available(torch.device("cpu")), reason="needs Triton's interpreter")
HEAD_DIM = 64
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def case(batch: int, q_len: int, kv_heads: int, group: int, cache: int, lengths: list[int], dtype: torch.dtype,
         seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    heads = kv_heads * group
    q = torch.randn(batch, q_len, heads, HEAD_DIM, generator=g).to(dtype)
    # one spare slot beyond the batch: rows must read only their own slot
    k = torch.randn(batch + 1, cache, kv_heads, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(batch + 1, cache, kv_heads, HEAD_DIM, generator=g).to(dtype)
    lens = torch.tensor(lengths)
    positions = lens[:, None] - q_len + torch.arange(q_len)[None]  # causal block ending at the row's length
    return q, k, v, positions, lens


def poison(k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN in every cache entry a row must not read (at or past its length, and the spare slot)."""
    k, v = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist()):
        k[b, n:] = float("nan")
        v[b, n:] = float("nan")
    k[len(lens):] = float("nan")
    v[len(lens):] = float("nan")
    return k, v


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def reference(q, k, v, positions, hole=None) -> torch.Tensor:
    """float64 masked softmax(QK^T)V over each row's prefix (NaN-free copies of the same inputs)."""
    return reference_cached_attention(q.double(), k.double().nan_to_num(), v.double().nan_to_num(), positions,
                                      hole=hole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("q_len", [1, 2, 5, 9, 17])
def test_kernel_equals_reference_over_valid_prefix(q_len: int, group: int, dtype: torch.dtype) -> None:
    cache = 192  # three 64-key splits: split programs, early exits and the merge kernel all run
    g = torch.Generator().manual_seed(q_len * 10 + group)
    lengths = torch.randint(q_len, cache + 1, (3,), generator=g).tolist()
    lengths[0] = max(q_len, 64)  # a length at a block edge
    q, k, v, positions, lens = case(3, q_len, 2 if group < 7 else 1, group, cache, lengths, dtype)
    k, v = poison(k, v, lens)
    out = triton_cached_attention(q, k, v, positions, split_size=64)
    assert not out.isnan().any()
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, reference(q, k, v, positions)) <= TOL[dtype]


@pytest.mark.parametrize("length", [1, 63, 64, 65, 127, 128, 129, 256])
def test_lengths_at_block_edges(length: int) -> None:
    """One row of each length around the 64-key blocks and splits, in one batch, one split size."""
    q, k, v, positions, lens = case(1, 1, 2, 7, 256, [length], torch.float32, seed=length)
    k, v = poison(k, v, lens)
    for split in (64, 128, 256):  # several splits, two, and one (the direct-write path)
        out = triton_cached_attention(q, k, v, positions, split_size=split)
        assert rel_err(out, reference(q, k, v, positions)) <= 1e-5


def test_queries_see_only_keys_at_or_before_their_position() -> None:
    """Causal inside the verify block: query j must not see the block's later keys (their values are
    set huge, so reading one would move the output far off)."""
    q, k, v, positions, lens = case(2, 5, 2, 2, 128, [40, 100], torch.float32)
    v = v.clone()
    for b, n in enumerate(lens.tolist()):
        v[b, n - 4 : n] = torch.linspace(1e3, 4e3, 4)[:, None, None]  # later block rows: loud values
    out = triton_cached_attention(q, k, v, positions, split_size=64)
    torch.testing.assert_close(out.double(), reference(q, k, v, positions), rtol=1e-5, atol=1e-4)
    assert out[:, 0].abs().max() < 50  # query 0 saw none of the 4 later keys


def test_hole_keys_are_not_seen() -> None:
    q, k, v, positions, lens = case(2, 3, 1, 2, 128, [90, 70], torch.float32)
    hole = torch.tensor([[10, 50], [0, 0]])  # row 0 skips [10, 50); row 1 has no hole
    k, v = k.clone(), v.clone()
    k[0, 10:50] = float("nan")
    v[0, 10:50] = float("nan")
    k, v = poison(k, v, lens)
    out = triton_cached_attention(q, k, v, positions, split_size=64, hole=hole)
    assert not out.isnan().any()
    assert rel_err(out, reference(q, k, v, positions, hole)) <= 1e-5


def test_dispatch_and_sdpa_kv_len() -> None:
    """`cached_attention`: both backends agree, and the SDPA path reads only ``kv_len`` positions."""
    q, k, v, positions, lens = case(2, 2, 2, 2, 128, [20, 33], torch.float32)
    k, v = poison(k, v, lens)
    ref = reference(q, k, v, positions)
    assert rel_err(cached_attention(q, k, v, positions, backend="triton"), ref) <= 1e-5
    # the SDPA path masks (it reads every position below kv_len), so it gets finite stale entries
    k, v = k.nan_to_num(), v.nan_to_num()
    k[:, 33:] = float("nan")  # but nothing at or past kv_len
    v[:, 33:] = float("nan")
    assert rel_err(cached_attention(q, k, v, positions, backend="sdpa", kv_len=33), ref) <= 1e-5
    assert rel_err(cached_attention(q, k, v, positions, backend="auto", kv_len=33), ref) <= 1e-5  # CPU: SDPA
    with pytest.raises(ValueError, match="attention backend must be one of"):
        cached_attention(q, k, v, positions, backend="flash")


def test_bad_shapes_are_refused() -> None:
    q = torch.randn(1, 1, 2, 48)
    k = torch.randn(1, 64, 1, 48)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        triton_cached_attention(q, k, k, torch.zeros(1, 1, dtype=torch.long))
    q, k, v, positions, _ = case(1, 1, 1, 1, 128, [5], torch.float32)
    with pytest.raises(ValueError, match="split_size must be a multiple of 64"):
        triton_cached_attention(q, k, v, positions, split_size=96)


def test_split_size_grows_with_the_batch() -> None:
    assert split_size_for(1, 2) == 256 and split_size_for(32, 2) == 256 and split_size_for(128, 2) == 512
