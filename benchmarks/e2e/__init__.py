"""End to end, side by side: TLT vs speculation off vs TRL ``GRPOTrainer`` on a long-tail reasoning workload.

The paper's table in miniature (issues 15 and 30), measured in one process on one GPU, on the workload
that looks like the paper's: ``countdown_search`` (Countdown with the depth-first search written out, a
heavy tail of response lengths; difficulty 3: p50 about 270 tokens, p99 about 6,700 in the worked
solutions, cut at 4,096) and the Qwen2.5-0.5B-shaped zoo policy (``0.5b``: 494 M parameters, a
151,936-row tied head):

a. ``tlt``: the kit with speculation: the suffix drafter speculates first, the EAGLE drafter
   (warm-started offline on the policy's own rollouts, then co-trained in the stalls by
   `DrafterCoTrainCallback`) takes over once its held-out acceptance beats the suffix drafter's;
b. ``nospec``: the same engine, settings and seed with speculation off;
c. ``trl``: TRL's ``GRPOTrainer`` from the same warm start, its default HF ``generate`` (no vLLM),
   weights and generation in bf16 on the GPU; ``--trl-steps`` steps (3), its first left out of its
   steady mean.

Each run of a or b starts with ``torch._dynamo.reset()`` and `lightning_tlt.core.stored_compile.reset`: it
traces its own step functions and loads their compiled versions from the store as a new process would,
whichever arm ran before it in this process (Inductor's on-disk caches and the store stay warm, as on a
restart on the same machine), so the whole-run and first-step ratios compare like with like. Runs before
units of format 4 (2026-12-08) kept the versions an earlier run in the process had loaded: b's runs after the
warm start captured their first graphs faster than a fresh process.

On the GPU a and b train float32 master weights under bf16 autocast (``--master-weights``) and roll
out from the engine's bf16 copy of them; they cut the update into micro-batches by tokens
(``--micro-batch-tokens``).

Modules: `options` (the options dataclass and its flags), `workload` (cache keys, the warm starts,
``--carry``), `arms` (running a, b and c; each run a unit with its ``provenance``), `report` (every
figure, computed from the units only: `report.recompute`), `plots`, `main` (one call).

Stages (``--stage``, comma-separated, default ``all``), run in this order: ``warmstart`` (SFT of the
policy, bounded in time, then the drafter's warm start), ``ab`` (b, then a over b's number of steps,
seed by seed), ``cap`` (b, a and c at the shared shorter ``--cap``, for ``--cap-seeds``: the report's
``capped`` section), ``trl`` (c at ``--max-new``: the longest unit, last), and the report, which
every call writes from all that is cached. Every unit is
cached under ``.cache/`` (git-ignored) as soon as it ends, keyed by the policy it starts from and its
own settings, so a call that is stopped loses only the unit it was in; with ``--out``, each finished
run is also copied to ``e2e_runs/`` beside it. ``--budget-s`` bounds one call: a unit starts only
when its estimated time fits in what is left, and a run ends by the deadline it was given, loading,
compiling and capturing included. ``--carry REPORT`` fills a fresh machine's cache with an earlier
report's units measured with the same settings (marked ``measured: false``, ``carried_from``).

The report (format 4; `report` defines each figure): per configuration the steady step (steps
``--skip``..N-1) split into rollout (of it: the tail), reward, train and drafter, the first step
(``step0_s``) and the whole run (``run_s``), lengths and curves; ``ratios`` pooled over the seeds and
``per_seed``: ``a_over_b_step``, ``a_over_b_tokens_per_s``, ``a_over_b_run`` with bootstrap 95 %
intervals, ``tlt_step0_over_nospec_step0``; ``tlt_over_trl_step`` (steady over steady) and
``tlt_over_trl_first_step``; the "no accuracy loss" verdict (format 4: judged against a standard error that
allows for correlated steps, `report.no_accuracy_loss`). Every run unit carries ``provenance``.

GPU: ``python -m benchmarks.e2e`` (or ``python benchmarks/e2e.py``), repeated on the still-warm
machine until the report is whole. CPU smoke check of the whole pipeline, TRL and the cap included
(tiny model, about a minute; caches under .cache/e2e_smoke/, writes under benchmarks/results/smoke/):
``python -m benchmarks.e2e --smoke``.
"""

from __future__ import annotations

try:  # as benchmarks.e2e (python -m), or as e2e with benchmarks/ on the path (the script, the tests)
    from .._common import write_results
except ImportError:
    from _common import write_results  # type: ignore[no-redef]

from .arms import StepRecorder, run_lightning, run_trl
from .main import main
from .options import E2EOptions, parse_args
from .report import autocorr_lag, newey_west_stderr, no_accuracy_loss, recompute, section
from .workload import carry, run_file, stage_dir, workload_key

__all__ = ["E2EOptions", "StepRecorder", "autocorr_lag", "carry", "main", "newey_west_stderr", "no_accuracy_loss",
           "parse_args", "recompute", "run_file", "run_lightning", "run_trl", "section", "stage_dir", "workload_key", "write_results"]
