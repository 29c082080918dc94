"""CUDA graphs, pool streams and cuBLAS workspaces: the mechanism behind the TLT arm's stalls, and the kit's fix.

One process on one GPU, in seconds (`lightning_tlt.core.streams` says why it matters):

1. ``pool``: how many ``torch.cuda.Stream()`` calls after one stream the pool hands that stream out again
   (torch's ``kStreamsPerPool``: 32).
2. ``reset``: for the decode's GEMM shapes (``--rows`` x 896 -> 4,864, bf16), graphs A and B captured on one
   stream; B reset; the memory it freed refilled with junk; A replayed. ``freed_MiB``: what B's reset gave
   back to the allocator (a workspace when torch frees the stream's one); ``sibling_exact``: A's output
   equal to its first replay.
3. ``kit``: the same through the engine's `CUDAGraphProfileCache` and `CUDAGraphBackend`: one group
   (``decode``) of two graphs and another (``verify``) of one captured; ``verify`` dropped, the memory
   refilled; the ``decode`` graphs replayed: ``survivors_exact``, and whether the groups' streams and the
   drafter's differed (``distinct_streams``).

``summary``: ``pool_period``, ``reset_frees_workspace`` (any row count freed bytes on a sibling's reset),
``sibling_exact`` (every row count), ``kit_survivors_exact``, ``kit_distinct_streams``.

GPU: ``python benchmarks/graph_streams.py``. Without CUDA there is nothing to measure: it says so and exits 2.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import sys
from typing import Any

import torch
from _common import add_common_flags, write_results

from lightning_tlt.core.streams import EXCLUSIVE_STREAMS
from lightning_tlt.rollout.cuda_graphs import CUDAGraphBackend, CUDAGraphProfileCache, GraphProfile

HIDDEN, OUT_FEATURES = 896, 4864  # the 0.5 B policy's MLP up projection: the decode's skinny GEMM


def _refill(nbytes: int = 1 << 30) -> list[torch.Tensor]:
    """Take what the allocator has free (up to ``nbytes``) and fill it with junk: a freed workspace is reused."""
    return [torch.full((nbytes // 4 // 8,), -1, dtype=torch.int32, device="cuda") for _ in range(8)]


def pool_period(limit: int = 100) -> int | None:
    first = torch.cuda.Stream()
    for i in range(1, limit + 1):
        if torch.cuda.Stream().cuda_stream == first.cuda_stream:
            return i
    return None


def sibling_after_reset(rows: int) -> dict[str, Any]:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    a = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(OUT_FEATURES, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(rows, OUT_FEATURES, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # the warm-up: the stream's workspace is made here
        torch.nn.functional.linear(a, w, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = []
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            torch.nn.functional.linear(a, w, out=out)
        graphs.append(graph)
    graphs[0].replay()
    torch.cuda.synchronize()
    want = out.clone()
    before = torch.cuda.memory_allocated()
    graphs[1].reset()
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    junk = _refill()
    out.zero_()
    graphs[0].replay()
    torch.cuda.synchronize()
    result = {"rows": rows, "freed_MiB": freed / 2**20, "sibling_exact": bool(torch.equal(out, want)),
              "max_abs_diff": float((out.float() - want.float()).abs().max())}
    del junk
    return result


def kit_groups(rows: int) -> dict[str, Any]:
    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = torch.randn(OUT_FEATURES, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    inputs = {n: torch.randn(n, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) for n in (rows, 2 * rows)}
    outs = {n: torch.empty(n, OUT_FEATURES, device="cuda", dtype=torch.bfloat16) for n in inputs}
    backend = CUDAGraphBackend(device)
    cache = CUDAGraphProfileCache(backend, max_batch=2 * rows)
    side = EXCLUSIVE_STREAMS.acquire(device, "graph_streams: a drafter's side stream")

    def step(n: int) -> Any:
        return lambda: torch.nn.functional.linear(inputs[n], w, out=outs[n])

    decode = [GraphProfile("decode", n) for n in inputs]
    for profile in decode:
        cache.run(profile, step(profile.batch))
    cache.run(GraphProfile("verify", 2 * rows, 2), step(2 * rows))
    streams = [s.cuda_stream for s in backend.streams.values()] + [side.cuda_stream]
    torch.cuda.synchronize()
    want = {n: o.clone() for n, o in outs.items()}
    dropped = cache.drop(lambda p: p.phase == "verify")
    junk = _refill()
    for o in outs.values():
        o.zero_()
    for profile in decode:
        cache.run(profile, step(profile.batch))
    torch.cuda.synchronize()
    exact = all(torch.equal(outs[n], want[n]) for n in outs)
    del junk
    cache.clear()
    EXCLUSIVE_STREAMS.release(device, side)
    return {"dropped": dropped, "survivors_exact": exact, "distinct_streams": len(set(streams)) == len(streams),
            "streams": len(streams)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64", help="row counts of the GEMM (comma-separated)")
    add_common_flags(parser, out="JSON path (default: benchmarks/results/graph_streams_<card>_<date>.json)",
                     smoke=False)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("graph_streams.py measures CUDA graphs and streams: it needs a CUDA device (none here)", file=sys.stderr)
        raise SystemExit(2)
    rows = [int(r) for r in args.rows.split(",")]
    results: dict[str, Any] = {
        "benchmark": "graph_streams", "card": torch.cuda.get_device_name(), "torch": torch.__version__,
        "python": platform.python_version(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"rows": rows, "hidden": HIDDEN, "out_features": OUT_FEATURES, "dtype": "bfloat16"},
    }
    results["pool"] = {"period": pool_period()}
    results["reset"] = [sibling_after_reset(r) for r in rows]
    results["kit"] = kit_groups(rows[0])
    results["summary"] = {
        "pool_period": results["pool"]["period"],
        "reset_frees_workspace": any(r["freed_MiB"] > 0 for r in results["reset"]),
        "sibling_exact": all(r["sibling_exact"] for r in results["reset"]),
        "kit_survivors_exact": results["kit"]["survivors_exact"],
        "kit_distinct_streams": results["kit"]["distinct_streams"],
    }
    print(f"{results['card']} | torch {torch.__version__} | pool period {results['pool']['period']}")
    print(f"{'rows':>6} {'freed MiB':>10} {'sibling exact':>14} {'max |diff|':>11}")
    for r in results["reset"]:
        print(f"{r['rows']:>6} {r['freed_MiB']:>10.1f} {str(r['sibling_exact']):>14} {r['max_abs_diff']:>11.3g}")
    kit = results["kit"]
    print(f"kit: {kit['dropped']} graph dropped, survivors exact {kit['survivors_exact']}, "
          f"{kit['streams']} streams distinct {kit['distinct_streams']}")
    write_results(results, "graph_streams", smoke=False, cuda=True, out=args.out)


if __name__ == "__main__":
    main()
