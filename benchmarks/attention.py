"""Decode/verify attention over the per-slot KV cache: the Triton flash-decoding kernel vs masked SDPA.

Qwen2.5-0.5B attention shapes (14 query heads, 2 KV heads, head_dim 64, bf16). For each batch,
query rows per slot (1 = decode, 5 / 9 / 17 = verify of 4 / 8 / 16 drafts) and cache, the time of
one layer's attention, median of CUDA-graph replays of 24 calls (the launch overhead a graphed
model step pays), for:

- ``sdpa``: masked SDPA over the whole static cache (what the engine did before);
- ``triton``: `lightning_tlt.core.attention.triton_cached_attention` (reads each row's own length);
- ``triton/splitN``: the kernel at a fixed split size (the sweep that chose `split_size_for`).

Also checks, on the GPU: the kernel against a float64 reference (relative error, NaN-poisoned KV
past each row's length), and the custom op inside ``torch.compile(fullgraph=True)`` replayed from
a CUDA graph. Writes JSON to ``benchmarks/results/attention_<card>_<date>.json``.

    python benchmarks/attention.py            # GPU
    python benchmarks/attention.py --smoke    # CPU (Triton interpreter), correctness only
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch
from _common import add_common_flags

ROOT = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM, LAYERS = 14, 2, 64, 24


def make(batch: int, q_len: int, cache: int, length: int, device: str, dtype: torch.dtype) -> tuple[Any, ...]:
    g = torch.Generator(device=device).manual_seed(batch * 1000 + q_len)
    q = torch.randn(batch, q_len, HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    k = torch.randn(batch, cache, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    v = torch.randn(batch, cache, KV_HEADS, HEAD_DIM, device=device, dtype=dtype, generator=g)
    lens = torch.full((batch,), length, device=device)
    lens = (lens - torch.randint(0, max(1, length // 4), (batch,), device=device, generator=g)).clamp_min(q_len)
    positions = lens[:, None] - q_len + torch.arange(q_len, device=device)[None]
    return q, k, v, positions, lens


def check(device: str, dtype: torch.dtype) -> list[dict[str, Any]]:
    from lightning_tlt.core.attention import reference_cached_attention, triton_cached_attention

    rows = []
    for batch, q_len, cache, length, split in [
        (1, 1, 256, 100, 64), (3, 5, 512, 300, 64), (8, 17, 512, 511, 128), (2, 9, 1024, 64, 256),
        (32, 1, 2048, 1000, 256), (5, 2, 128, 128, 64),
    ]:
        q, k, v, positions, lens = make(batch, q_len, cache, length, device, dtype)
        for b in range(batch):  # a row never reads KV at or past its length
            k[b, int(lens[b]):] = float("nan")
            v[b, int(lens[b]):] = float("nan")
        out = triton_cached_attention(q, k, v, positions, split)
        ref = reference_cached_attention(q.double(), k.double().nan_to_num(), v.double().nan_to_num(), positions)
        err = float((out.double() - ref).norm() / ref.norm())
        rows.append({"batch": batch, "q": q_len, "cache": cache, "split": split, "rel_err": err,
                     "nan": bool(out.isnan().any())})
        print(f"check B={batch:3d} q={q_len:2d} cache={cache:5d} split={split:3d}: rel err {err:.2e}")
    return rows


def graph_time(fn: Any, reps: int = LAYERS) -> float:
    """ms per call: median over replays of a CUDA graph holding ``reps`` calls."""
    import triton.testing

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return float(triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")) / reps


def timings(dtype: torch.dtype) -> list[dict[str, Any]]:
    from lightning_tlt.core.attention import reference_cached_attention, triton_cached_attention

    rows = []
    cases = [(b, q, 4096, 1500) for b in (1, 8, 32, 128) for q in (1, 5, 9, 17)]
    cases += [(32, 1, 8192, 1000), (32, 1, 1024, 1000), (128, 1, 8192, 1000), (128, 1, 1024, 1000),
              (32, 5, 8192, 1000), (32, 5, 1024, 1000)]
    for batch, q_len, cache, length in cases:
        args = make(batch, q_len, cache, length, "cuda", dtype)[:4]
        row: dict[str, Any] = {"batch": batch, "q": q_len, "cache": cache, "length": length}
        row["sdpa_ms"] = graph_time(lambda a=args: reference_cached_attention(*a))
        row["triton_ms"] = graph_time(lambda a=args: triton_cached_attention(*a))
        for split in (64, 128, 256, 512):
            row[f"triton_split{split}_ms"] = graph_time(lambda a=args, s=split: triton_cached_attention(*a, s))
        rows.append(row)
        print(f"B={batch:3d} q={q_len:2d} cache={cache:5d} len~{length}: sdpa {row['sdpa_ms']:.4f} ms  "
              f"triton {row['triton_ms']:.4f} ms  (splits 64/128/256/512: "
              + " ".join(f"{row[f'triton_split{s}_ms']:.4f}" for s in (64, 128, 256, 512)) + ")")
    return rows


def compiled_graph_check(dtype: torch.dtype) -> dict[str, Any]:
    """The custom op inside torch.compile(fullgraph=True), then captured and replayed."""
    from lightning_tlt.core.attention import cached_attention, reference_cached_attention

    q, k, v, positions, _ = make(4, 5, 1024, 700, "cuda", dtype)
    w = torch.randn(HEADS * HEAD_DIM, HEADS * HEAD_DIM, device="cuda", dtype=dtype) / 30

    def fn(q: torch.Tensor) -> torch.Tensor:
        out = cached_attention(q * 1.5, k, v, positions, backend="triton")
        return out.flatten(2) @ w

    compiled = torch.compile(fn, fullgraph=True)
    static_q = q.clone()
    out_holder: list[torch.Tensor] = []
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            compiled(static_q)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_holder.append(compiled(static_q))
    static_q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference_cached_attention(static_q.double() * 1.5, k.double(), v.double(), positions).flatten(2) @ w.double()
    err = float((out_holder[0].double() - ref).norm() / ref.norm())
    print(f"compiled + graphed custom op: rel err {err:.2e}")
    return {"rel_err": err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser, out_type=Path, smoke="CPU, Triton interpreter, correctness only")
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported (check imports them)
    dtype = torch.float32 if args.smoke else torch.bfloat16
    card = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    result: dict[str, Any] = {
        "card": card,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "shapes": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": str(dtype)},
    }
    import triton

    result["triton"] = triton.__version__
    result["check"] = check("cpu" if args.smoke else "cuda", dtype)
    if not args.smoke:
        result["compiled_graph"] = compiled_graph_check(dtype)
        result["timings"] = timings(dtype)
    name = f"attention_{card.split()[-1].lower()}_{dt.date.today():%Y%m%d}.json"
    out = args.out or ROOT / "benchmarks" / "results" / ("smoke" if args.smoke else "") / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
