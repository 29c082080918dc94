"""The engine's persistent compile cache: a round trip between processes, and bad files rebuilt, never fatal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from lightning_tlt.core import stored_compile
from lightning_tlt.core.compile_cache import MAGIC, CompileCache, resolve_cache_dir
from lightning_tlt.core.stored_compile import ENV_VAR
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine

ENGINE_RUN = """
import json, sys, torch
from torch._dynamo.utils import compilation_time_metrics, counters
from lightning_tlt.core import stored_compile
from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rollout.engine import RolloutEngine

cache, spec, temperature = sys.argv[1], sys.argv[2] == "eagle", float(sys.argv[3])
speculative = SpeculativeConfig(method="eagle", threshold=8, num_draft_tokens=3, draft_vocab_size=None) if spec else None
engine = RolloutEngine(build_model("qwen2", "tiny", seed=0), max_seq_len=48 if spec else 24, max_batch_size=4 if spec else 2,
                       compile=True, compile_cache=cache if cache != "off" else False, log_compile=False,
                       speculative=speculative)
prompts = [[5, 6, 7], [8, 9], [3, 4, 5, 6]] if spec else [[5, 6, 7], [8, 9]]
out = engine.generate(prompts, SamplingConfig(temperature=temperature, max_new_tokens=12 if spec else 6, stop_token_ids=[]),
                      generator=torch.Generator().manual_seed(0))
print("RESULT " + json.dumps({"tokens": out.completion_ids, "hits": counters["inductor"]["fxgraph_cache_hit"],
                              "misses": counters["inductor"]["fxgraph_cache_miss"], "stored": stored_compile.stats(),
                              "traces": len(compilation_time_metrics.get("_compile.compile_inner", ())),
                              "spec_steps": engine.last_stats.get("spec/steps", 0.0)}))
"""


def _run(cache: str, inductor_dir: Path, *, spec: str = "none", temperature: float = 0.0,
         aot: bool = True) -> dict[str, Any]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "PYTHONPATH": os.pathsep.join(sys.path),
           ENV_VAR: "1" if aot else "0"}
    proc = subprocess.run([sys.executable, "-c", ENGINE_RUN, cache, spec, str(temperature)], env=env,
                          capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "compiling it with torch.compile" not in proc.stderr, proc.stderr[-4000:]  # no step fell back
    return cast(dict[str, Any], json.loads(line[len("RESULT ") :]))


def test_a_second_process_loads_the_stored_steps_without_tracing_with_the_same_greedy_tokens(tmp_path: Path) -> None:
    # each process has its own empty Inductor cache (PyTorch's, in the temp folder on a real machine):
    # only the kit's files can carry the first process's work to the second
    cache = tmp_path / "compile"
    first = _run(str(cache), tmp_path / "inductor-a")
    assert first["stored"]["compiled"] >= 2 and first["traces"] == 0  # decode forward and update, ahead of time
    assert len(list((cache / "aot").glob("*/*.bin"))) == first["stored"]["compiled"]
    second = _run(str(cache), tmp_path / "inductor-b")
    assert second["traces"] == 0 and second["stored"]["compiled"] == 0, second  # nothing traced or compiled
    assert second["stored"]["loaded"] == first["stored"]["compiled"] and second["stored"]["discarded"] == 0
    uncached = _run("off", tmp_path / "inductor-c")
    assert uncached["stored"]["compiled"] == 0 and uncached["traces"] > 0  # plain torch.compile
    assert uncached["hits"] == 0 and not (tmp_path / "inductor-c" / "compile").exists()
    assert first["tokens"] == second["tokens"] == uncached["tokens"]


def test_with_stored_steps_off_a_second_process_compiles_from_the_runs_inductor_cache(tmp_path: Path) -> None:
    cache = tmp_path / "compile"
    first = _run(str(cache), tmp_path / "inductor-a", aot=False)
    files = list(cache.glob("steps-*.bin"))
    assert len(files) == 1 and files[0].read_bytes().startswith(MAGIC) and not (cache / "aot").exists()
    assert first["misses"] > 0 and first["hits"] == 0 and first["traces"] > 0
    second = _run(str(cache), tmp_path / "inductor-b", aot=False)
    assert second["hits"] > 0 and second["misses"] == 0, second  # Inductor's work came from the file; tracing ran
    assert second["traces"] > 0 and first["tokens"] == second["tokens"]


@pytest.mark.slow
def test_speculative_rollouts_are_token_identical_cold_restarted_and_with_plain_compile(tmp_path: Path) -> None:
    # T = 1 with the EAGLE drafter: the verify, draft and catch-up steps stored and loaded too; the
    # keyed sampling noise makes the tokens a function of the compiled code's outputs only
    cache = tmp_path / "compile"
    cold = _run(str(cache), tmp_path / "inductor-a", spec="eagle", temperature=1.0)
    warm = _run(str(cache), tmp_path / "inductor-b", spec="eagle", temperature=1.0)
    plain = _run(str(tmp_path / "plain"), tmp_path / "inductor-c", spec="eagle", temperature=1.0, aot=False)
    assert cold["spec_steps"] > 0 and cold["stored"]["compiled"] >= 5
    assert warm["stored"]["compiled"] == 0 and warm["traces"] == 0
    assert warm["stored"]["loaded"] == cold["stored"]["compiled"]
    assert cold["tokens"] == warm["tokens"] == plain["tokens"], (cold, warm, plain)


@pytest.mark.slow
@pytest.mark.skipif(not stored_compile.aot_enabled(), reason="torch without aot_compile")
def test_stored_steps_compile_one_version_per_use_and_a_restart_loads_them_all(tmp_path: Path) -> None:
    # the stored path compiles without Dynamo's automatic dynamic shapes, so a size the engine does not
    # mark dynamic would make a version per value: the e2e's shape of calls (suffix drafter, then EAGLE,
    # several batch buckets and draft lengths) must compile the twelve versions plain compile makes
    # (tests/rollout/test_spec_step.py), none after the calls that first meet them, and a restart none.
    # The first call: the policy's regions for decode and verify (embeddings, the layer every layer runs,
    # the head: 2 each) and both updates; the third, EAGLE's four steps
    from lightning_tlt.drafters.eagle import EagleDrafter

    def run() -> list[float]:
        policy = build_model("qwen2", "tiny", seed=0)
        engine = RolloutEngine(policy, max_batch_size=32, max_seq_len=200, compile=True, use_cuda_graphs=False,
                               speculative=SpeculativeConfig(method="suffix", threshold=16),
                               compile_cache=str(tmp_path / "compile"))  # fmt: skip
        assert engine.tuner is not None
        engine.tuner.cost_model = lambda k, rows: 1e-3 * (1 + 0.1 * k)
        prompts = [[3, 17, 25, 9, 40, 11][: 3 + i % 4] for i in range(8)]
        compiled = []
        for call in range(5):
            if call == 2:
                engine.set_drafter(EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(1)))
            before = stored_compile.stats()["compiled"]
            sampling = SamplingConfig(temperature=1.0, max_new_tokens=60 + 30 * (call % 3), stop_token_ids=[5])
            engine.generate(prompts, sampling, num_samples=4, generator=torch.Generator().manual_seed(30 + call))
            compiled.append(stored_compile.stats()["compiled"] - before)
        assert engine.compile_failures == []
        return compiled

    stored_compile.reset()
    start = stored_compile.stats()
    assert run() == [8, 0, 4, 0, 0]
    stored_compile.reset()  # as a restart: nothing held, everything on disk
    assert run() == [0, 0, 0, 0, 0]
    end = stored_compile.stats()
    assert end["loaded"] - start["loaded"] == 12 and end["fell_back"] == start["fell_back"]


def _fresh(tmp_path: Path, key: dict[str, object] | None = None) -> CompileCache:
    # each test's own folder: no file of it was loaded in this process yet, as in a fresh process
    return CompileCache(tmp_path, key or {"model": "m"})


def _write(cache: CompileCache, key: dict[str, object], blobs: list[bytes], sha: list[str] | None = None) -> None:
    import hashlib

    metas = [{"bytes": len(b), "sha256": (sha or [hashlib.sha256(x).hexdigest() for x in blobs])[i]}
             for i, b in enumerate(blobs)]  # fmt: skip
    cache.path.write_bytes(MAGIC + json.dumps({"key": key, "blobs": metas}).encode() + b"\n" + b"".join(blobs))


@pytest.mark.parametrize(
    "damage",
    ["checksum", "truncated", "foreign", "not_a_cache", "unreadable_artifacts"],
)
def test_a_bad_cache_file_is_removed_with_one_warning_and_nothing_raised(tmp_path: Path, damage: str) -> None:
    cache = _fresh(tmp_path)
    key = json.loads(json.dumps(cache.key, default=str))
    if damage == "checksum":
        _write(cache, key, [b"abc"], sha=["0" * 64])
    elif damage == "truncated":
        _write(cache, key, [b"abcdef"])
        cache.path.write_bytes(cache.path.read_bytes()[:-3])
    elif damage == "foreign":
        _write(cache, {**key, "model": "another"}, [b"abc"])
    elif damage == "not_a_cache":
        cache.path.write_bytes(b"\x00garbage")
    else:  # a well-formed file whose blob PyTorch cannot read
        _write(cache, key, [b"not pickled artifacts"])
    with pytest.warns(UserWarning, match=r"compile cache .* is unusable .*compiling afresh") as caught:
        assert cache.load() is False
    assert len(caught) == 1 and not cache.path.exists() and not cache.loaded


def test_a_file_is_loaded_once_per_process_and_save_writes_nothing_without_artifacts(tmp_path: Path) -> None:
    cache = _fresh(tmp_path)
    assert cache.load() is False and cache.load() is False  # no file; and not looked at again
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        saved = cache.save()
    assert saved == cache.path.exists()  # a process that compiled nothing with Inductor writes nothing


def test_the_key_names_the_model_the_device_and_the_library_versions(tmp_path: Path) -> None:
    a = CompileCache(tmp_path, {"model": {"hidden": 64}, "dtype": "torch.bfloat16"})
    b = CompileCache(tmp_path, {"model": {"hidden": 128}, "dtype": "torch.bfloat16"})
    assert a.path != b.path and a.path.parent == b.path.parent
    assert a.key["versions"]["torch"] == torch.__version__ and "triton" in a.key["versions"]


def test_the_cache_directory_setting(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LIGHTNING_TLT_CACHE", str(tmp_path))
    monkeypatch.delenv("LIGHTNING_TLT_COMPILE_CACHE", raising=False)
    assert resolve_cache_dir(None) == tmp_path / "compile" == resolve_cache_dir(True)
    assert resolve_cache_dir(False) is None
    assert resolve_cache_dir(tmp_path / "x") == tmp_path / "x"
    for off in ("0", "false", "OFF", "no"):
        monkeypatch.setenv("LIGHTNING_TLT_COMPILE_CACHE", off)
        assert resolve_cache_dir(None) is None
    monkeypatch.setenv("LIGHTNING_TLT_COMPILE_CACHE", str(tmp_path / "elsewhere"))
    assert resolve_cache_dir(None) == tmp_path / "elsewhere"
    assert resolve_cache_dir(False) is None  # the engine's own False wins
