"""The benchmark's options: one typed dataclass, and the small argument layer that reads its flags.

Every field is a flag of the same name with dashes (``sft_steps``: ``--sft-steps``); its attribute
docstring is the flag's help. `parse_args` keeps the flags, defaults and checks the script had.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import textwrap
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_tlt.drafters import side_streams

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("warmstart", "ab", "trl", "cap")


@dataclass
class E2EOptions:
    """What one call of the end-to-end benchmark runs (see the package's docstring)."""

    stage: str = "all"
    """Comma-separated: warmstart, ab, trl, cap (a, b and c at ``--cap``), or all (the report always)."""
    budget_s: float = 560.0
    """Wall time of this call (units that do not fit wait for the next call)."""
    task: str = "countdown_search"
    difficulty: int = 3
    """countdown_search level (4: correctness 0 after the warm start)."""
    arch: str = "qwen2"
    size: str = "0.5b"
    sft_steps: int = 1000
    """SFT steps of the policy's warm start: 1,000 is the reports' workload since the ninth session (600, the
    default until 2026-12-05, left a policy with correctness 0.05 and short tails: p99 1,100 against 3,300)."""
    sft_batch: int = 32
    """Sequences per SFT step (fewer when long)."""
    sft_batch_tokens: int | None = 16384
    """Most padded tokens per SFT batch."""
    sft_lr: float = 5e-4
    sft_max_length: int | None = 4160
    """SFT sequences are cut here."""
    sft_max_time_s: float = 300.0
    """The policy warm start stops by then (1,000 steps take about 270 s on the H200)."""
    drafter_prompts: int = 32
    """Prompts of the drafter's warm-up rollouts."""
    drafter_samples: int = 2
    drafter_steps: int = 600
    drafter_lr: float = 1e-3
    """Offline warm-up learning rate."""
    cotrain_lr: float = 1e-4
    """Co-training learning rate in the stalls."""
    stall_steps: int = 4
    """Most drafter steps queued at one stall event (0: the drafter is not trained in the stalls, only
    warm-started; splits speculation from the stall training)."""
    side_stream_sms: int | str | None = "auto"
    """a: the SMs of the drafter's stall steps (DrafterTrainConfig.side_stream_sms): auto (its default, a
    quarter of the device's: 32 on an H100 or H200), all (every SM; the reports before 2026-12-08) or a count."""
    verification: Literal["rejection", "coupled"] = "rejection"
    """a: how drafts are verified (SpeculativeConfig.verification, both lossless): rejection sampling, or
    coupled with the plain sampler (the same tokens as speculation off for the same seed)."""
    deterministic: bool = False
    """a: the draft-length tuner and the drafter's stall pacing decide from counted tokens and steps,
    never from the clock (SpeculativeConfig.deterministic, DrafterCoTrainConfig.deterministic)."""
    steps: int = 20
    """RL steps of configurations a and b."""
    skip: int = 2
    """First steps left out of the steady means (compile, capture); the whole-run figures keep them."""
    trl_steps: int = 3
    """TRL's steps (its first is left out of its steady mean: at least 2 for a steady figure)."""
    trl_budget_s: float = 480.0
    """TRL runs steps while the next one fits in it."""
    prompts: int = 8
    """Prompts per RL step."""
    generations: int = 8
    max_new: int = 4096
    lr: float = 1e-5
    micro_batch: int = 4
    """Rows per training forward: TRL's per_device_train_batch_size, and a and b's
    GRPOConfig.micro_batch_size when --micro-batch-tokens is 0."""
    master_weights: Literal["float32", "bfloat16"] = "float32"
    """a and b on the GPU: float32 weights under bf16-mixed (rollouts from a bf16 copy), or the weights
    in bf16 (AdamW steps of --lr mostly round away)."""
    micro_batch_tokens: int = 16384
    """a and b: most padded tokens per training forward (GRPOConfig.micro_batch_tokens; 0: rows only);
    16,384 holds the logits of 4 rows of 4,096 tokens, as --micro-batch 4 does."""
    threshold: int = 32
    """Speculation gate / stall threshold (active rows)."""
    seeds: str = "0,1,2"
    """Comma-separated seeds of a and b (TRL runs the first)."""
    cap: int | None = None
    """A shared shorter max completion length: stage ``cap`` runs b, a and c at it over --cap-seeds,
    reported in a section of its own (``capped``), for when TRL's steps at --max-new do not fit."""
    cap_seeds: str = "0"
    """Comma-separated seeds of the ``cap`` stage's a and b (TRL runs the first)."""
    cap_steps: int | None = None
    """RL steps of the ``cap`` stage's a and b (default: --steps)."""
    est_run_s: float = 360.0
    """First guess of one run (a or b), loading and capture included."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Engine options of a and b as JSON, e.g. '{"use_cuda_graphs": false}' or '{"fuse_projections": true}'."""
    watchdog_s: float = 30.0
    """a and b: a step still running this long after its run's deadline prints every thread's stack and
    ends the process (the runs cached before it are kept); 0: off."""
    step_timeout_s: float = 0.0
    """a and b: a step after the first (which compiles and captures) still running this long does what
    --watchdog-s does; 0: off."""
    cache_dir: str = str(ROOT / ".cache" / "lightning_tlt")
    out: str | None = None
    carry: str | None = None
    """An earlier report's JSON (same workload, format 2): its runs measured with this call's settings
    fill the cache where it has none (a fresh machine then measures only what is missing)."""
    commit: str | None = None
    """The code's commit, recorded in each measured unit's provenance (default: ``git rev-parse HEAD``
    where the checkout has its git folder, else "unknown")."""
    plots: str = str(ROOT / "docs" / "img")
    smoke: bool = False
    """Tiny sizes on the CPU: the whole pipeline, TRL and the cap included, in about a minute."""

    def __post_init__(self) -> None:
        stages = {s.strip() for s in self.stage.split(",") if s.strip()}
        if stages - {*STAGES, "all", "report"}:
            raise ValueError(f"--stage takes {', '.join(STAGES)}, report or all, got {self.stage!r}")
        if self.carry is not None and not Path(self.carry).is_file():
            raise ValueError(f"--carry takes an earlier report's JSON file, got {self.carry!r} (no such file)")
        if self.step_timeout_s < 0 or self.watchdog_s < 0:
            raise ValueError(f"--step-timeout-s and --watchdog-s must be >= 0 (0: off), got {self.step_timeout_s} "
                             f"and {self.watchdog_s}")
        if not side_streams.is_setting(self.side_stream_sms):
            raise ValueError(f"--side-stream-sms takes auto, all or a count >= 1, got {self.side_stream_sms!r}")
        if self.stall_steps < 0:
            raise ValueError(f"--stall-steps must be >= 0 (0: no drafter steps in the stalls), got {self.stall_steps}")
        if self.cap is not None and not 1 <= self.cap <= self.max_new:
            raise ValueError(f"--cap must be in [1, --max-new = {self.max_new}], got {self.cap}")
        steps = min(self.steps, self.cap_steps or self.steps)
        if self.trl_steps < 1 or not 0 <= self.skip < steps:
            raise ValueError(f"--trl-steps must be >= 1 and --skip in [0, --steps and --cap-steps), got trl_steps "
                             f"{self.trl_steps}, skip {self.skip}, steps {self.steps}, cap_steps {self.cap_steps}")
        for name in ("seeds", "cap_seeds"):
            try:
                [int(s) for s in getattr(self, name).split(",")]
            except ValueError as err:
                raise ValueError(f"--{name.replace('_', '-')} takes comma-separated integers, got "
                                 f"{getattr(self, name)!r}") from err

    @property
    def stages(self) -> set[str]:
        """The stages this call runs (the report is written whatever they are)."""
        stages = {s.strip() for s in self.stage.split(",") if s.strip()}
        return set(STAGES) if "all" in stages else stages & set(STAGES)

    @property
    def seed_list(self) -> list[int]:
        return [int(s) for s in self.seeds.split(",")]

    @property
    def cap_seed_list(self) -> list[int]:
        return [int(s) for s in self.cap_seeds.split(",")]

    def capped(self) -> E2EOptions:
        """These options at the shared cap (``max_new = cap``): the ``cap`` section's runs, cached by it."""
        assert self.cap is not None
        return dataclasses.replace(self, max_new=self.cap, seeds=self.cap_seeds, steps=self.cap_steps or self.steps,
                                   carry=None)

    def settings(self) -> dict[str, Any]:
        """The options as the report records them (``args``)."""
        return dataclasses.asdict(self)


SMOKE: dict[str, Any] = dict(
    size="tiny", difficulty=1, sft_steps=30, sft_batch=32, sft_max_time_s=20.0, sft_max_length=None,
    sft_batch_tokens=None, drafter_prompts=4, drafter_steps=4, steps=3, skip=1, trl_steps=3, trl_budget_s=60.0,
    prompts=4, generations=4, max_new=48, cap=32, threshold=4, micro_batch=8, seeds="0", lr=1e-4, budget_s=300.0,
    est_run_s=20.0,
)
"""``--smoke``: tiny sizes on the CPU; a flag given explicitly still wins."""


def engine_options(text: str) -> dict[str, Any]:
    """``--engine``: a JSON object of `RolloutEngine` options."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): {text!r}") from err
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of engine options, e.g. '{{\"use_cuda_graphs\": false}}', got {text!r}")
    return value


def sms_option(text: str) -> int | str | None:
    """``--side-stream-sms``: ``auto``, ``all`` (every SM: ``None``) or a count."""
    if text in ("auto", "all"):
        return None if text == "all" else text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"auto, all or a count of SMs, got {text!r}") from None


def attribute_docs(cls: type) -> dict[str, str]:
    """A dataclass's attribute docstrings (the string right below each field), by field name."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs = {}
    for node, after in zip(body.body, body.body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def parser() -> argparse.ArgumentParser:
    """The e2e's flags: one per `E2EOptions` field, its help the field's docstring (`parse_args` reads them)."""
    from . import __doc__ as description

    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter,
                                argument_default=argparse.SUPPRESS)  # only the flags given: smoke keeps the rest
    docs, hints = attribute_docs(E2EOptions), typing.get_type_hints(E2EOptions)
    for f in dataclasses.fields(E2EOptions):
        flag, hint, help_ = f"--{f.name.replace('_', '-')}", hints[f.name], docs.get(f.name)
        if hint is bool:
            p.add_argument(flag, action="store_true", help=help_)
            continue
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is Literal:
            p.add_argument(flag, choices=args, help=help_)
        elif f.name == "engine":
            p.add_argument(flag, type=engine_options, help=help_)
        elif f.name == "side_stream_sms":
            p.add_argument(flag, type=sms_option, help=help_, metavar="{auto,all,N}")
        else:
            kind = args[0] if args else hint  # X | None: X
            p.add_argument(flag, type=kind, help=help_, metavar="REPORT" if f.name == "carry" else None)
    return p


def parse_args(argv: list[str] | None = None) -> E2EOptions:
    """The options from command-line flags (`E2EOptions`' checks run here, before any work)."""
    given = vars(parser().parse_args(argv))
    if given.get("smoke"):
        smoke = ROOT / ".cache" / "e2e_smoke"
        results = ROOT / "benchmarks" / "results" / "smoke"  # git-ignored, like every benchmark's smoke output
        given = {**SMOKE, "cache_dir": str(smoke / "lightning_tlt"), "plots": str(results / "img"),
                 "out": str(results / "e2e_smoke.json"), **given}
    return E2EOptions(**given)
