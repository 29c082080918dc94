"""One call: the stages it was asked for, each unit cached as it ends, then the report from every cached unit."""

from __future__ import annotations

import datetime as dt
import json
import platform
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_tlt.rl.warmstart import warm_start_dir

from . import write_results
from .arms import device_name, run_lightning, run_trl
from .options import E2EOptions, parse_args
from .plots import plot
from .report import print_table, section
from .workload import (
    FORMAT,
    Budget,
    cached_drafter,
    carry,
    load_json,
    log,
    run_file,
    stage_dir,
    warm_policy,
    warm_start_config,
    workload_key,
)


class Section:
    """The units of one section of the report (the main one at ``--max-new``, or the ``cap`` one): where
    they are cached, and how each is measured when missing and the budget allows."""

    def __init__(self, args: E2EOptions, policy_dir: Path, drafter_dir: Path | None, budget: Budget,
                 recomputed: list[str], drafter_args: E2EOptions | None = None) -> None:
        self.args, self.policy_dir, self.drafter_dir, self.budget = args, policy_dir, drafter_dir, budget
        self.recomputed = recomputed
        self.parts = stage_dir(args, policy_dir, "runs", drafter_args)
        self.trl_dir = stage_dir(args, policy_dir, "trl")
        self.tag = "" if drafter_args is None else f" (cap {args.max_new})"  # in the log
        self.suffix = "" if drafter_args is None else f"/cap{args.max_new}"  # in recomputed_this_call

    def estimate(self) -> float:
        """A run's wall time: b's measured total (a runs b's steps), else the first guess."""
        done = [r for s in self.args.seed_list if (r := load_json(self.parts / run_file(self.args, "nospec", s)))]
        return done[0]["total_s"] * 1.15 + 30 if done else self.args.est_run_s

    def run_arm(self, name: str, seed: int, out: str | None) -> None:
        """b (``nospec``) first, then a (``tlt``) over b's steps; each cached as soon as it ends."""
        args, path = self.args, self.parts / run_file(self.args, name, seed)
        what = f"{name}, seed {seed}{self.tag}"
        if path.is_file():
            log(f"{what}: cached")
            return
        b = load_json(self.parts / run_file(args, "nospec", seed))
        if name == "tlt" and b is None:
            return  # a runs as many steps as b did: b first
        if not self.budget.allows(self.estimate(), what):
            return
        steps = len(b["steps"]) if name == "tlt" and b is not None else args.steps
        run = run_lightning(name, args, seed, self.policy_dir, self.drafter_dir if name == "tlt" else None, steps,
                            self.budget.left() - 10)  # fmt: skip
        text = json.dumps(run, default=float)
        path.write_text(text)
        if out:  # beside the report too: a later run the watchdog ends writes no report
            beside = Path(out).parent / "e2e_runs" / f"{self.parts.name}_{path.name}"
            beside.parent.mkdir(parents=True, exist_ok=True)
            beside.write_text(text)
        self.recomputed.append(f"{name}/seed{seed}{self.suffix}")

    def run_trl(self) -> None:
        """c, unless a unit of all ``--trl-steps`` steps is cached; a shorter one (an earlier call's budget
        ran out) is kept unless this call measures more steps."""
        path = self.trl_dir / "trl.json"
        cached = load_json(path)
        if cached is not None and len(cached["step_s"]) >= self.args.trl_steps:
            log(f"trl{self.tag}: cached")
            return
        if not self.budget.allows(self.args.trl_budget_s + 60, f"trl{self.tag}"):
            return
        seed = self.args.seed_list[0]
        run = run_trl(self.args, seed, self.policy_dir, min(self.args.trl_budget_s, self.budget.left() - 10))
        if cached is not None and len(cached["step_s"]) >= len(run["step_s"]):
            log(f"trl{self.tag}: {len(run['step_s'])} steps, no more than the cached unit's: kept that one")
            return
        path.write_text(json.dumps(run, default=float))
        self.recomputed.append(f"trl{self.suffix}")

    def units(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Every cached unit of the section: a and b by seed, and c."""
        runs = [r for s in self.args.seed_list for n in ("tlt", "nospec")
                if (r := load_json(self.parts / run_file(self.args, n, s)))]
        trl = load_json(self.trl_dir / "trl.json")
        return runs, [trl] if trl else []


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    if args.smoke and not cuda:  # a tiny model's ops gain nothing from threads: one is 4x faster on 2 cores
        torch.set_num_threads(1)
    budget = Budget(args.budget_s)
    stages = args.stages
    log(f"workload {workload_key(args)}: {args.task} d{args.difficulty}, {args.size}, {args.prompts} prompts x "
        f"{args.generations}, max {args.max_new} new tokens (cap {args.cap}); stages {sorted(stages)}")
    recomputed: list[str] = []
    old = json.loads(Path(args.carry).read_text()) if args.carry else None
    if old is not None and old.get("workload") != workload_key(args):  # before any work
        raise ValueError(f"--carry {args.carry}: its workload {old.get('workload')!r} is not this call's "
                         f"{workload_key(args)!r}")

    policy_dir = warm_start_dir(warm_start_config(args))
    warm: dict[str, Any] = {}
    drafter_dir: Path | None = stage_dir(args, policy_dir, "drafter") / "drafter"
    if stages:
        policy_dir, warm["policy"] = warm_policy(args, device)
        if warm["policy"]["recomputed"]:
            recomputed.append("policy warm start")
    if stages & {"warmstart", "ab", "cap"}:
        drafter_dir, warm["drafter"] = cached_drafter(args, policy_dir, device, dtype)
        if warm["drafter"]["recomputed"]:
            recomputed.append("drafter warm start")

    main_ = Section(args, policy_dir, drafter_dir, budget, recomputed)
    capped = Section(args.capped(), policy_dir, drafter_dir, budget, recomputed, args) if args.cap else None
    carried: list[str] = []
    if old is not None:
        name = Path(str(args.carry)).name
        carried = carry(args, old, name, main_.parts, main_.trl_dir)
        if capped is not None and old.get("capped") and old["args"].get("cap") == args.cap:
            carried += [f"{u}/cap{args.cap}" for u in carry(capped.args, old, name, capped.parts, capped.trl_dir, True)]
        log(f"carried from {name}: {', '.join(carried) or 'nothing (other settings, or already cached)'}")

    # a and b seed by seed, then the cap's a, b and c, then c at --max-new (the longest unit, and the one
    # that may not fit at all: last)
    if "ab" in stages:
        for seed in args.seed_list:
            for name in ("nospec", "tlt"):
                main_.run_arm(name, seed, args.out)
    if "cap" in stages and capped is not None:
        for seed in capped.args.seed_list:
            for name in ("nospec", "tlt"):
                capped.run_arm(name, seed, args.out)
        capped.run_trl()
    if "trl" in stages:
        main_.run_trl()
    log(f"recomputed this call: {', '.join(recomputed) or 'nothing (all cached)'}")
    return report(args, main_, capped, warm, recomputed, carried)


def report(args: E2EOptions, main_: Section, capped: Section | None, warm: dict[str, Any], recomputed: list[str],
           carried: list[str]) -> dict[str, Any]:
    """The report (format 2) from every cached unit: written, printed and plotted."""
    runs, trl_runs = main_.units()
    cuda = torch.cuda.is_available()
    results: dict[str, Any] = {
        "benchmark": "e2e",
        "format": FORMAT,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "card": device_name(),
        "versions": {"torch": torch.__version__, "lightning": pl.__version__, "python": platform.python_version()},
        "args": args.settings(),
        "workload": workload_key(args),
        "warm_start": warm,
        "recomputed_this_call": recomputed,
        "carried_this_call": carried,
        **section(runs, trl_runs, args.skip),
        "runs": runs,
        "trl_runs": trl_runs,
        "capped": None,
    }
    if capped is not None:
        cruns, ctrl = capped.units()
        results["capped"] = {"max_new": capped.args.max_new, **section(cruns, ctrl, args.skip), "runs": cruns,
                             "trl_runs": ctrl}
    for module in ("transformers", "trl"):
        try:
            results["versions"][module] = __import__(module).__version__
        except ImportError:
            pass
    if results["summary"]:
        print_table(results, f"max {args.max_new} new tokens")
    if capped is not None and results["capped"]["summary"]:
        print_table(results["capped"], f"the shared cap: max {capped.args.max_new} new tokens")
    if args.plots and runs:
        plot(results, runs, Path(args.plots))
    write_results(results, "e2e", smoke=args.smoke, cuda=cuda, out=args.out)
    return results
