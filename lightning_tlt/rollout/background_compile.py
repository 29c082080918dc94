"""Compile the speculative step functions in another process while this one decodes without them.

A compiled engine's first speculative steps compile their functions (the verify forward's query of
``k + 1`` tokens, the verify update, the EAGLE drafter's catch-up, chain and draft sampling): on an
H100 the e2e's TLT arm spent 49.5 s of its first RL step compiling them, where speculation off
compiled 3 s. Stored versions (`lightning_tlt.core.stored_compile`) make every later process load them
in seconds, but the first process on a machine pays. With ``background_compile`` on, an engine whose
store holds no speculative versions yet starts a child process at its first ``generate``
(``python -m lightning_tlt.rollout.background_child RECIPE PARENT_PID``, `lightning_tlt.rollout.background_child`) that builds an engine of the same shapes
(the policy's architecture with random weights, the same slots, cache length, dtype, attention backend,
projections, speculative buffers and sampling settings), runs a short speculative ``generate`` (and the
staged EAGLE drafter's compile ahead), and stores every version it compiles. Meanwhile the engine
decodes without speculation; when the child has exited it looks again for stored versions
(`stored_compile.refresh`) and speculation starts, loading what the child stored. The child compiles the
staged EAGLE drafter's steps first and then says so in a file (`CompileRecipe.ready_path`), before the
model-free drafter's verify: an engine that drafts with EAGLE by then speculates from that file on
(`BackgroundCompile.eagle_ready`). A child that fails costs nothing but its log (one warning): the engine
then compiles in-process what it did not store, as without it.

Versions are reused across processes only where their guards accept the arguments (the same
shapes and settings); the recipe carries every setting the engine's compiled functions depend on,
so the child's versions are the parent's. The child holds its own CUDA context, a copy of the
policy's weights in their dtype and a KV cache of the same size while it runs.

Opt-in: ``RolloutEngine(background_compile=True)`` or ``LIGHTNING_TLT_BACKGROUND_COMPILE=1``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_tlt.core import stored_compile
from lightning_tlt.core.compile_cache import env_off

ENV_VAR = "LIGHTNING_TLT_BACKGROUND_COMPILE"
"""``1``, ``true``, ``on`` or ``yes``: engines with ``background_compile=None`` compile speculation in the background."""

TIMEOUT_S = 1800.0
"""A child still compiling after this long is stopped (with a warning) and the engine compiles in-process."""

NICENESS = 10
"""The child's (and its compile workers') CPU priority below this process's: its compile is background work, and the
decode loop's host thread must not wait on it."""

SPAWNED_ENV = "LIGHTNING_TLT_BACKGROUND_SPAWNED"
"""Set for the child: the wall-clock time (``time.time()``) it was spawned at, so its report can say how long its
start (the interpreter, torch and the kit imported) took."""

READY_POLL_S = 0.2
"""How often (seconds) `BackgroundCompile.eagle_ready` looks for the child's file: it is asked at every decode step."""

PROMPT_PERIOD = (11, 12, 13, 14)
"""The child's prompts repeat this pattern, so that the suffix drafter finds drafts in them at once."""


def env_on() -> bool:
    """Whether `ENV_VAR` turns background compiling on."""
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "on", "yes")


@dataclass
class CompileRecipe:
    """What the child needs to compile the parent's speculative versions (JSON in a file)."""

    model_class: str
    """The HF class of the policy, by name in ``transformers`` (e.g. ``Qwen2ForCausalLM``)."""
    model_config: dict[str, Any]
    model_dtype: str
    """The dtype of the weights the engine decodes from (the policy's, or its copy's in the engine's dtype)."""
    device: str
    engine: dict[str, Any]
    """`RolloutEngine` keyword arguments: the parent's slots, cache length, dtype, attention backend, projections."""
    speculative: dict[str, Any]
    """The parent's `SpeculativeConfig` fields."""
    sampling: dict[str, Any]
    """The parent's sampling settings (``temperature``, ``top_k``, ``top_p``): constants of the compiled steps."""
    staged_drafter: dict[str, Any] | None
    """``{"feature_layers": ..., "dtype": ...}`` of the EAGLE drafter the parent staged, or ``None``."""
    global_state: dict[str, Any] = dataclasses.field(default_factory=dict)
    """What Dynamo's guards read of the process's global state in the parent's ``generate`` (`global_state`):
    threads, TF32, reduced-precision reductions, default dtype, deterministic algorithms, autocast."""
    autocast: dict[str, str] = dataclasses.field(default_factory=dict)
    """Device types whose autocast was on in the parent's ``generate``, and its dtype."""
    requires_grad: bool = True
    """Whether the decoded weights require grad (a copy's do not): the compiled forward guards on it."""
    ready_path: str | None = None
    """A file the child writes once the EAGLE drafter's steps are stored (`BackgroundCompile.eagle_ready`), before it
    compiles the model-free drafter's verify; ``None``: none is written."""
    prompt_len: int = 16
    rows: int = 4
    max_new_tokens: int = 24

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(dataclasses.asdict(self), indent=1, default=str))
        return path

    @classmethod
    def read(cls, path: str | Path) -> CompileRecipe:
        return cls(**json.loads(Path(path).read_text()))


_SCALAR_TYPES = {5: torch.float16, 6: torch.float32, 7: torch.float64, 15: torch.bfloat16}
"""c10's ScalarType codes of the default dtypes Dynamo's global-state guard records."""


def global_state() -> dict[str, Any]:
    """Dynamo's global-state guard as of now (a compiled version is run only where it holds)."""
    state: dict[str, Any] = json.loads(str(torch._C._dynamo.guards.GlobalStateGuard().__getstate__()))
    return state


def autocast_state() -> dict[str, str]:
    """The device types whose autocast is on now, with its dtype."""
    return {d: str(torch.get_autocast_dtype(d)).removeprefix("torch.") for d in ("cpu", "cuda")
            if torch.is_autocast_enabled(d)}


def apply_global_state(state: dict[str, Any]) -> None:
    """Set what can be set of the parent's global state (the rest is checked by `check_global_state`)."""
    if "num_threads" in state:
        torch.set_num_threads(int(state["num_threads"]))
    if "allow_tf32" in state:
        torch.backends.cuda.matmul.allow_tf32 = bool(state["allow_tf32"])
    if state.get("default_dtype") in _SCALAR_TYPES:
        torch.set_default_dtype(_SCALAR_TYPES[state["default_dtype"]])
    if "deterministic_algorithms" in state:
        torch.use_deterministic_algorithms(bool(state["deterministic_algorithms"]),
                                           warn_only=bool(state.get("deterministic_algorithms_warn_only")))


def check_global_state(wanted: dict[str, Any]) -> None:
    """Stop before compiling anything when this process's global state differs from the parent's: its versions
    would be of no use there."""
    mine = global_state()
    differ = sorted(k for k in wanted if mine.get(k) != wanted[k])
    if differ:
        raise SystemExit(f"global state differs from the parent's in {differ}: "
                         f"{ {k: (mine.get(k), wanted[k]) for k in differ} } (this process, the parent)")


def dtype_named(name: str) -> torch.dtype:
    value = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


class BackgroundCompile:
    """A child process compiling the speculative versions of ``recipe`` (see the module's docstring).

    Args:
        recipe: what to compile.
        folder: where the recipe and the child's log are written.
    """

    def __init__(self, recipe: CompileRecipe, folder: Path) -> None:
        stamp = f"{os.getpid()}-{time.time_ns()}"
        if recipe.staged_drafter is not None and recipe.ready_path is None:
            recipe = dataclasses.replace(recipe, ready_path=str(folder / f"ready-{stamp}.json"))
        self.ready_path = None if recipe.ready_path is None else Path(recipe.ready_path)
        """The file the child writes once the EAGLE drafter's steps are stored (``None``: it has none to compile)."""
        self.ready_s: float | None = None
        """The child's wall time (from its spawn) when it had stored them, once seen."""
        self._ready_checked = 0.0
        self.recipe_path = recipe.write(folder / f"recipe-{stamp}.json")
        self.log_path = folder / f"log-{stamp}.txt"
        env = {**os.environ, ENV_VAR: "0", SPAWNED_ENV: f"{time.time():.6f}"}
        # half the cores for the child's compile workers: this process keeps decoding meanwhile
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
        self.started = time.perf_counter()
        self.seconds: float | None = None
        """Wall time of the child, once it has exited."""
        self.ok: bool | None = None
        """Whether it exited cleanly (``None``: still running)."""
        self.result: dict[str, Any] | None = None
        """A clean child's report (its ``RESULT`` line: seconds, and what each function compiled and stored)."""
        with open(self.log_path, "wb") as log:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                [sys.executable, "-m", "lightning_tlt.rollout.background_child", str(self.recipe_path),
                 str(os.getpid())],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        self.niceness = _lower_priority(self._proc.pid)
        """How far below this process's CPU priority the child runs (0 where the system cannot lower it)."""

    def poll(self) -> bool:
        """Whether the child has exited (cheap: one ``waitpid``); the first time it has, the engine's versions
        are looked up again (`stored_compile.refresh`), and a failure is warned about once."""
        if self._proc is None:
            return True
        code = self._proc.poll()
        if code is None:
            if time.perf_counter() - self.started < TIMEOUT_S:
                return False
            self._proc.kill()
            self._proc.wait()
            warnings.warn(f"the background compile of the speculative steps ran past {TIMEOUT_S:.0f} s and was "
                          f"stopped (log {self.log_path}); the engine compiles them itself", stacklevel=3)
            code = None
        self._finish(code)
        return True

    def eagle_ready(self) -> bool:
        """Whether the EAGLE drafter's steps are stored: the child said so (its file, looked for at most every
        `READY_POLL_S`), or it exited cleanly. The first time, the engine's versions are looked up again
        (`stored_compile.refresh`): an engine drafting with EAGLE speculates from then on, while the child goes on
        compiling the model-free drafter's verify."""
        if self.ready_s is not None:
            return True
        if self._proc is None:
            return bool(self.ok)
        now = time.perf_counter()
        if self.ready_path is None or now - self._ready_checked < READY_POLL_S:
            return False
        self._ready_checked = now
        if not self.ready_path.is_file():
            return False
        self.ready_s = now - self.started
        stored_compile.refresh()
        return True

    def eagle_summary(self) -> str:
        """One console line: the EAGLE drafter's steps are stored while the child still compiles."""
        return (f"the EAGLE drafter's speculative steps were compiled in the background in {self.ready_s or 0.0:.1f} s; "
                "speculating with it while the background process compiles the model-free drafter's verify")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the child exits (or ``timeout`` seconds pass); returns `poll`."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return False
        return self.poll()

    def close(self) -> None:
        """Stop the child if it still runs (nothing it stored is lost: each version's file is written whole)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
            self._finish(None)

    def _finish(self, code: int | None) -> None:
        self._proc = None
        self.seconds = time.perf_counter() - self.started
        self.ok = code == 0
        stored_compile.refresh()
        if self.ready_path is not None:  # read or not, it says nothing once the child has gone
            self.ready_path.unlink(missing_ok=True)
        if code == 0:  # the recipe and the log of a clean run are of no further use once its report is read
            self.result = _read_result(self.log_path)
            for path in (self.recipe_path, self.log_path):
                path.unlink(missing_ok=True)
        elif code is not None:
            try:
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
            except OSError as err:
                tail = [repr(err)]
            warnings.warn(f"the background compile of the speculative steps failed (exit code {code}; log "
                          f"{self.log_path}: {' | '.join(tail)}); the engine compiles them itself", stacklevel=3)

    def report(self) -> dict[str, Any]:
        """The child as data (a benchmark's record): ``finished``, ``ok``, ``seconds`` (its wall time, or so far),
        ``eagle_ready_s`` (when this process saw the EAGLE drafter's steps stored, ``None`` if it did not look before
        the child's end), its phases (``startup_s``, ``build_s``, ``generate_s``, and ``ready_s``: its build and
        generate up to the EAGLE steps stored), the seconds its generate spent compiling and loading (``compile_s``,
        ``load_s``) and ``by_function`` (compiled versions and seconds), the last six once it finished cleanly."""
        result = self.result or {}
        stored = result.get("stored_compile") or {}
        return {"finished": self._proc is None, "ok": self.ok,
                "seconds": self.seconds if self.seconds is not None else time.perf_counter() - self.started,
                "eagle_ready_s": self.ready_s,
                **{k: result.get(k) for k in ("startup_s", "build_s", "generate_s", "ready_s")},
                "compile_s": stored.get("compile_s"), "load_s": stored.get("load_s"),
                "by_function": result.get("by_function")}

    def summary(self) -> str:
        """One console line on the finished child: its wall time and what it compiled, function by function."""
        if not self.ok:
            if self.ready_s is not None:
                return ("the background compile did not finish after storing the EAGLE drafter's steps: the engine "
                        "speculates on those and compiles the model-free drafter's itself")
            return "the background compile did not finish: the engine compiles the speculative steps itself"
        report = self.report()
        line = f"the speculative steps were compiled in the background in {report['seconds']:.1f} s"
        phases = [f"{label} {report[key]:.1f} s" for key, label in
                  (("startup_s", "starting"), ("build_s", "building"), ("generate_s", "generating"),
                   ("ready_s", "the EAGLE steps stored after"))
                  if isinstance(report[key], (int, float))]
        parts = [f"{name} x{int(f['compiled'])} in {f['compile_s']:.1f} s"
                 for name, f in (report["by_function"] or {}).items() if f.get("compiled")]
        detail = "; ".join(x for x in (", ".join(phases), ", ".join(parts)) if x)
        tail = "speculating from now on" if self.ready_s is None else "the model-free drafter's steps stored too"
        return line + (f" ({detail})" if detail else "") + "; " + tail

    def __del__(self) -> None:  # an engine dropped mid-compile leaves no child behind
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def _lower_priority(pid: int) -> int:
    """Lower process ``pid``'s CPU priority by `NICENESS` (its children inherit it); the step taken, 0 if refused."""
    try:
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, pid, min(19, mine + NICENESS))
        return os.getpriority(os.PRIO_PROCESS, pid) - mine
    except (AttributeError, OSError):  # not POSIX, or the child has exited already
        return 0


def _read_result(log: Path) -> dict[str, Any] | None:
    """The child's ``RESULT`` line of ``log``, parsed (``None`` if there is none)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if line.startswith("RESULT "):
            try:
                value = json.loads(line[len("RESULT "):])
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None


def should_start(setting: bool | None) -> bool:
    """An engine's ``background_compile`` setting resolved: ``None`` follows `ENV_VAR` (off unless set)."""
    if setting is None:
        return env_on() and not env_off(stored_compile.ENV_VAR)
    return setting


__all__ = ["ENV_VAR", "BackgroundCompile", "CompileRecipe", "apply_global_state", "autocast_state", "check_global_state",
           "dtype_named", "env_on", "global_state", "should_start"]
