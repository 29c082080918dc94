"""Speculation compiled in a child process: the engine decodes without it meanwhile, then loads what the child stored."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from lightning_tlt.core import stored_compile
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.background_compile import (
    READY_POLL_S,
    BackgroundCompile,
    CompileRecipe,
    global_state,
)
from lightning_tlt.rollout.engine import RolloutEngine
from lightning_tlt.rollout.steps import SamplingKey

PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9, 10]]


def test_the_child_compiles_speculation_and_the_engine_loads_it(tmp_path: Path) -> None:
    # frozen, as an engine's bf16 copy of float32 master weights is: the compiled forward guards on requires_grad
    model = build_model("qwen2", "tiny", seed=0).requires_grad_(False)
    spec = SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=2, verification="coupled")
    engine = RolloutEngine(model, max_batch_size=8, max_seq_len=96, compile=True, speculative=spec,
                           compile_cache=tmp_path, background_compile=True, log_compile=False)
    engine.stage_drafter(EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(1)))
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, stop_token_ids=[])
    first = engine.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    job = engine.background_compile_job
    assert job is not None
    recipe = json.loads(job.recipe_path.read_text())
    assert recipe["engine"]["max_batch_size"] == 8 and recipe["sampling"]["temperature"] == 1.0
    assert recipe["staged_drafter"] == {"feature_layers": None, "dtype": "torch.float32"}
    assert recipe["requires_grad"] is False and recipe["model_dtype"] == "torch.float32"
    assert recipe["ready_path"] == str(job.ready_path) and job.ready_path.parent == job.recipe_path.parent
    assert first.stats["spec/steps"] == 0  # the child compiles far more than this call's plain decode: still running
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    assert job.niceness == min(19, mine + 10) - mine > 0  # background work: below the decoding process
    if job._proc is not None:  # still running: its priority is the lowered one
        assert os.getpriority(os.PRIO_PROCESS, job._proc.pid) == mine + job.niceness
    assert job.wait(900) and job.ok
    assert not job.log_path.exists() and not job.recipe_path.exists()  # a clean run leaves nothing behind
    assert job.ready_path is not None and not job.ready_path.exists()
    # the staged EAGLE drafter's steps were stored before the model-free drafter's verify compiled: the child said so
    assert job.result is not None and 0 < job.result["ready_s"] < job.result["seconds"]
    assert job.result is not None and job.result["by_function"]["verify_update"]["compiled"] >= 1
    assert "verify_update x" in job.summary() and job.summary().startswith("the speculative steps were compiled")
    # where the child's wall time went: its start (spawn to imports done), the build, the speculative generate
    phases = {k: job.result[k] for k in ("startup_s", "build_s", "generate_s", "seconds")}
    assert all(v > 0 for v in phases.values()) and phases["startup_s"] < job.seconds, phases
    assert phases["seconds"] == pytest.approx(phases["build_s"] + phases["generate_s"])
    assert phases["startup_s"] + phases["seconds"] <= job.seconds + 0.5
    assert "(starting " in job.summary() and ", generating " in job.summary()
    assert ", the EAGLE steps stored after " in job.summary()
    report = job.report()  # the same as data, for a benchmark's record
    assert report["finished"] and report["ok"] and report["seconds"] == job.seconds
    assert {k: report[k] for k in ("startup_s", "build_s", "generate_s")} == {k: phases[k] for k in ("startup_s", "build_s", "generate_s")}
    assert report["ready_s"] == job.result["ready_s"]
    assert report["by_function"]["verify_update"]["compiled"] >= 1 and report["compile_s"] > 0
    before = stored_compile.stats()
    second = engine.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    after = stored_compile.stats()
    assert second.stats["spec/steps"] > 0
    assert after["compiled"] == before["compiled"]  # every speculative version loaded from the child's files
    assert after["loaded"] - before["loaded"] >= 4  # the verify update, catch-up, chain and draft sampling at least
    # coupled verification: the plain sampler's tokens, whatever was drafted (the loaded versions are right)
    plain = RolloutEngine(model, max_batch_size=8, max_seq_len=96, compile=False)
    ref = plain.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
    assert second.completion_ids == ref.completion_ids
    assert engine.background_compile_job is job and job.poll()  # one child an engine


def test_a_warm_store_starts_no_child_and_off_starts_none(tmp_path: Path) -> None:
    model = build_model("qwen2", "tiny", seed=0)
    spec = SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=2)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=4, stop_token_ids=[])
    off = RolloutEngine(model, max_batch_size=4, max_seq_len=32, compile=False, speculative=spec,
                        compile_cache=tmp_path, background_compile=True)
    off.generate(PROMPTS, cfg)
    assert off.background_compile_job is None  # eager: nothing to compile
    unset = RolloutEngine(model, max_batch_size=4, max_seq_len=32, compile=True, speculative=spec,
                          compile_cache=False, background_compile=True)
    unset.generate(PROMPTS, cfg)
    assert unset.background_compile_job is None  # no compile cache: nothing a child could hand over


def test_a_child_that_fails_is_one_warning_and_the_engine_compiles_itself(tmp_path: Path) -> None:
    with torch.no_grad():  # as the engine records it, inside ``generate``
        state = global_state()
    recipe = CompileRecipe(model_class="NoSuchModelForCausalLM", model_config={}, model_dtype="float32", device="cpu",
                           engine={}, speculative={}, sampling={}, staged_drafter=None, global_state=state)
    job = BackgroundCompile(recipe, tmp_path)
    early = job.report()  # still importing torch: a record of a child that has not finished
    assert early["finished"] is False and early["ok"] is None and early["by_function"] is None
    assert 0 <= early["seconds"] < 60
    with pytest.warns(UserWarning, match=r"background compile of the speculative steps failed \(exit code 1; log "):
        assert job.wait(300)
    assert job.ok is False and "NoSuchModelForCausalLM" in job.log_path.read_text()
    late = job.report()
    assert late["finished"] is True and late["ok"] is False and late["seconds"] == job.seconds and late["compile_s"] is None


def test_a_child_whose_global_state_differs_stops_before_compiling(tmp_path: Path) -> None:
    with torch.no_grad():
        state = {**global_state(), "torch_function_all_disabled": True}  # a state the child cannot take on
    recipe = CompileRecipe(model_class="Qwen2ForCausalLM", model_config={}, model_dtype="float32", device="cpu",
                           engine={}, speculative={}, sampling={}, staged_drafter=None, global_state=state)
    job = BackgroundCompile(recipe, tmp_path)
    with pytest.warns(UserWarning, match="failed"):
        assert job.wait(300)
    assert "global state differs from the parent's in ['torch_function_all_disabled']" in job.log_path.read_text()


def test_an_eagle_engine_speculates_as_soon_as_the_child_has_stored_the_eagle_steps(tmp_path: Path) -> None:
    # the child stores the EAGLE drafter's steps first and says so in a file; the model-free drafter's verify
    # compiles after it: an engine that drafts with EAGLE speculates from the file on, not from the child's end
    model = build_model("qwen2", "tiny", seed=0).requires_grad_(False)
    spec = SpeculativeConfig(method="suffix", threshold=8, hysteresis_steps=1, verification="coupled")
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=24, stop_token_ids=[])

    def eagle_engine(background: bool) -> RolloutEngine:
        engine = RolloutEngine(model, max_batch_size=8, max_seq_len=96, compile=True, speculative=spec,
                               compile_cache=tmp_path, background_compile=background, log_compile=False)
        engine.set_drafter(EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(1)))
        return engine

    # what the child would store, compiled here first (the store of one process, read afresh below)
    assert eagle_engine(False).generate(PROMPTS, cfg, num_samples=2).stats["spec/steps"] > 0
    stored_compile.reset()
    engine = eagle_engine(True)
    with torch.no_grad():
        state = global_state()
    # a real child, held stopped: it is still "compiling" for as long as the test needs
    recipe = CompileRecipe(model_class="NoSuchModelForCausalLM", model_config={}, model_dtype="float32", device="cpu",
                           engine={}, speculative={}, sampling={}, global_state=state,
                           staged_drafter={"feature_layers": None, "dtype": "torch.float32"})
    job = BackgroundCompile(recipe, tmp_path / "background")
    os.kill(job._proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        engine._background, engine._background_tried = job, True
        before = engine.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
        assert before.stats["spec/steps"] == 0 and not job.eagle_ready()  # no file: plain decoding
        assert job.ready_path is not None
        job.ready_path.write_text(json.dumps({"ready_s": 1.0}))
        time.sleep(READY_POLL_S)
        compiled = stored_compile.stats()["compiled"]
        out = engine.generate(PROMPTS, cfg, num_samples=2, generator=torch.Generator().manual_seed(0))
        assert out.stats["spec/steps"] > 0  # speculating while the child still runs
        assert not job.poll() and job.report()["eagle_ready_s"] > 0
        assert stored_compile.stats()["compiled"] == compiled  # every EAGLE version loaded, none compiled here
        # coupled verification: the plain sampler's tokens (the loaded versions are right)
        plain = RolloutEngine(model, max_batch_size=8, max_seq_len=96, compile=False)
        assert out.completion_ids == plain.generate(PROMPTS, cfg, num_samples=2,
                                                    generator=torch.Generator().manual_seed(0)).completion_ids
        # a model-free drafter (drafting on the host) waits for the child's end: its verify is compiled last
        suffix = RolloutEngine(model, max_batch_size=8, max_seq_len=96, compile=True, speculative=spec,
                               compile_cache=tmp_path, background_compile=True, log_compile=False)
        suffix._background, suffix._background_tried = job, True
        assert suffix.generate(PROMPTS, cfg, num_samples=2).stats["spec/steps"] == 0
    finally:
        os.kill(job._proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        job.close()
    assert not job.ready_path.exists()  # stopped, not clean: its file says nothing more and goes too
    assert "after storing the EAGLE drafter's steps" in job.summary()
    # with nothing staged, the recipe names the EAGLE drafter the engine drafts with now: the child compiles its steps
    drafting = engine._spawn_background(SamplingKey(1.0, 0, 1.0))
    assert drafting is not None
    try:
        assert json.loads(drafting.recipe_path.read_text())["staged_drafter"] == {"feature_layers": None,
                                                                                  "dtype": "torch.float32"}
        assert drafting.ready_path is not None
    finally:
        drafting.close()


def test_the_child_writes_its_file_only_when_every_eagle_version_compiled(tmp_path: Path) -> None:
    from lightning_tlt.rollout.background_child import _tell_when_staged_compiled

    class Engine:  # the one method the child wraps: `RolloutEngine.compile_staged_drafter`'s result
        def __init__(self, ok: bool) -> None:
            self.ok = ok

        def compile_staged_drafter(self, *args: object) -> bool:
            return self.ok

    for ok in (False, True):
        path, ready = tmp_path / f"ready-{ok}.json", {}
        engine = Engine(ok)
        _tell_when_staged_compiled(engine, str(path), time.perf_counter(), ready)
        assert engine.compile_staged_drafter(4, None, None) is ok
        assert path.exists() is ok and ("ready_s" in ready) is ok  # a failed version: the parent must not speculate
        if ok:
            assert json.loads(path.read_text())["ready_s"] >= 0 and not path.with_name(path.name + ".part").exists()
