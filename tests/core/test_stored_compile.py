"""Compiled versions stored on disk: a round trip without tracing, dispatch by guards, bad files rebuilt."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import compilation_time_metrics

from lightning_tlt.core import stored_compile
from lightning_tlt.core.stored_compile import MAGIC, CompileStore, StoredCompile

pytestmark = pytest.mark.skipif(not stored_compile.aot_enabled(), reason="torch without aot_compile")


def scaled_softmax(x: torch.Tensor, scale: float, bias: torch.Tensor | None) -> torch.Tensor:
    """A step-like function: a float constant, an optional tensor, a reduction."""
    y = x * scale
    if bias is not None:
        y = y + bias
    return torch.softmax(y, dim=-1)


def _traces() -> int:
    """Dynamo traces made in this process so far (the plain path's counter: ahead-of-time versions add none)."""
    return len(compilation_time_metrics.get("_compile.compile_inner", ()))


def _files(directory: Path) -> list[Path]:
    return sorted((directory / "aot").glob("scaled_softmax-*/*.bin"))


@pytest.fixture(autouse=True)
def _fresh_process() -> None:
    stored_compile.reset()


def _store(directory: Path, *, restart: bool = False, **key: object) -> StoredCompile:
    """``scaled_softmax`` stored under ``directory``; ``restart``: as a new process would (nothing held)."""
    if restart:
        stored_compile.reset()
    return CompileStore(directory, {"model": "toy", **key}).compile(scaled_softmax, dynamic_dims=lambda x, *_: {0: [0]})


def test_a_new_process_object_loads_the_stored_version_and_runs_it_without_tracing(tmp_path: Path) -> None:
    x, bias = torch.randn(5, 7), torch.randn(7)
    first = _store(tmp_path)
    before = dict(stored_compile.stats())
    torch.testing.assert_close(first(x, 0.5, bias), scaled_softmax(x, 0.5, bias))
    assert stored_compile.stats()["compiled"] == before["compiled"] + 1
    (path,) = _files(tmp_path)
    data = path.read_bytes()
    assert data.startswith(MAGIC)
    header = json.loads(data[len(MAGIC) : data.index(b"\n", len(MAGIC))])
    assert header["key"]["model"] == "toy" and header["key"]["versions"]["torch"] == torch.__version__
    assert f"{__name__}" in header["sources"]  # the traced module's source digest

    second, traces = _store(tmp_path, restart=True), _traces()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = second(torch.randn(9, 7), 0.5, bias)  # another row count: the stored version's rows are dynamic
    assert out.shape == (9, 7) and torch.allclose(out.sum(-1), torch.ones(9))
    assert second.num_versions == 1 and stored_compile.stats()["loaded"] == before["loaded"] + 1
    assert stored_compile.stats()["compiled"] == before["compiled"] + 1  # nothing compiled again
    assert _traces() == traces


def test_loading_starts_no_compile_worker_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # measured on an H100 (issue 29): a warm restart's loaded kernels started Inductor's worker pool, one
    # process a core importing torch for seconds, and the steady calls after it ran at a quarter of their
    # speed (the GPU's kernels unchanged; the host waited on the CPU). Versions load with one compile thread.
    from torch._dynamo.aot_compile import AOTCompiledFunction
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import get_compile_threads

    x = torch.randn(5, 7)
    _store(tmp_path)(x, 0.5, None)
    deserialize = AOTCompiledFunction.deserialize
    seen: list[int] = []

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(get_compile_threads())  # what decides whether a kernel's load asks for the pool
        return deserialize(*args, **kwargs)

    monkeypatch.setattr(AOTCompiledFunction, "deserialize", staticmethod(recording))
    with inductor_config.patch(compile_threads=8):  # a many-core host's setting
        second = _store(tmp_path, restart=True)
        torch.testing.assert_close(second(x, 0.5, None), scaled_softmax(x, 0.5, None))
        assert seen == [1]  # one thread while loading: no pool
        assert inductor_config.compile_threads == 8  # and the setting back for versions compiled later


def test_arguments_a_version_does_not_accept_compile_a_second_version_and_both_are_stored(tmp_path: Path) -> None:
    # an earlier compile of the same code in this process (automatic dynamic shapes once made the later
    # versions' guards reject their own arguments: each call compiled again, and a restart too)
    _store(tmp_path / "earlier")(torch.randn(5, 7), 0.5, torch.randn(7))
    store = _store(tmp_path)
    x = torch.randn(4, 7)
    ref_none = store(x, 0.5, None)  # no bias: a version of its own
    ref_bias = store(x, 0.5, torch.ones(7))
    ref_scale = store(x, 2.0, None)  # floats are specialised: another constant is another version
    assert store(x, 0.5, None) is not None and store.num_versions == 3 and len(_files(tmp_path)) == 3
    loaded = _store(tmp_path, restart=True)
    torch.testing.assert_close(loaded(x, 0.5, None), ref_none)
    torch.testing.assert_close(loaded(x, 0.5, torch.ones(7)), ref_bias)
    torch.testing.assert_close(loaded(x, 2.0, None), ref_scale)
    assert loaded.num_versions == 3  # each call found its own version among the loaded ones
    torch.testing.assert_close(ref_scale, scaled_softmax(x, 2.0, None))


def test_one_version_serves_views_and_whole_tensors_of_any_marked_size(tmp_path: Path) -> None:
    # a marked size is one version for views of a buffer and for whole tensors alike, counted by
    # function. (Marked on a view, the regions of the policy's forward, whose inputs are outputs of
    # other compiled regions, got guards on ``_base`` that every later call failed:
    # tests/rollout/test_policy_regions.py catches that; this toy did not reproduce it.)
    store = _store(tmp_path)
    before = stored_compile.stats_by_function().get("scaled_softmax", {"compiled": 0, "compile_s": 0.0})
    buffer = torch.randn(16, 7)
    outputs = [store(x, 0.5, None) for x in (torch.randn(4, 7), torch.randn(6, 7), buffer[:5], buffer[:3])]
    assert store.num_versions == 1 and len(_files(tmp_path)) == 1
    torch.testing.assert_close(outputs[2], scaled_softmax(buffer[:5], 0.5, None))
    after = stored_compile.stats_by_function()["scaled_softmax"]
    assert after["compiled"] - before["compiled"] == 1 and after["compile_s"] > before["compile_s"]


def test_the_cap_counts_versions_compiled_in_this_process_and_disk_keeps_the_recently_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # stored versions a run never asks for (another run's sampling constants) once counted toward the cap:
    # a folder holding MAX_VERSIONS of them made every new version fall back to plain torch.compile
    monkeypatch.setattr(stored_compile, "MAX_VERSIONS", 2)
    x = torch.randn(3, 7)
    old = _store(tmp_path)
    for scale in (3.0, 4.0):  # two versions another run compiled and stored
        old(x, scale, None)
    assert len(_files(tmp_path)) == 2
    used = _store(tmp_path, restart=True)
    before = dict(stored_compile.stats())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fall-back warns
        for scale in (3.0, 0.5, 0.25):  # one stored version used again, two compiled here: no fall-back
            torch.testing.assert_close(used(x, scale, None), scaled_softmax(x, scale, None))
    after = stored_compile.stats()
    assert after["fell_back"] == before["fell_back"] and after["compiled"] == before["compiled"] + 2
    assert used.num_versions == 4  # two loaded, two compiled: all held, only the compiled ones counted
    # on disk, the MAX_VERSIONS most recently used: 0.5 and 0.25 (3.0 was used before them, 4.0 not at all)
    assert len(_files(tmp_path)) == 2
    reloaded = _store(tmp_path, restart=True)
    compiled = stored_compile.stats()["compiled"]
    reloaded(x, 0.25, None), reloaded(x, 0.5, None)
    assert stored_compile.stats()["compiled"] == compiled and reloaded.num_versions == 2
    # a loaded version's first use marks it recently used: 0.5 now outlives 0.25 when 2.0 is compiled
    reloaded(x, 2.0, None)
    kept = _store(tmp_path, restart=True)
    kept(x, 0.5, None), kept(x, 2.0, None)
    assert stored_compile.stats()["compiled"] == compiled + 1  # 2.0 compiled once, then both found on disk
    kept(x, 0.25, None)
    assert stored_compile.stats()["compiled"] == compiled + 2  # 0.25 was the least recently used: deleted
    with pytest.warns(UserWarning, match="more than 2 versions compiled in this process"):
        capped = _store(tmp_path, restart=True)
        for scale in (5.0, 6.0, 7.0):
            torch.testing.assert_close(capped(x, scale, None), scaled_softmax(x, scale, None))


def _flip_payload(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _rewrite_header(path: Path, change: str) -> None:
    data = path.read_bytes()
    end = data.index(b"\n", len(MAGIC))
    header = json.loads(data[len(MAGIC) : end])
    if change == "stale":
        header["sources"][__name__] = "0" * 64  # compiled from other source code of this module
    else:
        header["key"]["model"] = "another"  # a file of another model copied into this folder
    path.write_bytes(MAGIC + json.dumps(header).encode() + data[end:])


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "stale", "foreign", "garbage"])
def test_a_bad_file_is_rebuilt_with_one_warning_and_the_right_output(tmp_path: Path, damage: str) -> None:
    x, bias = torch.randn(3, 7), torch.randn(7)
    _store(tmp_path)(x, 1.5, bias)
    (path,) = _files(tmp_path)
    if damage == "corrupt":
        _flip_payload(path)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "garbage":
        path.write_bytes(b"not a compiled function")
    else:
        _rewrite_header(path, damage)
    before = dict(stored_compile.stats())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _store(tmp_path, restart=True)(x, 1.5, bias)
    torch.testing.assert_close(out, scaled_softmax(x, 1.5, bias))
    messages = [str(w.message) for w in caught if "stored compile" in str(w.message)]
    assert len(messages) == 1 and "compiling afresh" in messages[0], [str(w.message) for w in caught]
    assert stored_compile.stats()["discarded"] == before["discarded"] + 1
    assert stored_compile.stats()["compiled"] == before["compiled"] + 1
    (rebuilt,) = _files(tmp_path)  # the bad file replaced by a good one
    assert _store(tmp_path, restart=True)(x, 1.5, bias) is not None and stored_compile.stats()["discarded"] == before["discarded"] + 1


def test_another_key_or_library_version_uses_another_folder(tmp_path: Path) -> None:
    a = _store(tmp_path, dtype="float32")
    held = _store(tmp_path, dtype="float32")  # the same function and key: one set of versions in a process
    a(torch.randn(2, 7), 1.0, None)
    assert held.num_versions == a.num_versions == 1
    b = _store(tmp_path, dtype="bfloat16")
    assert a.folder is not None and b.folder is not None and a.folder != b.folder
    assert a.folder.parent == tmp_path / "aot" and a.folder.name.startswith("scaled_softmax-")


def test_off_by_the_environment_or_without_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(2, 7)
    assert not CompileStore(None).compile(scaled_softmax).stored
    monkeypatch.setenv(stored_compile.ENV_VAR, "0")
    plain = _store(tmp_path)
    assert not plain.stored
    torch.testing.assert_close(plain(x, 1.0, None), scaled_softmax(x, 1.0, None))
    assert not (tmp_path / "aot").exists()


def test_the_compiled_wrapper_is_made_under_the_flag_that_gives_it_aot_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch 2.11 (the GPU machines' build) attaches `aot_compile` to the wrapper only when Dynamo's
    # `enable_aot_compile` is on as `torch.compile` is called; made outside the flag, every step function
    # fell back to plain torch.compile on the H100 (2026-12-06) and restarts traced as before
    real = torch.compile

    def compile_as_211(fn: object, **kwargs: object) -> object:
        wrapped = real(fn, **kwargs)  # type: ignore[call-overload]
        if torch._dynamo.config.enable_aot_compile:
            return wrapped
        return lambda *args, **kw: wrapped(*args, **kw)  # no aot_compile attribute

    monkeypatch.setattr(torch, "compile", compile_as_211)
    before = stored_compile.stats()
    x = torch.randn(5, 7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fall-back warns
        torch.testing.assert_close(_store(tmp_path)(x, 0.5, None), scaled_softmax(x, 0.5, None))
    after = stored_compile.stats()
    assert after["fell_back"] == before["fell_back"] and after["compiled"] == before["compiled"] + 1
    assert len(_files(tmp_path)) == 1


def linear_relu(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A region that takes a trainable module, as the drafter's catch-up and chained rows do."""
    return layer(x).relu()


def test_a_trained_module_is_stored_through_its_frozen_view_and_follows_its_optimizer(tmp_path: Path) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4)
    layer(torch.randn(3, 4)).sum().backward()  # a co-trained module: its parameters carry a .grad
    view = stored_compile.frozen_view(layer)
    assert isinstance(view, torch.nn.Linear) and [n for n, _ in view.named_parameters()] == ["weight", "bias"]
    for mine, theirs in zip(view.parameters(), layer.parameters(), strict=True):
        assert mine.data_ptr() == theirs.data_ptr() and not mine.requires_grad and mine.grad is None
        assert theirs.requires_grad and theirs.grad is not None  # the module itself is untouched
    x = torch.randn(6, 4)
    first = CompileStore(tmp_path, {"model": "toy"}).compile(linear_relu, dynamic=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="could not")  # stored ("could not store" with the module itself)
        torch.testing.assert_close(first(view, x), linear_relu(layer, x).detach())
    assert len(list((tmp_path / "aot").glob("linear_relu-*/*.bin"))) == 1
    torch.optim.SGD(layer.parameters(), lr=0.5).step()  # in place: the view sees the new weights
    stored_compile.reset()  # as a new process
    before = dict(stored_compile.stats())
    second, traces = CompileStore(tmp_path, {"model": "toy"}).compile(linear_relu, dynamic=True), _traces()
    torch.testing.assert_close(second(view, x), linear_relu(layer, x).detach())
    after = stored_compile.stats()
    assert after["loaded"] == before["loaded"] + 1 and after["compiled"] == before["compiled"] and _traces() == traces


def test_a_frozen_view_reaches_modules_held_outside_the_registry_and_names_their_storage() -> None:
    # an EAGLE drafter holds the policy's embedding and head by reference, outside its registry
    shared = torch.nn.Embedding(10, 4)
    shared.weight.grad = torch.ones_like(shared.weight)
    layer = torch.nn.Linear(4, 4)
    object.__setattr__(layer, "_embed", shared)
    object.__setattr__(shared, "_owner", layer)  # a cycle: one view each
    view = stored_compile.frozen_view(layer)
    held = view._embed  # type: ignore[attr-defined]
    assert held is not shared and held.weight.grad is None and not held.weight.requires_grad
    assert held.weight.data_ptr() == shared.weight.data_ptr() and held._owner is view
    assert [n for n, _ in view.named_parameters()] == ["weight", "bias"]  # the registry is unchanged
    key = stored_compile.storage_key(layer)
    assert key == (layer.weight.data_ptr(), layer.bias.data_ptr(), shared.weight.data_ptr())
    shared.weight.data = shared.weight.data.clone()
    assert stored_compile.storage_key(layer) != key
