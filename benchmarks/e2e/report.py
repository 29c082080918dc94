"""The report, computed only from the run units: summaries, ratios per seed and pooled with bootstrap
intervals, the accuracy judgement, and the table printed from them.

Everything here is a pure function of the units in a report's ``runs`` and ``trl_runs`` (and of the
``skip`` it was run with), so a test recomputes a committed report's ``summary``, ``ratios``,
``per_seed`` and ``no_accuracy_loss`` with these same functions (`recompute`) and finds any hand edit.

Definitions (a: ``tlt``, b: ``nospec``, c: ``trl``; a and b of a seed cut to the steps both ran,
which saw the same prompts, `paired`):

- steady steps: steps ``skip`` .. N-1 of a run (the first ``skip`` compile and capture);
- ``a_over_b_step``: b's mean steady step time over a's (``per_seed``: one seed; ``ratios``: every
  seed's steady steps pooled);
- ``a_over_b_tokens_per_s``: a's generated tokens per second of its steady steps (tokens over wall
  time) over b's: fair where the two arms drew different lengths;
- ``a_over_b_run``: b's whole run over a's, every step, step 0 included (the sums of step times);
- ``tlt_step0_over_nospec_step0``: a's first step over b's (a time ratio: 1 is parity);
- each of the first three with ``<name>_ci95``: a percentile bootstrap 95 % interval over steps
  (`RESAMPLES` resamples, seeded with `BOOTSTRAP_SEED`, so the same units give the same bounds):
  the steady steps are resampled with replacement within each seed, a and b together (step i of a
  and of b ran on the same prompts); the whole-run ratio keeps each run's first ``skip`` steps once
  (a run has exactly one cold start) and resamples its steady steps;
- ``tlt_over_trl_step``: c's steady step (its steps after the first) over a's steady step;
  ``tlt_over_trl_first_step``: c's first step over a's first (both cold); ``null`` where c has
  no steady step.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections.abc import Callable
from typing import Any

from .workload import percentiles

RESAMPLES = 2000
BOOTSTRAP_SEED = 0
Steps = list[dict[str, Any]]


def paired(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """a and b of each seed cut to the steps both ran (the same prompts): means and ratios compare like
    with like; a configuration without its pair is kept whole."""
    out = []
    for run in runs:
        other = next((r for r in runs if r["seed"] == run["seed"] and r["name"] != run["name"]), None)
        n = min(len(run["steps"]), len(other["steps"])) if other is not None else len(run["steps"])
        out.append({**run, "steps": run["steps"][:n]})
    return out


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return statistics.fmean(finite) if finite else math.nan


def summarize(runs: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """One configuration's runs: means over the steady steps (after the first ``skip``: compile, graph
    capture), and the whole runs (``step0_s``, ``run_s``: means over the runs, every step counted)."""
    steps = [s for r in runs for s in (r["steps"][skip:] or r["steps"])]
    mean = lambda key: statistics.fmean(s[key] for s in steps)  # noqa: E731
    rollout, wall = mean("rollout_s"), sum(s["wall_s"] for s in steps)
    out = {
        "seeds": [r["seed"] for r in runs],
        "steps": [len(r["steps"]) for r in runs],
        "step_s": mean("wall_s"),
        "step0_s": statistics.fmean(r["steps"][0]["wall_s"] for r in runs),
        "run_s": statistics.fmean(sum(s["wall_s"] for s in r["steps"]) for r in runs),
        "rollout_s": rollout,
        "tail_s": mean("tail_s"),
        "reward_s": mean("reward_s"),
        "train_s": mean("train_s"),
        "boundary_s": mean("boundary_s"),
        "drafter_s": mean("drafter_s"),
        "tokens_per_s": mean("tokens") / rollout if rollout > 0 else math.nan,  # of the rollout alone
        "steady_tokens_per_s": sum(s["tokens"] for s in steps) / wall if wall > 0 else math.nan,  # wall to wall
        "tail_share": mean("tail_s") / max(1e-9, mean("tail_s") + mean("bulk_s")),
        "lengths": percentiles([float(n) for r in runs for s in r["steps"] for n in s["lengths"]]),
        "correctness_curve": [[s["correctness"] for s in r["steps"]] for r in runs],
        "reward_curve": [[s["reward"] for s in r["steps"]] for r in runs],
        "accept_len_curve": [[s["accept_len"] for s in r["steps"]] for r in runs],
        "spec_fraction_curve": [[s["spec_fraction"] for s in r["steps"]] for r in runs],
        "eagle_drafting_curve": [[s["eagle_drafting"] for s in r["steps"]] for r in runs],
        "grad_norm_curve": [[s.get("grad_norm", math.nan) for s in r["steps"]] for r in runs],
        "errors": [r["error"] for r in runs if r.get("error")],
        "stall_time_available_s": statistics.fmean(s.get("stall_time_available_s", math.nan) for s in steps),
        # the pacer's reading is a moving average that one step of captures can throw (H200, 0.5 B: a
        # mean of 17.5 % from two steps, a median of 0.01 %): the median beside the mean
        "decode_slowdown_median": statistics.median(s.get("decode_slowdown", math.nan) for s in steps),
        # the one-time cost: CUDA graphs captured (and the compiling inside them), per run, every step
        "graph_captures": statistics.fmean(sum(s.get("graph_captures", math.nan) for s in r["steps"]) for r in runs),
        "capture_s": statistics.fmean(sum(s.get("capture_s", math.nan) for s in r["steps"]) for r in runs),
        "capture_s_per_step": statistics.fmean(s.get("capture_s", 0.0) for s in steps),  # steady steps
        # Dynamo and Inductor seconds inside the steady steps, per run: 0 when compiling stayed in the first
        # steps (issue 29; the e2e's a compiled its EAGLE drafter in step 2 until 2026-12-05)
        "steady_compile_s": statistics.fmean(sum(s.get("compile_s", 0.0) for s in (r["steps"][skip:] or r["steps"]))
                                             for r in runs),
        "compile_s": statistics.fmean(sum(s.get("compile_s", 0.0) for s in r["steps"]) for r in runs),
    }
    # the co-training figures (issues 14 and 31) where the steps hold them (a; b has none): means over
    # the steady steps that measured them
    for name, key in (("drafter_steps_per_rl_step", "drafter_steps"), ("decode_slowdown_frac", "decode_slowdown"),
                      ("accept_len_mean", "accept_len")):
        value = _nanmean([s.get(key, math.nan) for s in steps])
        if value == value:
            out[name] = value
    return out


def summarize_trl(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """c's step time: the mean of its steps after the first (warm-up), ``None`` where it ran one step only."""
    times = [t for r in runs for t in r["step_s"][1:]]
    return {
        "seeds": [r["seed"] for r in runs],
        "steps": [len(r["step_s"]) for r in runs],
        "step_s": statistics.fmean(times) if times else None,
        "first_step_s": statistics.fmean(r["step_s"][0] for r in runs),
        "steps_timed": len(times),
        "run_s": statistics.fmean(sum(r["step_s"]) for r in runs),
        "generation_dtype": sorted({r.get("generation_dtype", "float32") for r in runs}),
        "lengths": percentiles([float(n) for r in runs for b in r["lengths"] for n in b]),
        "tokens_per_step": [[sum(b) for b in r["lengths"]] for r in runs],
        "correctness_curve": [r["correctness"] for r in runs],
    }


# ---------------------------------------------------------------------------------------------- ratios


def _walls(steps: Steps, idx: list[int]) -> float:
    return sum(steps[i]["wall_s"] for i in idx)


def _step_ratio(pairs: list[tuple[Steps, Steps]], idx: list[list[int]]) -> float | None:
    a = sum(_walls(sa, i) for (sa, _), i in zip(pairs, idx))
    b = sum(_walls(sb, i) for (_, sb), i in zip(pairs, idx))
    return b / a if a > 0 else None


def _tokens_ratio(pairs: list[tuple[Steps, Steps]], idx: list[list[int]]) -> float | None:
    def rate(k: int) -> float:
        tokens = sum(p[k][j]["tokens"] for p, i in zip(pairs, idx) for j in i)
        wall = sum(_walls(p[k], i) for p, i in zip(pairs, idx))
        return tokens / wall if wall > 0 else math.nan

    a, b = rate(0), rate(1)
    return a / b if b > 0 and a == a else None


def _run_ratio(skip: int) -> Callable[[list[tuple[Steps, Steps]], list[list[int]]], float | None]:
    def ratio(pairs: list[tuple[Steps, Steps]], idx: list[list[int]]) -> float | None:
        cold = [list(range(min(skip, len(sa)))) for sa, _ in pairs]  # once each: a run has one cold start
        return _step_ratio(pairs, [c + i for c, i in zip(cold, idx)])

    return ratio


def bootstrap_ci(stat: Callable[[list[tuple[Steps, Steps]], list[list[int]]], float | None],
                 pairs: list[tuple[Steps, Steps]], steady: list[list[int]]) -> list[float] | None:
    """The percentile bootstrap 95 % interval of ``stat`` over steps: ``steady``'s step indices resampled
    with replacement within each seed, a and b together; ``None`` with fewer than 2 steady steps a seed."""
    if any(len(i) < 2 for i in steady):
        return None
    rng = random.Random(BOOTSTRAP_SEED)
    values = []
    for _ in range(RESAMPLES):
        value = stat(pairs, [[rng.choice(i) for _ in i] for i in steady])
        if value is not None:
            values.append(value)
    if len(values) < RESAMPLES:
        return None
    values.sort()
    rank = lambda q: values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]  # noqa: E731
    return [rank(0.025), rank(0.975)]


def a_over_b(pairs: list[tuple[Steps, Steps]], skip: int) -> dict[str, Any]:
    """The a-over-b ratios of the seeds in ``pairs`` (a's and b's steps per seed, cut to the same length),
    pooled over them, each with its bootstrap interval; and a's first step over b's."""
    steady = [list(range(skip, len(sa))) or list(range(len(sa))) for sa, _ in pairs]
    out: dict[str, Any] = {}
    for name, stat in (("a_over_b_step", _step_ratio), ("a_over_b_tokens_per_s", _tokens_ratio),
                       ("a_over_b_run", _run_ratio(skip))):
        out[name] = stat(pairs, steady)
        out[f"{name}_ci95"] = bootstrap_ci(stat, pairs, steady)
    a0 = sum(sa[0]["wall_s"] for sa, _ in pairs)
    b0 = sum(sb[0]["wall_s"] for _, sb in pairs)
    out["tlt_step0_over_nospec_step0"] = a0 / b0 if b0 > 0 else None
    out["steps"] = [len(sa) for sa, _ in pairs]
    return out


def seed_pairs(runs: list[dict[str, Any]]) -> dict[int, tuple[Steps, Steps]]:
    """Each seed that has both a and b: (a's steps, b's steps), cut to the steps both ran."""
    cut = paired(runs)
    a = {r["seed"]: r["steps"] for r in cut if r["name"] == "tlt"}
    b = {r["seed"]: r["steps"] for r in cut if r["name"] == "nospec"}
    return {seed: (a[seed], b[seed]) for seed in sorted(a) if seed in b and a[seed]}


def ratios(summary: dict[str, Any], pairs: dict[int, tuple[Steps, Steps]], skip: int) -> dict[str, Any]:
    """The pooled ratios: a over b (over every seed's steps), a's rollout and tail, and a and b over c."""
    a, b, c = summary.get("tlt"), summary.get("nospec"), summary.get("trl")

    def over(x: float | None, y: float | None) -> float | None:
        return x / y if x is not None and y is not None and y > 0 else None

    names = ("a_over_b_step", "a_over_b_tokens_per_s", "a_over_b_run")
    unpaired = {key: None for n in names for key in (n, f"{n}_ci95")} | {"tlt_step0_over_nospec_step0": None}
    pooled = a_over_b(list(pairs.values()), skip) if pairs else unpaired  # every name, measured or not
    pooled.pop("steps", None)
    return {
        **pooled,
        "a_over_b_rollout": over(b and b["rollout_s"], a and a["rollout_s"]),
        "a_over_b_tail": over(b and b["tail_s"], a and a["tail_s"]),
        "tlt_over_trl_step": over(c and c["step_s"], a and a["step_s"]),
        "nospec_over_trl_step": over(c and c["step_s"], b and b["step_s"]),
        "tlt_over_trl_first_step": over(c and c["first_step_s"], a and a["step0_s"]),
    }


def autocorr_lag(steps: int) -> int:
    """The Newey-West lag for series of ``steps`` paired steps: floor(sqrt(steps)), 4 at 20 steps. Wider
    than Newey-West's own rule (floor(4 (steps / 100)^(2/9)), 2 at 20 steps), which assumes weak
    correlation: two arms whose policies parted at one step stay apart for many."""
    return max(1, math.isqrt(steps))


def newey_west_stderr(series: list[list[float]], lag: int) -> float:
    """The standard error of the pooled mean of independent series (one per seed) whose values are
    correlated within a series up to ``lag`` apart: Bartlett weights, centred on the pooled mean (so the
    seeds' spread counts too). ``lag`` 0 is the independent steps' standard error (with n for n - 1)."""
    values = [x for s in series for x in s]
    mean = statistics.fmean(values)
    total = 0.0
    for s in series:
        e = [x - mean for x in s]
        for gap in range(min(lag, len(e) - 1) + 1):
            weight = 1.0 if gap == 0 else 2.0 * (1.0 - gap / (lag + 1))
            total += weight * sum(e[i] * e[i + gap] for i in range(len(e) - gap))
    return math.sqrt(max(total, 0.0)) / len(values)


def no_accuracy_loss(a_runs: list[dict[str, Any]], b_runs: list[dict[str, Any]],
                     autocorrelated: bool = True) -> dict[str, Any]:
    """Correctness of a minus b, step by step on the same seed: mean and standard error over steps and seeds.

    Speculation is lossless, so a and b sample from the same distributions; their curves differ by
    sampling noise only (different random draws, or, under coupled verification, the same draws that a
    bf16 near-tie parted). ``stderr`` takes the steps as independent; they are not once the two policies
    have parted (a step's difference carries into the next ones), so ``stderr_autocorr`` is Newey-West's
    over each seed's series (`newey_west_stderr`, lag ``autocorr_lag``), and the verdict is judged
    against the wider of the two. ``verdict``: ``within_2se`` (the mean difference is within two standard
    errors of zero), ``tlt_higher``, ``tlt_lower`` (a loss), or why it cannot be judged:
    ``too_few_steps``, ``stopped_early`` (an arm's policy stopped being finite), ``all_zero``.
    ``autocorrelated=False``: the reports before format 4, judged on ``stderr`` alone.
    """
    series: list[list[float]] = []
    per_seed = {}
    for a in a_runs:
        b = next((r for r in b_runs if r["seed"] == a["seed"]), None)
        if b is None:
            continue
        d = [x["correctness"] - y["correctness"] for x, y in zip(a["steps"], b["steps"])]
        per_seed[str(a["seed"])] = statistics.fmean(d) if d else math.nan
        series.append(d)
    diffs = [x for d in series for x in d]
    if len(diffs) < 2:
        return {"n": len(diffs), "verdict": "too_few_steps"}
    failed = [f"{r['name']}/seed{r['seed']}" for r in (*a_runs, *b_runs) if r.get("error")]
    if failed:
        return {"n": len(diffs), "verdict": "stopped_early", "stopped": failed}
    if not any(x["correctness"] for r in (*a_runs, *b_runs) for x in r["steps"]):
        return {"n": len(diffs), "verdict": "all_zero"}  # equal curves of zeros say nothing about accuracy
    mean, se = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
    out: dict[str, Any] = {"n": len(diffs), "mean_diff": mean, "stderr": se}
    if autocorrelated:
        lag = autocorr_lag(min(len(d) for d in series if d))
        out |= {"stderr_autocorr": newey_west_stderr(series, lag), "autocorr_lag": lag}
        se = max(se, out["stderr_autocorr"])
    verdict = "within_2se" if abs(mean) <= 2 * se else "tlt_higher" if mean > 0 else "tlt_lower"
    return {**out, "per_seed_mean_diff": per_seed, "verdict": verdict}


JUDGEMENTS = {
    "within_2se": "no accuracy loss: within two standard errors of zero",
    "tlt_higher": "no accuracy loss: TLT higher",
    "tlt_lower": "accuracy LOSS: TLT lower by more than 2 SE",
    "too_few_steps": "not enough paired steps",
    "stopped_early": "cannot be judged: an arm stopped early (see its error)",
    "all_zero": "cannot be judged: correctness is 0 at every step of a and b",
}
"""The printed sentence of each verdict (the JSON holds the verdict alone)."""


# ---------------------------------------------------------------------------------------------- sections


def section(runs: list[dict[str, Any]], trl_runs: list[dict[str, Any]], skip: int,
            autocorrelated: bool = True) -> dict[str, Any]:
    """A section's computed part from its units: ``summary``, ``ratios``, ``per_seed``, ``no_accuracy_loss``
    (``autocorrelated``: see `no_accuracy_loss`)."""
    cut = paired(runs)
    summary: dict[str, Any] = {}
    for name in ("tlt", "nospec"):
        mine = [r for r in cut if r["name"] == name and r["steps"]]
        if mine:
            summary[name] = summarize(mine, skip)
    if trl_runs:
        summary["trl"] = summarize_trl(trl_runs)
    pairs = seed_pairs(runs)
    return {
        "summary": summary,
        "ratios": ratios(summary, pairs, skip),
        "per_seed": {str(seed): a_over_b([pair], skip) for seed, pair in pairs.items()},
        "no_accuracy_loss": no_accuracy_loss([r for r in cut if r["name"] == "tlt"],
                                             [r for r in cut if r["name"] == "nospec"], autocorrelated),
    }


COMPUTED = ("summary", "ratios", "per_seed", "no_accuracy_loss")
"""A section's keys computed from its units (never written by hand)."""
FORMAT_3_KEYS = ("steady_compile_s", "compile_s")
"""Summary keys added in format 3: a format-2 report is recomputed without them."""


def recompute(report: dict[str, Any]) -> dict[str, Any]:
    """A format-2 report's computed keys, recomputed from its units alone (its ``capped`` section too)."""
    skip, autocorrelated = report["args"]["skip"], report.get("format", 1) >= 4
    out = section(report["runs"], report["trl_runs"], skip, autocorrelated)
    if report.get("capped") is not None:
        capped = report["capped"]
        out["capped"] = {"max_new": capped["max_new"], **section(capped["runs"], capped["trl_runs"], skip,
                                                                 autocorrelated)}
    if report.get("format", 1) < 3:
        for part in (out, out.get("capped") or {}):
            for summary in part.get("summary", {}).values():
                for key in FORMAT_3_KEYS:
                    summary.pop(key, None)
    return out


# ---------------------------------------------------------------------------------------------- table


def _ci(value: float | None, ci: list[float] | None) -> str:
    if value is None:
        return "not measured"
    return f"{value:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def print_table(results: dict[str, Any], title: str = "") -> None:
    """The section's figures as a table (``results``: a report, or its ``capped`` section)."""
    s = results["summary"]
    print(f"\n{title}\n{'config':8} {'step s':>7} {'step0 s':>8} {'run s':>7} {'rollout':>8} {'tail':>6} "
          f"{'train':>6} {'drafter':>7} {'tok/s':>8} {'p50':>5} {'p99':>5} {'max':>5} {'accept':>6} "
          f"{'correct first->last':>20}")
    for name in ("tlt", "nospec"):
        if name in s:
            r = s[name]
            curves = [c for c in r["correctness_curve"] if c]
            k = max(1, min(len(c) for c in curves) // 4) if curves else 1
            first = statistics.fmean(x for c in curves for x in c[:k]) if curves else math.nan
            last = statistics.fmean(x for c in curves for x in c[-k:]) if curves else math.nan
            print(
                f"{name:8} {r['step_s']:7.2f} {r['step0_s']:8.2f} {r['run_s']:7.1f} {r['rollout_s']:8.2f} "
                f"{r['tail_s']:6.2f} {r['train_s']:6.2f} {r['drafter_s']:7.3f} {r['steady_tokens_per_s']:8.0f} "
                f"{r['lengths']['p50']:5.0f} {r['lengths']['p99']:5.0f} {r['lengths']['max']:5.0f} "
                f"{r.get('accept_len_mean', math.nan):6.2f} {first:9.3f} -> {last:.3f}"
            )
    if "trl" in s:
        t = s["trl"]
        steady = "no steady step (one step ran)" if t["step_s"] is None else f"{t['step_s']:.2f} s steady"
        print(f"{'trl':8} {steady}, first step {t['first_step_s']:.2f} s, {t['steps_timed']} steps after it, "
              f"generation {t['generation_dtype']}, lengths p50 {t['lengths']['p50']:.0f} max {t['lengths']['max']:.0f}")
    r = results["ratios"]
    for name in ("a_over_b_step", "a_over_b_tokens_per_s", "a_over_b_run"):
        seeds = ", ".join(f"seed {k} {_ci(v[name], v[f'{name}_ci95'])}" for k, v in results["per_seed"].items())
        print(f"  {name}: pooled {_ci(r.get(name), r.get(f'{name}_ci95'))}; {seeds}")
    for name in ("tlt_step0_over_nospec_step0", "tlt_over_trl_step", "nospec_over_trl_step",
                 "tlt_over_trl_first_step"):
        print(f"  {name}: {_ci(r.get(name), None)}")
    judged = results["no_accuracy_loss"]
    extra = ""
    if "mean_diff" in judged:
        se = max(judged["stderr"], judged.get("stderr_autocorr", 0.0))
        lag = f", steps correlated up to {judged['autocorr_lag']} apart" if "autocorr_lag" in judged else ""
        extra = f" (a - b = {judged['mean_diff']:+.3f} ± {se:.3f}{lag})"
    print(f"  {JUDGEMENTS[judged['verdict']]}{extra} over {judged['n']} steps x seeds")
    a = s.get("tlt", {})
    if "drafter_steps_per_rl_step" in a:
        print(f"  co-training (a): {a['drafter_steps_per_rl_step']:.1f} drafter steps per RL step in "
              f"{a['stall_time_available_s']:.2f} s of stalls, decode slowdown "
              f"{100 * a.get('decode_slowdown_frac', math.nan):.1f} % (median {100 * a['decode_slowdown_median']:.2f} %)")


def _flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Leaves by dotted key, each as JSON text (NaN equal to NaN, tuples as lists, keys as strings)."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flatten(item, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): json.dumps(value, default=float)}


def _same(x: str | None, y: str | None) -> bool:
    """Two `_flatten` leaves equal, numbers (in lists too) to 1e-12 relative: Python's float sums may differ in
    the last bit between the machine that wrote a report and the one that checks it (Python 3.12 on the H100
    against 3.11 here: ``stderr_autocorr`` of a 2026-12-08 report, 1 ulp apart)."""
    if x == y:
        return True
    if x is None or y is None:
        return False
    return _close(json.loads(x), json.loads(y))


def _close(u: Any, v: Any) -> bool:
    if isinstance(u, list) and isinstance(v, list):
        return len(u) == len(v) and all(_close(a, b) for a, b in zip(u, v))
    if all(isinstance(n, (int, float)) and not isinstance(n, bool) for n in (u, v)):
        both_nan = isinstance(u, float) and isinstance(v, float) and math.isnan(u) and math.isnan(v)
        return bool(u == v or both_nan or math.isclose(u, v, rel_tol=1e-12, abs_tol=0.0))
    return bool(u == v)


def differences(report: dict[str, Any]) -> list[str]:
    """What in a format-2 report its units do not give: each computed key whose stored value differs from
    `recompute` (dotted, ``ratios.a_over_b_step``), and each unit without a valid ``provenance``."""
    fresh = json.loads(json.dumps(recompute(report), default=float))  # as the JSON holds it
    stored = {k: report.get(k) for k in COMPUTED}
    if report.get("capped") is not None:
        stored["capped"] = {k: report["capped"].get(k) for k in ("max_new", *COMPUTED)}
    a, b = _flatten(stored), _flatten(fresh)
    out = [key for key in sorted(a.keys() | b.keys()) if not _same(a.get(key), b.get(key))]
    sections = [report, *([report["capped"]] if report.get("capped") is not None else [])]
    for unit in (u for s in sections for u in (*s["runs"], *s["trl_runs"])):
        p = unit.get("provenance") or {}
        ok = {"commit", "date", "device", "measured"} <= p.keys() and (p["measured"] is True or (
            p["measured"] is False and bool(p.get("carried_from"))))
        if not ok:
            out.append(f"provenance of {unit.get('name')}/seed{unit.get('seed')}: {p}")
    return out
