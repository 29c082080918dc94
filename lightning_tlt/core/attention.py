"""Attention of a few query rows per slot over the per-slot static KV cache, at the memory floor.

Decode (one query row per slot) and verify (``k + 1`` rows per slot, causal inside the block)
are the same problem: row ``b`` of the batch owns cache slot ``b`` and its queries sit at
positions ``positions[b, j]``; query ``j`` attends to the keys at positions ``<= positions[b, j]``.
Two implementations compute it:

- `triton_cached_attention`: flash-decoding (Dao et al. 2023, "Flash-Decoding for long-context
  inference"; the split-K form of FlashAttention-2, Dao 2023) over each row's *valid* prefix. One
  program per (row, KV head, split of ``split_size`` positions) loads the row's ``q x group``
  query rows as one tile (GQA: the query heads sharing a KV head read its keys once), walks only
  the key blocks below the row's length, and keeps an online softmax; programs whose split starts
  past the row's length exit at once, so a step reads the KV it needs, not the static cache. The
  partial results are merged by their log-sum-exp in a second small kernel (or written directly
  when there is one split). A verify of ``k + 1`` rows thus reads the same bytes as a decode step,
  which is what makes it cost about one decode step (the masked SDPA it replaces picks a slow
  kernel as soon as a row has more than one query: 0.066 ms a layer for 5 rows against 0.009 for
  one, measured on an H200, ``docs/engine.md``).
- `reference_cached_attention`: the same function through ``scaled_dot_product_attention`` with a
  boolean mask, optionally over the first ``kv_len`` positions only; the CPU path and the generic
  fallback, and what the kernel is tested against.

On the CPU, ``TRITON_INTERPRET=1`` runs the Triton kernels through Triton's interpreter, so the
tests exercise the GPU code itself.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "ATTENTION_BACKENDS",
    "cached_attention",
    "default_backend",
    "reference_cached_attention",
    "split_size_for",
    "triton_available",
    "triton_cached_attention",
]

ATTENTION_BACKENDS = ("auto", "triton", "sdpa")
"""``"triton"``: the flash-decoding kernels; ``"sdpa"``: the masked-SDPA reference; ``"auto"``:
Triton on CUDA when it imports, else SDPA."""

try:  # Triton ships with CUDA builds of torch; on the CPU it is an optional extra (the tests' interpreter)
    import triton
    import triton.language as tl

    _HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    _HAS_TRITON = False


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``)."""
    if not _HAS_TRITON:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def default_backend(device: torch.device) -> str:
    """What ``"auto"`` resolves to on ``device``."""
    return "triton" if device.type == "cuda" and triton_available(device) else "sdpa"


def split_size_for(batch: int, num_kv_heads: int) -> int:
    """Positions per split-K program, chosen by measurement (H200, 14/2 heads, ``docs/engine.md``).

    The grid has ``batch * num_kv_heads * ceil(T / split)`` programs, of which only those below
    each row's length work. 256 positions was the fastest split from batch 1 to 32 for 1, 5, 9 and
    17 query rows (64 paid for an extra merge pass over many partials, 512 for too little
    parallelism at small batch); 512 edged it at batch 128.
    """
    return 512 if batch * num_kv_heads > 128 else 256


# --------------------------------------------------------------------------------------- reference
def reference_cached_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    kv_len: int | None = None,
    hole: Tensor | None = None,
) -> Tensor:
    """Masked-SDPA attention of ``q`` over the cache; the semantics every backend implements.

    Args:
        q: ``(B, Q, nh, hd)`` queries of rows ``0..B-1`` (row ``b`` is cache slot ``b``).
        k_cache, v_cache: ``(S, T, n_kv, hd)`` with ``S >= B``; ``nh`` a multiple of ``n_kv`` (GQA).
        positions: ``(B, Q)`` absolute position of each query; it sees keys at positions ``<=`` it.
        kv_len: read only the first ``kv_len`` positions (must exceed every position); ``None``: all.
        hole: ``(B, 2)`` long ``[lo, hi)`` per row: keys at positions in it are not seen (an EAGLE
            drafter's history skips the steps decoded without it); ``None``: no hole.

    Returns:
        ``(B, Q, nh, hd)`` in ``q``'s dtype.
    """
    bsz, q_len, num_heads, head_dim = q.shape
    t = k_cache.shape[1] if kv_len is None else kv_len
    keys = k_cache[:bsz, :t].transpose(1, 2)  # (B, n_kv, T, hd)
    vals = v_cache[:bsz, :t].transpose(1, 2)
    keys_pos = torch.arange(t, device=q.device)[None, None, :]
    visible = keys_pos <= positions[:, :, None]  # (B, Q, T)
    if hole is not None:
        visible = visible & ((keys_pos < hole[:, None, :1]) | (keys_pos >= hole[:, None, 1:]))
    # GQA by SDPA itself (query head h reads key head h // group); transposes only: no reshape whose being a
    # view depends on a size of 1, which a compiled step would guard on (a version for Q = 1, one for B = 1)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), vals.to(q.dtype), attn_mask=visible[:, None], enable_gqa=True
    )
    return out.transpose(1, 2).contiguous()


# ------------------------------------------------------------------------------------------ Triton
if _HAS_TRITON:

    @triton.jit
    def _split_kernel(
        Q, K, V, POS, HOLE, OUT, PART, LSE,
        stride_qb, stride_qq, stride_qh,
        stride_kb, stride_kt, stride_kh,
        stride_vb, stride_vt, stride_vh,
        stride_pb,
        stride_ob, stride_oq, stride_oh,
        stride_part_b, stride_part_s, stride_part_r,
        stride_lse_b, stride_lse_s,
        cache_len, scale,
        Q_LEN: tl.constexpr, GROUP: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DIRECT: tl.constexpr,
        PRECISION: tl.constexpr, UPCAST: tl.constexpr, HAS_HOLE: tl.constexpr,
    ):
        """One (row, KV head, split): the block's query rows against the split's valid keys."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        rows = tl.arange(0, BLOCK_M)  # row r is query j = r // GROUP of head kvh * GROUP + r % GROUP
        j = rows // GROUP
        head = kvh * GROUP + rows % GROUP
        row_ok = rows < Q_LEN * GROUP
        qpos = tl.load(POS + b * stride_pb + j, mask=row_ok, other=-1)  # (BLOCK_M,)
        kv_len = tl.minimum(tl.max(qpos, axis=0) + 1, cache_len)
        start = split * SPLIT
        if HAS_HOLE:
            hole_lo = tl.load(HOLE + b * 2)
            hole_hi = tl.load(HOLE + b * 2 + 1)
        if start < kv_len:
            end = tl.minimum(start + SPLIT, kv_len)
            dims = tl.arange(0, HEAD_DIM)
            q = tl.load(
                Q + b * stride_qb + j[:, None] * stride_qq + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None], other=0.0,
            )
            if UPCAST:  # Triton's CPU interpreter multiplies bf16 tiles wrongly (3.9); the GPU keeps bf16
                q = q.to(tl.float32)
            m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
            l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
            acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
            k_base = K + b * stride_kb + kvh * stride_kh
            v_base = V + b * stride_vb + kvh * stride_vh
            for n0 in range(start, end, BLOCK_N):
                offs = n0 + tl.arange(0, BLOCK_N)
                key_ok = offs < end  # never read at or past the row's length
                if HAS_HOLE:  # nor inside its hole
                    key_ok = key_ok & ((offs < hole_lo) | (offs >= hole_hi))
                k = tl.load(k_base + offs[:, None] * stride_kt + dims[None, :], mask=key_ok[:, None], other=0.0)
                if UPCAST:
                    k = k.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale  # (BLOCK_M, BLOCK_N)
                seen = (offs[None, :] <= qpos[:, None]) & key_ok[None, :]
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_base + offs[:, None] * stride_vt + dims[None, :], mask=key_ok[:, None], other=0.0)
                if UPCAST:
                    v = v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
                m_i = m_new
            has = l_i > 0.0
            out = acc / tl.where(has, l_i, 1.0)[:, None]
            if DIRECT:  # a single split: this is the answer
                tl.store(
                    OUT + b * stride_ob + j[:, None] * stride_oq + head[:, None] * stride_oh + dims[None, :],
                    out.to(OUT.dtype.element_ty), mask=row_ok[:, None],
                )
            else:
                r = j * NUM_HEADS + head  # (query, head) index within the row
                part = PART + b * stride_part_b + split * stride_part_s
                tl.store(part + r[:, None] * stride_part_r + dims[None, :], out, mask=row_ok[:, None])
                lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
                tl.store(LSE + b * stride_lse_b + split * stride_lse_s + r, lse, mask=row_ok)

    @triton.jit
    def _merge_kernel(
        PART, LSE, POS, OUT,
        stride_part_b, stride_part_s, stride_part_r,
        stride_lse_b, stride_lse_s,
        stride_pb,
        stride_ob, stride_or,
        cache_len,
        Q_LEN: tl.constexpr, BLOCK_Q: tl.constexpr, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
    ):
        """Merge the valid splits of one row by log-sum-exp: ``out = Σ_s exp(lse_s - lse) out_s``."""
        b = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # (query, head) indices
        row_ok = rows < ROWS
        qs = tl.arange(0, BLOCK_Q)
        last = tl.load(POS + b * stride_pb + qs, mask=qs < Q_LEN, other=-1)
        kv_len = tl.minimum(tl.max(last, axis=0) + 1, cache_len)
        num_splits = tl.cdiv(kv_len, SPLIT)
        dims = tl.arange(0, HEAD_DIM)
        m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
        for s in range(0, num_splits):
            lse = tl.load(LSE + b * stride_lse_b + s * stride_lse_s + rows, mask=row_ok, other=float("-inf"))
            m = tl.maximum(m, lse)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros((BLOCK_R,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_R, HEAD_DIM), dtype=tl.float32)
        for s in range(0, num_splits):
            lse = tl.load(LSE + b * stride_lse_b + s * stride_lse_s + rows, mask=row_ok, other=float("-inf"))
            w = tl.exp(lse - m_safe)  # 0 for a split that saw no key
            part = tl.load(
                PART + b * stride_part_b + s * stride_part_s + rows[:, None] * stride_part_r + dims[None, :],
                mask=row_ok[:, None] & (w[:, None] > 0.0), other=0.0,
            )
            acc += w[:, None] * part
            total += w
        out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
        tl.store(OUT + b * stride_ob + rows[:, None] * stride_or + dims[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def triton_cached_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    split_size: int | None = None,
    hole: Tensor | None = None,
) -> Tensor:
    """Flash-decoding attention (see the module docstring); same contract as `reference_cached_attention`.

    Args:
        q: ``(B, Q, nh, hd)``, contiguous in its last two dimensions.
        k_cache, v_cache: ``(S, T, n_kv, hd)`` with ``S >= B``.
        positions: ``(B, Q)`` long; each row's length is its largest position + 1.
        split_size: positions per split program (a multiple of 16); ``None``: `split_size_for`.
        hole: ``(B, 2)`` long ``[lo, hi)`` of unseen keys per row, or ``None``.
    """
    if not _HAS_TRITON:
        raise RuntimeError("the 'triton' attention backend needs Triton installed (pip install triton)")
    bsz, q_len, num_heads, head_dim = q.shape
    cache_len, num_kv = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv
    if head_dim & (head_dim - 1) or head_dim < 16:
        raise ValueError(f"the Triton attention kernel needs a power-of-two head_dim >= 16, got {head_dim}")
    q = q.contiguous()
    positions = positions.contiguous()
    split = split_size or split_size_for(bsz, num_kv)
    block_n = min(64, split)
    if split % block_n:
        raise ValueError(f"split_size must be a multiple of {block_n}, got {split}")
    num_splits = triton.cdiv(cache_len, split)
    block_m = max(16, triton.next_power_of_2(q_len * group))
    out = torch.empty_like(q)
    direct = num_splits == 1
    rows = q_len * num_heads
    if direct:
        part = lse = out  # unused
        part_strides = (0, 0, 0)
        lse_strides = (0, 0)
    else:
        part = torch.empty(bsz, num_splits, rows, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(bsz, num_splits, rows, device=q.device, dtype=torch.float32)
        part_strides = (part.stride(0), part.stride(1), part.stride(2))
        lse_strides = (lse.stride(0), lse.stride(1))
    scale = 1.0 / math.sqrt(head_dim)
    hole_arg = positions if hole is None else hole.contiguous()
    _split_kernel[(bsz, num_kv, num_splits)](
        q, k_cache, v_cache, positions, hole_arg, out, part, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        positions.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        *part_strides, *lse_strides,
        cache_len, scale,
        Q_LEN=q_len, GROUP=group, NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, DIRECT=direct,
        PRECISION="ieee" if q.dtype == torch.float32 or q.device.type == "cpu" else "tf32",
        UPCAST=q.device.type == "cpu", HAS_HOLE=hole is not None,
        num_warps=4, num_stages=2,
    )
    if not direct:
        block_r = min(32, triton.next_power_of_2(rows))
        flat = out.view(bsz, rows, head_dim)
        _merge_kernel[(bsz, triton.cdiv(rows, block_r))](
            part, lse, positions, flat,
            *part_strides, *lse_strides,
            positions.stride(0),
            flat.stride(0), flat.stride(1),
            cache_len,
            Q_LEN=q_len, BLOCK_Q=triton.next_power_of_2(q_len), ROWS=rows, HEAD_DIM=head_dim,
            BLOCK_R=block_r, SPLIT=split,
            num_warps=4,
        )
    return out


# ------------------------------------------------------------------------------------ custom op
@torch.library.custom_op("lightning_tlt::cached_attention", mutates_args=())
def _cached_attention_op(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, split_size: int, hole: Tensor | None
) -> Tensor:
    """The Triton path as an opaque op, so ``torch.compile(fullgraph=True)`` keeps it in the graph."""
    return triton_cached_attention(q, k_cache, v_cache, positions, split_size or None, hole)


@_cached_attention_op.register_fake
def _(q: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor, split_size: int, hole: Tensor | None) -> Tensor:
    return torch.empty_like(q)


def cached_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    positions: Tensor,
    *,
    backend: str = "auto",
    kv_len: int | None = None,
    split_size: int | None = None,
    hole: Tensor | None = None,
) -> Tensor:
    """Attention of ``q`` (``(B, Q, nh, hd)``) over each row's cached prefix; see the module docstring.

    Args:
        q, k_cache, v_cache, positions: as in `reference_cached_attention`.
        backend: one of `ATTENTION_BACKENDS`.
        kv_len: the SDPA path reads only this many positions (an upper bound on every row's
            length, e.g. a graph profile's KV bucket); the Triton path reads each row's own length.
        split_size: the Triton path's positions per split program (``None``: `split_size_for`).
        hole: ``(B, 2)`` long ``[lo, hi)`` per row of keys not seen, or ``None``.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = default_backend(q.device)
    if backend == "triton":
        return _cached_attention_op(q, k_cache, v_cache, positions, split_size or 0, hole)
    return reference_cached_attention(q, k_cache, v_cache, positions, kv_len, hole)
