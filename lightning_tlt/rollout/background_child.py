"""The background compile's child: ``python -m lightning_tlt.rollout.background_child RECIPE PARENT_PID``.

Builds an engine of the parent's shapes from the recipe, runs one speculative ``generate`` and so stores
every speculative version (`lightning_tlt.rollout.background_compile` says why and how the parent uses
them). A module of its own: it imports the engine, which imports the parent's side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from lightning_tlt.core import stored_compile
from lightning_tlt.rollout.background_compile import (
    PROMPT_PERIOD,
    SPAWNED_ENV,
    CompileRecipe,
    apply_global_state,
    check_global_state,
    dtype_named,
)


def run(recipe: CompileRecipe) -> dict[str, Any]:
    """The child's work: the parent's engine shapes, one speculative ``generate``, every version stored.

    Its report holds the wall time of each phase: ``startup_s`` (from the parent's spawn to here: the
    interpreter, torch and the kit imported; ``None`` when not spawned by `BackgroundCompile`), ``build_s`` (the
    model and engine), ``generate_s`` (the speculative ``generate``, every compile in it) and ``seconds`` (build
    and generate).
    """
    import transformers  # noqa: F401 - imported here, not in `_compile`: its seconds are the start's, not the build's

    import lightning_tlt.rollout.engine  # noqa: F401

    start = time.perf_counter()
    spawned = os.environ.get(SPAWNED_ENV)
    startup_s = max(0.0, time.time() - float(spawned)) if spawned else None
    apply_global_state(recipe.global_state)
    with contextlib.ExitStack() as stack:  # the parent's autocast; `generate` runs without grad, as it did there
        for device_type, dtype in recipe.autocast.items():
            stack.enter_context(torch.autocast(device_type, dtype=dtype_named(dtype)))
        with torch.no_grad():
            check_global_state(recipe.global_state)  # first: a child of no use stops before building anything
        return {**_compile(recipe, start), "startup_s": startup_s}


def _compile(recipe: CompileRecipe, start: float) -> dict[str, Any]:
    import transformers

    from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
    from lightning_tlt.drafters.eagle import EagleDrafter
    from lightning_tlt.rollout.engine import RolloutEngine

    device = torch.device(recipe.device)
    cls = getattr(transformers, recipe.model_class)
    config = cls.config_class.from_dict(recipe.model_config)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype_named(recipe.model_dtype))  # built in its dtype: no float32 model on the way
    try:
        with torch.device(device):
            model = cls(config).eval().requires_grad_(recipe.requires_grad)
    finally:
        torch.set_default_dtype(default)  # the parent's (a guard reads it)
    parent = SpeculativeConfig(**{**recipe.speculative, "draft_candidates": tuple(recipe.speculative["draft_candidates"])})
    longest = parent.num_draft_tokens or max(parent.draft_candidates)
    # speculating from the second step at the longest draft length: the buffers stay the parent's (their widths
    # follow the longest draft), and every draft length shares the versions this compiles
    spec = dataclasses.replace(parent, hysteresis_steps=1, num_draft_tokens=longest)
    engine = RolloutEngine(model, speculative=spec, use_cuda_graphs=False, compile=True, log_compile=False,
                           progress=False, background_compile=False, **recipe.engine)
    ready: dict[str, float] = {}
    if recipe.staged_drafter is not None:
        engine.stage_drafter(EagleDrafter.from_target(
            engine.inference_copy.module if engine.inference_copy is not None else model,
            feature_layers=recipe.staged_drafter.get("feature_layers"),
            dtype=dtype_named(recipe.staged_drafter["dtype"]),
        ))
        _tell_when_staged_compiled(engine, recipe.ready_path, start, ready)
    built = time.perf_counter()
    prompts = [[PROMPT_PERIOD[(i + j) % len(PROMPT_PERIOD)] for j in range(recipe.prompt_len)] for i in range(recipe.rows)]
    sampling = SamplingConfig(max_new_tokens=recipe.max_new_tokens, stop_token_ids=[], **recipe.sampling)
    out = engine.generate(prompts, sampling, generator=torch.Generator().manual_seed(0))
    end = time.perf_counter()
    return {"seconds": end - start, "build_s": built - start, "generate_s": end - built, "ready_s": ready.get("ready_s"),
            "spec_steps": out.stats.get("spec/steps", 0.0),
            "stored_compile": stored_compile.stats(), "by_function": stored_compile.stats_by_function()}


def _tell_when_staged_compiled(engine: Any, ready_path: str | None, start: float, ready: dict[str, float]) -> None:
    """Write ``ready_path`` once the engine has compiled (and stored) the staged EAGLE drafter's steps.

    The engine compiles them ahead, at its first speculative step (`compile_staged_drafter`), before the model-free
    drafter's own verify: a parent that drafts with EAGLE may speculate from the file on. Written only where every
    version compiled, and whole (a temporary file renamed), so the parent never reads half of it. A child whose
    engine drafts with EAGLE itself stages nothing and writes no file: its parent waits for its exit."""
    compile_staged = engine.compile_staged_drafter

    def compile_and_tell(*args: Any, **kwargs: Any) -> bool:
        if not compile_staged(*args, **kwargs):
            return False  # a version failed: the parent must not speculate on steps that are not stored
        ready["ready_s"] = time.perf_counter() - start
        if ready_path is not None:
            path = Path(ready_path)
            part = path.with_name(path.name + ".part")
            part.write_text(json.dumps(ready))
            os.replace(part, path)
        return True

    engine.compile_staged_drafter = compile_and_tell


def _exit_with_parent(parent_pid: int) -> None:
    """End this process when its parent has gone (a killed run leaves no compile running on its GPU)."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        raise SystemExit("usage: python -m lightning_tlt.rollout.background_child RECIPE.json PARENT_PID")
    _exit_with_parent(int(args[1]))
    print("RESULT " + json.dumps(run(CompileRecipe.read(args[0])), default=float), flush=True)


__all__ = ["main", "run"]

if __name__ == "__main__":
    main()
