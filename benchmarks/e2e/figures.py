"""The figures of run units without a report: for an e2e call that ended before it wrote one."""

from __future__ import annotations

import json
from typing import Any

from .report import print_table, section


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Print the figures of run units (the files an e2e call copies to ``e2e_runs/`` as each run ends),
    computed by `report.section` as a report computes them: for a call that ended before it wrote its report.
    Writes nothing: a report is written by ``python -m benchmarks.e2e`` only.

    ``python -m benchmarks.e2e.figures UNIT.json [UNIT.json ...] [--skip 2]``
    """
    import argparse
    from pathlib import Path

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0] if main.__doc__ else None)
    parser.add_argument("units", nargs="+", help="run units (JSON) of a and b")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the steady means")
    args = parser.parse_args(argv)
    runs = [json.loads(Path(path).read_text()) for path in args.units]
    bad = [r.get("name") for r in runs if r.get("name") not in ("tlt", "nospec")]
    if bad:
        raise SystemExit(f"units must be runs of a (tlt) or b (nospec), got {bad}")
    results = section(runs, [], args.skip)
    devices = sorted({str((r.get("provenance") or {}).get("device")) for r in runs})
    commits = sorted({str((r.get("provenance") or {}).get("commit")) for r in runs})
    names = ", ".join(f"{r['name']}/seed{r['seed']}" for r in runs)
    print_table(results, f"{len(runs)} units ({names}) on {', '.join(devices)} at {', '.join(commits)}; "
                         f"steady: steps {args.skip}..")
    for name in ("tlt", "nospec"):
        if name in results["summary"]:
            s = results["summary"][name]
            print(f"  {name}: compiling {s['compile_s']:.1f} s a run, {s['steady_compile_s']:.1f} s of it in the "
                  f"steady steps")
    return results


if __name__ == "__main__":
    main()
