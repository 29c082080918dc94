"""`DecodeLoop`: one ``generate`` call of the native engine, from admission to the call's statistics.

Admission and prefill, then each step: the gate and the tuner choose ``k`` (0: plain decode), the
step is launched (plain, EAGLE on the device, or a host drafter's synchronous step), its finish
flags (and emitted counts) are copied to pinned memory and read one step late, finished rows are
harvested and the others repacked; listeners get a `StepEvent` after every step.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from lightning_tlt.core import stored_compile
from lightning_tlt.core.runner import unwrap_model
from lightning_tlt.core.sampling import PROB_FLOOR
from lightning_tlt.core.sharding import is_sharded
from lightning_tlt.core.types import (
    FinishReason,
    RolloutOutput,
    SamplingConfig,
    StepEvent,
)
from lightning_tlt.rollout.background_compile import (
    BackgroundCompile,
    CompileRecipe,
    autocast_state,
    global_state,
    should_start,
)
from lightning_tlt.rollout.compiling import say
from lightning_tlt.rollout.scheduler import Request, SlotScheduler
from lightning_tlt.rollout.spec_metrics import SpeculationMetrics
from lightning_tlt.rollout.step_runner import StepRunner
from lightning_tlt.rollout.steps import SamplingKey

if TYPE_CHECKING:
    from lightning_tlt.drafters.eagle import EagleDrafter

Results = dict[int, tuple[list[int], list[float]]]

ZERO_PROBABILITY_LOGPROB = math.log(PROB_FLOOR) + 0.05
"""An emitted token whose logprob is at or below this (the samplers clamp a probability at ``PROB_FLOOR``, and
the margin absorbs float32's rounding of its log) had probability 0 under the processed distribution: a
correct sampler never emits one (a token of probability below ``PROB_FLOOR`` is as good as never drawn), so
each is a sampler defect, counted in
``stats["zero_prob_tokens"]`` and warned about (the keyed noise's float32 rounding once did it silently)."""


@dataclass
class PendingStep:
    """A launched step whose finish flags (and emitted counts) are on their way to the host."""

    snapshot: list[Request]  # the request in each slot when the step was launched
    phase: str  # "decode" or "speculative"
    flags: Tensor  # (n,) bool, host side once ``event`` has completed
    emitted: Tensor | None  # (n,) long tokens each row appended (speculative steps)
    event: Any  # torch.cuda.Event | None
    k: int = 0  # tokens drafted per row (speculative steps)


@dataclass
class PhaseTimers:
    phase_s: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, seconds: float, tokens: int = 0) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds
        self.steps[phase] = self.steps.get(phase, 0) + 1
        self.tokens[phase] = self.tokens.get(phase, 0) + tokens


@dataclass
class CallState:
    """The bookkeeping of one ``generate`` call."""

    results: Results = field(default_factory=dict)
    timers: PhaseTimers = field(default_factory=PhaseTimers)
    pending: deque[PendingStep] = field(default_factory=deque)
    bounds: dict[int, int] = field(default_factory=dict)  # request index -> upper bound of its KV length
    compiling: dict[str, float] = field(default_factory=dict)  # `CompileTracker.end`: compiled, captured this call
    steps: int = 0
    tokens: int = 0
    last: float = 0.0
    bar: Any = None


class DecodeLoop(StepRunner):
    """The engine's decode loop (see the module's docstring)."""

    def _kv_len(self, run: CallState, active: Sequence[Request], q: int) -> int | None:
        """The SDPA path's KV bucket: a power of two above every row's length after this step (the
        Triton path reads each row's own length and needs none)."""
        assert self._cache is not None
        for r in active:
            run.bounds[r.index] += q
        if self.attention != "sdpa":
            return None
        if self._compiled:
            return None  # compiled: one shape for every length (a bucket per length would recompile)
        longest = max(run.bounds[r.index] for r in active)
        return min(self._cache.max_seq_len, max(64, 1 << (longest - 1).bit_length()))

    # ------------------------------------------------------------------ the loop
    def _generate_native(
        self, requests: list[Request], sampling: SamplingConfig, stop_ids: list[int], gen: torch.Generator, run: CallState
    ) -> None:
        self.allocate_buffers()
        self._check_params()
        st, graphs = self._state, self._graphs
        assert st is not None and graphs is not None
        st.begin(stop_ids, sampling.max_new_tokens)
        key = SamplingKey(sampling.temperature, sampling.top_k, sampling.top_p)
        self._scheduler = sched = SlotScheduler(st.num_slots, requests)
        self._prompt_features = {}
        self._speculative_steps = 0
        if self._spec_step is not None:
            assert self._gate is not None
            self._gate.reset()
            self._spec_step.begin(self._hf.lm_head)
        self._tracker.begin(graphs.stats)
        run.last = time.perf_counter()
        while True:
            admitted = sched.admit()
            if admitted:
                t0 = time.perf_counter()
                self._prefill(admitted)
                for _, r in admitted:
                    run.bounds[r.index] = len(r.prompt)
                dt = time.perf_counter() - t0
                run.timers.add("prefill", dt)
                run.steps += 1
                self._emit(StepEvent(run.steps, "prefill", sched.num_active, sched.num_queued, sched.num_slots, dt))
            n = sched.num_active
            if n:
                k = self._choose_k(n)
                if k == 0:
                    self._launch_plain(run, key, n)
                elif self._drafter_on_device():
                    self._launch_speculative(run, key, n, k)
                else:
                    self._host_speculative(run, key, k)
                    continue
            if not run.pending:
                if sched.done:
                    break
                continue
            # process the previous step's flags while this one runs (one step of lag, no bubble)
            if len(run.pending) > 1 or not n:
                self._process(run.pending.popleft(), run)
        self._finish_call(run)
        run.compiling = self._tracker.end(graphs.stats)

    def _start_background(self, sampling: SamplingKey) -> None:
        """At the first speculative engine call on a cold store: the child that compiles speculation
        (`lightning_tlt.rollout.background_compile`), if ``background_compile`` is on."""
        if self._background_tried or self._spec_step is None or not self._compiled:
            return
        self._background_tried = True
        if (not should_start(self._background_setting) or self._compile_cache_dir is None
                or not stored_compile.aot_enabled() or self._spec_step.versions_stored()
                or (self._copy is not None and is_sharded(unwrap_model(self._model)))
                or (torch.distributed.is_available() and torch.distributed.is_initialized()
                    and torch.distributed.get_world_size() > 1)):
            return  # off, nothing stored between processes, compiled already; sharded or several ranks: not covered
        try:
            self._background = self._spawn_background(sampling)
        except Exception as err:  # noqa: BLE001 - the engine compiles in-process, as without the option
            warnings.warn(f"could not start the background compile of the speculative steps ({err!r}); the engine "
                          "compiles them itself", stacklevel=2)
            return
        if self._background is not None and self._tracker.report:
            say(f"compiling the speculative steps in a background process (log {self._background.log_path}); "
                "decoding without speculation until they are stored")

    def _spawn_background(self, sampling: SamplingKey) -> BackgroundCompile | None:
        """The child, with a recipe of this engine's shapes and settings; ``None`` where it would not fit the GPU."""
        hf, cache_dir = self._hf, self._compile_cache_dir
        # the EAGLE drafter the engine will speculate with: the staged one, else the one drafting now (its steps are
        # compiled first, and the child says when: `BackgroundCompile.eagle_ready`)
        staged = self.staged_drafter or (cast("EagleDrafter", self._drafter) if self._drafter_on_device() else None)
        assert cache_dir is not None  # `_start_background` starts none without one
        if self.device.type == "cuda":  # the child holds the decode weights and a KV cache as large as this one's
            assert self._cache is not None
            need = sum(p.numel() * p.element_size() for p in hf.parameters()) + self._cache.nbytes
            free, _ = torch.cuda.mem_get_info(self.device)
            if free < 2 * need + (2 << 30):
                warnings.warn(f"not compiling speculation in the background: the child needs about {need / 2**30:.1f} "
                              f"GiB and {free / 2**30:.1f} GiB are free", stacklevel=3)
                return None
        recipe = CompileRecipe(
            model_class=type(hf).__name__, model_config=hf.config.to_dict(),
            model_dtype=str(next(hf.parameters()).dtype), device=str(self.device),
            requires_grad=any(p.requires_grad for p in hf.parameters()),
            engine={"max_batch_size": self.num_slots, "max_seq_len": self.max_seq_len,
                    "dtype": str(self.dtype).removeprefix("torch."),
                    "attention": self._attention_setting, "fuse_projections": bool(self._runner and self._runner.fuse_projections),
                    "prefill_chunk_tokens": self._prefill_chunk_setting, "compile_cache": str(cache_dir)},
            speculative=dataclasses.asdict(self.speculative),
            sampling={"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p},
            staged_drafter=None if staged is None else {
                "feature_layers": None if staged.feature_layers is None else list(staged.feature_layers),
                "dtype": str(staged.fc.weight.dtype)},
            global_state=global_state(), autocast=autocast_state(), rows=max(2, min(4, self.num_slots)),
        )
        return BackgroundCompile(recipe, cache_dir / "background")

    def _choose_k(self, n: int) -> int:
        """Draft tokens for the next step over ``n`` rows: 0 (plain) unless the gate is on, then the tuner's."""
        if self._spec_step is None or self._gate is None or self._drafter is None:
            return 0
        if not self._background_tried and self._compiled:
            return 0  # the first step is plain: it compiles the plain steps before a background compile may start
        job = self._background
        if job is not None and job.poll():
            if not self._background_told:
                self._background_told = True
                if self._tracker.report:
                    say(job.summary())
        elif job is not None and not (self._drafter_on_device() and self._eagle_ready(job)):
            return 0  # the speculative steps are still compiling in the background: plain decoding meanwhile
        if not self._gate.update(n):
            return 0
        if self._tuner is None:
            return self.max_draft_tokens
        return self._tuner.choose(n)

    def _eagle_ready(self, job: BackgroundCompile) -> bool:
        """Whether the child has stored the EAGLE drafter's steps (the model-free drafter's verify may still be
        compiling): said once on the console."""
        if not job.eagle_ready():
            return False
        if not self._eagle_told:
            self._eagle_told = True
            if self._tracker.report:
                say(job.eagle_summary())
        return True

    def _launch_plain(self, run: CallState, key: SamplingKey, n: int) -> None:
        graphs = self._graphs
        assert graphs is not None
        active = list(self._scheduler.active)
        batch = graphs.bucket(n)
        kv_len = self._kv_len(run, active, 1)
        timing = self._tuner.start(0, n) if self._tuner is not None and self._gate is not None and self._gate.on else None
        captures = self._captures
        self._run_plain(batch, key, kv_len)
        if timing is not None and self._tuner is not None:
            self._tuner.stop(timing, n, captured=self._captures != captures)
        run.pending.append(self._flags(active, "decode"))
        if self._spec_step is not None:
            self._spec_step.plain_step()
            if not self._background_tried:  # after the plain steps' own compile: the child loads, not repeats, it
                self._start_background(key)

    def _launch_speculative(self, run: CallState, key: SamplingKey, n: int, k: int) -> None:
        """An EAGLE step: nothing is read back now (the flags and counts follow one step late)."""
        graphs, st = self._graphs, self._state
        assert graphs is not None and st is not None and st.spec is not None and self._spec_step is not None
        assert self._drafter is not None  # `_choose_k` speculates only with one
        active = list(self._scheduler.active)
        batch = graphs.bucket(n)
        kv_len = self._kv_len(run, active, k + 1)
        timing = self._tuner.start(k, n) if self._tuner is not None else None
        captures = self._captures
        self._spec_step.run(self.step_context(), active, batch, k, key, self._drafter, self._drafter_handle, kv_len)
        if timing is not None and self._tuner is not None:
            self._tuner.stop(timing, st.spec.emitted[:n], captured=self._captures != captures)
        self._speculative_steps += 1
        run.pending.append(self._flags(active, "speculative", k))

    def _host_speculative(self, run: CallState, key: SamplingKey, k: int) -> None:
        """A host drafter's step: it needs this step's tokens before the next draft, so it is synchronous."""
        while run.pending:  # settle the steps in flight: the drafter reads the rows' tokens
            self._process(run.pending.popleft(), run)
        sched, graphs, st = self._scheduler, self._graphs, self._state
        assert graphs is not None and st is not None and self._spec_step is not None and self._drafter is not None
        n = sched.num_active
        if n == 0:
            return
        active = list(sched.active)
        batch = graphs.bucket(n)
        kv_len = self._kv_len(run, active, k + 1)
        if self._staged is not None and not self._staged_compiled and self._compiled:
            self.compile_staged_drafter(batch, key, kv_len)
        timing = self._tuner.start(k, n) if self._tuner is not None else None
        t0, captures = time.perf_counter(), self._captures
        new_tokens = self._spec_step.run(self.step_context(), active, batch, k, key, self._drafter,
                                         self._drafter_handle, kv_len)
        assert new_tokens is not None
        emitted = sum(len(t) for t in new_tokens)
        if timing is not None and self._tuner is not None:
            self._tuner.stop(timing, emitted, captured=self._captures != captures)
        self._speculative_steps += 1
        done = [s for s, f in enumerate(st.finished[:n].tolist()) if f]
        if done:
            self._harvest(done, run.results)
        dt = time.perf_counter() - t0
        self._account(run, "speculative", emitted, dt, k)
        run.last = time.perf_counter()

    def compile_staged_drafter(self, batch: int, sampling: SamplingKey, kv_len: int | None) -> bool:
        """Compile the staged EAGLE drafter's step functions now (`stage_drafter`; compiled engines only).

        The engine calls it at the first speculative step of the model-free drafter the staged one will
        take over from: its hand-over (a later RL step, once the drafter is published) then captures
        graphs only, and no compile lands in the steady steps. An EAGLE step of one draft token, one of
        two and one of the longest length (the versions every draft length needs) over ``batch`` rows run on
        the live state and are undone, as a capture's warm-up runs are; nothing is captured. Returns whether
        every length compiled (a failure is one warning: the hand-over compiles instead)."""
        assert self._staged is not None and self._state is not None and self._spec_step is not None
        self._staged_compiled = True  # once, whatever happens below
        drafter = self._staged[0]
        self._tracker.before_capture(self._graphs.stats if self._graphs is not None else None,
                                     f"the staged EAGLE drafter's step over {batch} rows")
        # a draft of one token is a version of its own (Dynamo specialises size 1), and so is one as long as
        # the draft buffers (a slice to their full width; on the H100 (2026-12-05) the EAGLE step at k = 8
        # of 8 recompiled verify_update in RL step 2): the lengths between share one
        longest = self.max_draft_tokens
        for length in sorted({1, min(2, longest), longest}):
            reset = self._state.snapshot()
            try:
                with self._compiling():
                    self._spec_step.compile_ahead(self.step_context(), batch, length, sampling, drafter, kv_len)
            except Exception as err:  # the hand-over compiles (or falls back) as it would have without this
                warnings.warn(f"compiling the staged drafter's step ahead failed ({err!r}); it compiles at its "
                              "hand-over instead", stacklevel=2)
                return False
            finally:
                reset()
        return True

    def _flags(self, snapshot: list[Request], phase: str, k: int = 0) -> PendingStep:
        """Start the copy of the step's finish flags (and emitted counts) to the host, without waiting."""
        st = self._state
        assert st is not None
        n = len(snapshot)
        emitted = st.spec.emitted[:n] if phase == "speculative" and st.spec is not None else None
        if st.finished.device.type != "cuda":
            return PendingStep(snapshot, phase, st.finished[:n].clone(), None if emitted is None else emitted.clone(), None, k)
        flags_buf, emitted_buf = self._pinned[self._pinned_next]
        self._pinned_next ^= 1
        flags_buf[:n].copy_(st.finished[:n], non_blocking=True)
        if emitted is not None:
            emitted_buf[:n].copy_(emitted, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return PendingStep(snapshot, phase, flags_buf[:n], None if emitted is None else emitted_buf[:n], event, k)

    def _process(self, done: PendingStep, run: CallState) -> None:
        """Harvest the rows a finished step ended, and tell the listeners about that step."""
        if done.event is not None:
            done.event.synchronize()
        flags = done.flags.tolist()
        counts = done.emitted.tolist() if done.emitted is not None else None
        live = [i for i, r in enumerate(done.snapshot) if r.index not in run.results]
        new_tokens = sum(counts[i] for i in live) if counts is not None else len(live)
        ended = [done.snapshot[i] for i in live if flags[i]]
        if ended:
            slot_of = {r.index: s for s, r in enumerate(self._scheduler.active)}
            self._harvest([slot_of[r.index] for r in ended], run.results)
        now = time.perf_counter()
        self._account(run, done.phase, new_tokens, now - run.last, done.k)
        run.last = now

    def _account(self, run: CallState, phase: str, new_tokens: int, dt: float, k: int = 0) -> None:
        sched = self._scheduler
        run.timers.add(phase, dt, new_tokens)
        run.steps += 1
        run.tokens += new_tokens
        if run.bar is not None:
            run.bar.update(new_tokens)
        captured, self._captures_told = self._captures != self._captures_told, self._captures  # within dt
        self._emit(StepEvent(run.steps, phase, sched.num_active, sched.num_queued, sched.num_slots, dt,  # type: ignore[arg-type]
                             new_tokens=new_tokens, captured=captured, draft_tokens=k))

    def _harvest(self, done_slots: list[int], results: Results) -> None:
        """Read finished rows' completions, free their slots and repack the active rows."""
        st, cache, sched = self._state, self._cache, self._scheduler
        assert st is not None and cache is not None
        # slot order: rows read below and requests released are matched index by index
        done_slots = sorted(done_slots)
        idx = torch.tensor(done_slots, device=st.tokens.device)
        counts = st.num_generated[idx].cpu().tolist()
        longest = max(counts)
        toks = st.out_tokens[idx, :longest].cpu().tolist()
        lps = st.out_logprobs[idx, :longest].cpu().tolist()
        finished, moves = sched.release(done_slots)
        for request, c, t, lp in zip(finished, counts, toks, lps):
            results[request.index] = (t[:c], lp[:c])
        if self._spec_step is not None:
            self._spec_step.finished(finished, self._drafter)
        if moves:
            src = torch.tensor([s for s, _ in moves], device=idx.device)
            dst = torch.tensor([d for _, d in moves], device=idx.device)
            cache.copy_slots(dst, src)
            st.move_rows(src, dst)
        st.finished[sched.num_active :] = True

    def _finish_call(self, run: CallState) -> None:
        """End of the loop: speculation figures (one host read of the device counters), "done" event."""
        sched, st = self._scheduler, self._state
        assert st is not None
        self.metrics = SpeculationMetrics(max_draft_tokens=16)
        if st.counters is not None:
            self.metrics.add_counters(st.counters.cpu())
        for phase, seconds in run.timers.phase_s.items():
            if phase in ("decode", "speculative"):
                self.metrics.speculative_share.update(phase == "speculative", run.timers.steps[phase])
            self.metrics.tokens_per_second.update(phase, run.timers.tokens.get(phase, 0), seconds)
        if self._tuner is not None:
            # deterministic: every count read by the end of the call (what the next call starts from never
            # depends on how far the device had got); else whatever has completed
            if self.speculative.deterministic:
                self._tuner.flush()
            else:
                self._tuner.poll()
        if not self._vocab.full:
            self._vocab.observe([c for c, _ in run.results.values()])
        self._emit(StepEvent(run.steps, "done", 0, 0, sched.num_slots, 0.0))

    # ------------------------------------------------------------------ output
    def _output(self, requests: list[Request], run: CallState, stop_ids: list[int], wall: float) -> RolloutOutput:
        stops = set(stop_ids)
        completions = [run.results[r.index][0] for r in requests]
        reasons: list[FinishReason] = ["stop" if c and c[-1] in stops else "length" for c in completions]
        generated = sum(len(c) for c in completions)
        zero_prob = sum(lp <= ZERO_PROBABILITY_LOGPROB for r in requests for lp in run.results[r.index][1])
        stats: dict[str, float] = {
            "tokens": float(generated),
            "steps": float(run.steps),
            "row_steps": float(run.tokens),
            "wall_time_s": wall,
            "tokens_per_s": generated / wall if wall > 0 else 0.0,
            "zero_prob_tokens": float(zero_prob),
        }
        if zero_prob:
            warnings.warn(
                f"{zero_prob} of {generated} sampled tokens had probability 0 under the policy's processed "
                "distribution (logprob <= -69): the sampler is broken, and these rollouts are not samples of the "
                "policy. Please report it with the engine's settings.",
                RuntimeWarning,
                stacklevel=4,
            )
        for phase, seconds in run.timers.phase_s.items():
            stats[f"time_{phase}_s"] = seconds
            stats[f"steps_{phase}"] = float(run.timers.steps[phase])
        stats.update({f"compile/{k}": v for k, v in run.compiling.items()})
        if self._spec_on:
            stats.update(self.metrics.stats())
            stats["spec/steps"] = float(self._speculative_steps)
            if self._gate is not None:
                stats["spec/gate_switches"] = float(self._gate.switches)
            if self._tuner is not None:
                stats.update(self._tuner.summary())
        if self._graphs is not None and self._graphs.enabled:
            stats.update({f"graphs_{k}": float(v) for k, v in self._graphs.stats.as_dict().items()})
        if self._copy is not None:  # a sharded policy's gather into the copy, this call's (`InferenceCopy.stats`)
            stats.update(self._copy.stats)
        self.last_stats = stats
        return RolloutOutput(
            prompt_ids=[list(r.prompt) for r in requests],
            completion_ids=completions,
            logprobs=[run.results[r.index][1] for r in requests],
            finish_reasons=reasons,
            stats=stats,
        )
