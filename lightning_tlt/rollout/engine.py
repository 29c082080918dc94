"""`RolloutEngine`: continuous-batching generation over the policy's own parameters.

The engine samples rollouts from the model that Lightning is training, in the same process: the
functional runner (`lightning_tlt.core.runner`) reads the policy's parameters at every call, so
there is no copy and no weight sync, and the next ``generate`` after an optimizer step uses the
new weights. Each prompt is prefilled once and its KV prefix copied into its ``num_samples``
slots; finished rows free their slot at once and queued requests take it (continuous batching).

A step over ``n`` active rows is padded to a batch bucket and replayed from a captured CUDA graph
(`CUDAGraphProfileCache`): the policy's forward, compiled once with ``torch.compile``; attention
that reads each row's own length (`lightning_tlt.core.attention`); the sampling and the state
update compiled with it (`lightning_tlt.rollout.steps`). The engine loop is the one orchestrator:

- admission and prefill (`SlotScheduler`, `SlotState.reset_rows`);
- the choice of the step: the gate (`AdaptiveGate`: speculate only in the long tail, the threshold
  a cap) and the tuner (`DraftLengthTuner`: ``k`` per batch bucket from measured tokens/s, ``k = 0``
  being plain decoding, so speculation that does not pay is switched off by measurement);
- the step itself: plain decode, or `SpeculativeStep` (draft, verify, accept);
- host reads one step late: each step's finish flags (and emitted counts) are copied to pinned
  memory while the next step runs, then finished rows are harvested and the rest repacked.

Models the runner does not know run through their own HF forward (`hf_fallback.generate_hf`):
slower, no graphs, same contract.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import Tensor, nn

from lightning_tlt.core.attention import default_backend
from lightning_tlt.core.compile_cache import CompileCache, device_key, resolve_cache_dir
from lightning_tlt.core.kv_cache import KVCache, kv_bytes_per_slot
from lightning_tlt.core.prompts import check_stop_ids, policy_positions, validate_prompts
from lightning_tlt.core.runner import ModelRunner, eos_token_ids, is_supported, unwrap_model
from lightning_tlt.core.sampling import row_keys
from lightning_tlt.core.types import (
    FinishReason,
    RolloutOutput,
    SamplingConfig,
    SpeculativeConfig,
    StepEvent,
    StepListener,
)
from lightning_tlt.drafters.base import Drafter, capability
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.suffix import SuffixDrafter
from lightning_tlt.rollout.compiling import CompileTracker
from lightning_tlt.rollout.cuda_graphs import (
    DEFAULT_BUCKETS,
    CUDAGraphBackend,
    CUDAGraphProfileCache,
    GraphProfile,
)
from lightning_tlt.rollout.gate import AdaptiveGate
from lightning_tlt.rollout.hf_fallback import generate_hf
from lightning_tlt.rollout.inference_copy import InferenceCopy, resolve_dtype
from lightning_tlt.rollout.scheduler import Request, SlotScheduler
from lightning_tlt.rollout.slot_state import MAX_STOP_IDS, SlotState
from lightning_tlt.rollout.spec_metrics import SpeculationMetrics
from lightning_tlt.rollout.spec_step import DraftVocabulary, SpeculativeStep, StepContext, eagle_handle
from lightning_tlt.rollout.steps import (
    SamplingKey,
    allow_recompiles,
    compile_settings,
    decode_update,
    mark_rows_dynamic,
)
from lightning_tlt.rollout.tuner import DraftLengthTuner

CPU_DEFAULT_SLOTS = 16
"""Slots on the CPU when neither ``max_batch_size`` nor a memory budget is given."""
MAX_AUTO_SLOTS = 256
"""Largest slot count chosen from a memory budget."""
CUDA_FREE_MEMORY_FRACTION = 0.4
"""Share of free CUDA memory the KV cache may take when no budget is given."""

Results = dict[int, tuple[list[int], list[float]]]


@dataclass
class _Pending:
    """A launched step whose finish flags (and emitted counts) are on their way to the host."""

    snapshot: list[Request]  # the request in each slot when the step was launched
    phase: str  # "decode" or "speculative"
    flags: Tensor  # (n,) bool, host side once ``event`` has completed
    emitted: Tensor | None  # (n,) long tokens each row appended (speculative steps)
    event: Any  # torch.cuda.Event | None
    k: int = 0  # tokens drafted per row (speculative steps)


@dataclass
class _Timers:
    phase_s: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, seconds: float, tokens: int = 0) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds
        self.steps[phase] = self.steps.get(phase, 0) + 1
        self.tokens[phase] = self.tokens.get(phase, 0) + tokens


@dataclass
class _Run:
    """The bookkeeping of one ``generate`` call."""

    results: Results = field(default_factory=dict)
    timers: _Timers = field(default_factory=_Timers)
    pending: deque[_Pending] = field(default_factory=deque)
    bounds: dict[int, int] = field(default_factory=dict)  # request index -> upper bound of its KV length
    compiling: dict[str, float] = field(default_factory=dict)  # `CompileTracker.end`: compiled, captured this call
    steps: int = 0
    tokens: int = 0
    last: float = 0.0
    bar: Any = None


class RolloutEngine:
    """Generates rollouts from a policy, in-process, over its own parameters.

    Args:
        model: an HF causal LM (Llama, Qwen2, Qwen3 run on the fast runner; others through their
            own forward). Wrappers with ``.module`` (DDP) are unwrapped. It is read, never copied
            (but see ``fuse_projections``).
        max_batch_size: slots (rows decoded together); ``None`` derives it from the memory budget.
        max_seq_len: longest prompt + completion a slot holds.
        memory_budget_bytes: KV-cache budget used to derive ``max_batch_size``; ``None`` takes a
            share of free CUDA memory, or `CPU_DEFAULT_SLOTS` slots on the CPU.
        use_cuda_graphs: capture steps as CUDA graphs; ``None``: on when on CUDA.
        compile: ``torch.compile(fullgraph=True)`` the steps; ``None``: on when on CUDA.
        speculative: when and how to speculate (see `SpeculativeConfig`); ``None`` never does.
        progress: show a tqdm bar over generated tokens.
        graph_memory_budget_bytes: budget of the graph cache (LRU eviction above it).
        prefill_chunk_tokens: most (padded) prompt tokens prefilled in one forward.
        attention: the cached-attention backend (`lightning_tlt.core.attention.ATTENTION_BACKENDS`):
            ``"auto"`` is the Triton kernel on CUDA and masked SDPA on the CPU.
        fuse_projections: run q, k, v as one GEMM and gate, up as one, over a copy of those weights
            (about half of each layer's) that every ``generate`` first refreshes from the policy
            (`lightning_tlt.core.runner.FusedProjections`, which follows optimizer steps, replaced
            tensors and resumed checkpoints): fewer launches per step where batch-1 decode is
            launch-bound. On by default (H200, 0.4 B: 1.12 against 1.41 ms a step at batch 1, 80 K
            against 68 K tokens/s at batch 128); ``False`` reads the policy only, never copying it.
        compile_cache: where compiled steps are kept between processes
            (`lightning_tlt.core.compile_cache`): ``None`` the kit's cache directory (or
            ``$LIGHTNING_TLT_COMPILE_CACHE``), a path, or ``False`` (off).
        log_compile: print a line while a call compiles and captures for more than a few seconds.
        dtype: decode in this dtype (a `torch.dtype` or "bfloat16", "float16", "float32"): when it is
            not the policy's, the engine keeps a copy of the parameters in it, refreshed in place from
            the policy at every ``generate`` (`lightning_tlt.rollout.inference_copy.InferenceCopy`):
            RL with float32 master weights (``bf16-mixed``) then rolls out in bf16. ``None``: the
            policy's own dtype, read in place.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_batch_size: int | None = None,
        max_seq_len: int,
        memory_budget_bytes: int | None = None,
        use_cuda_graphs: bool | None = None,
        compile: bool | None = None,
        speculative: SpeculativeConfig | None = None,
        progress: bool = False,
        graph_memory_budget_bytes: int | None = None,
        prefill_chunk_tokens: int = 16384,
        attention: str = "auto",
        fuse_projections: bool = True,
        dtype: torch.dtype | str | None = None,
        compile_cache: bool | str | os.PathLike[str] | None = None,
        log_compile: bool = True,
    ) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len!r}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size!r}")
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0 or None, got {memory_budget_bytes!r}")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens!r}")
        wanted = resolve_dtype(dtype)
        self._copy: InferenceCopy | None = None
        if wanted is not None and wanted != next(unwrap_model(model).parameters()).dtype:
            self._copy = InferenceCopy(model, wanted)
        self._model = model
        self.max_seq_len = max_seq_len
        self.speculative = speculative or SpeculativeConfig()
        self.progress = progress
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._use_cuda_graphs = use_cuda_graphs
        self._compile = compile
        self._compile_cache_dir = resolve_cache_dir(compile_cache)
        self._tracker = CompileTracker(None, report=log_compile)
        self._compiled = False  # the steps run compiled (until a compiler failure turns them eager)
        self._captures = 0  # graphs captured so far (a step that captured is not timed for the tuner)
        self._captures_told = 0  # ... as of the last step event (an event whose time held one says so)
        self.compile_failures: list[str] = []
        """Compiler errors after which this engine ran its steps uncompiled (empty: compiled throughout)."""
        self._graph_memory_budget = graph_memory_budget_bytes
        self._memory_budget = memory_budget_bytes
        self._max_batch_size = max_batch_size
        self._listeners: list[StepListener] = []
        runs = self._hf  # what the engine decodes with: the policy, or its copy in `dtype`
        self._runner = ModelRunner(runs, attention, fuse_projections) if is_supported(model) else None
        spec = self.speculative
        self._spec_on = spec.enabled and self._runner is not None
        if spec.enabled and self._runner is None:
            warnings.warn(
                f"{type(unwrap_model(model)).__name__} runs on the generic HF path, which does not speculate",
                stacklevel=2,
            )
        self._drafter: Drafter | None = default_drafter(spec, runs) if spec.enabled else None
        self._drafter_handle = 0  # a new one whenever the drafter object is replaced (graph keys)
        self._handles = 0  # handles handed out so far
        self._staged: tuple[EagleDrafter, int] | None = None  # `stage_drafter`'s drafter and its handle
        self._staged_compiled = False  # its step functions compiled ahead of its hand-over (`_compile_staged`)
        self.drafter_version = 0
        """Version of the published drafter weights (`set_drafter` advances it)."""
        self.max_draft_tokens = spec.num_draft_tokens or max(spec.draft_candidates)
        self._gate = AdaptiveGate(spec.threshold, spec.hysteresis_steps) if self._spec_on else None
        self._tuner: DraftLengthTuner | None = None
        if self._spec_on and spec.num_draft_tokens is None:
            arms = ((0,) if spec.plain_arm else ()) + spec.draft_candidates
            self._tuner = DraftLengthTuner(
                arms, epsilon=spec.tuner_epsilon, min_samples=spec.tuner_min_samples,
                prune_margin=spec.tuner_prune_margin,
                cost_model=draft_cost_model(spec.tuner_draft_cost) if spec.deterministic else None,
            )
        self._vocab = DraftVocabulary(spec.draft_vocab_size, self.vocab_size)
        self._spec_step: SpeculativeStep | None = None
        self.metrics = SpeculationMetrics(max_draft_tokens=16)
        """Speculation figures of the last ``generate`` call (torchmetrics states)."""
        self._cache: KVCache | None = None
        self._state: SlotState | None = None
        self._graphs: CUDAGraphProfileCache | None = None
        self._gen: torch.Generator | None = None
        self._forward: Callable[..., tuple[Tensor, Tensor]] | None = None
        self._decode_update: Callable[..., None] = decode_update
        self._layout: tuple[Any, ...] = ()
        self._param_ptrs: tuple[int, ...] = ()
        self._scheduler = SlotScheduler(1)
        self._pinned: list[tuple[Tensor, Tensor]] = []
        self._pinned_next = 0
        self._speculative_steps = 0
        self._prompt_features: dict[int, Tensor] = {}
        self.last_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ read-only properties
    @property
    def model(self) -> nn.Module:
        """The policy (as given, wrappers included)."""
        return self._model

    @property
    def _hf(self) -> Any:  # the HF model decoded (the policy unwrapped, or its copy in `dtype`)
        return self._copy.module if self._copy is not None else unwrap_model(self._model)

    def draft_vocab_ids(self) -> torch.Tensor | None:
        """The token ids an EAGLE drafter drafts from in the next ``generate`` (``(Vd,)`` long, on the
        CPU), or ``None`` when it drafts from the whole vocabulary (`SpeculativeConfig.draft_vocab_size`)."""
        return None if self._vocab.full else self._vocab.ids()

    @property
    def inference_copy(self) -> InferenceCopy | None:
        """The policy's parameters in the engine's ``dtype`` (``None``: the engine reads the policy)."""
        return self._copy

    @property
    def device(self) -> torch.device:
        return next(self._hf.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self._hf.parameters()).dtype

    @property
    def hidden_size(self) -> int:
        return int(self._hf.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self._hf.config.vocab_size)

    @property
    def is_native(self) -> bool:
        """Whether the fast runner serves this model (else the HF fallback does)."""
        return self._runner is not None

    @property
    def attention(self) -> str:
        """The cached-attention backend in use ("triton" or "sdpa")."""
        if self._runner is None or self._runner.attention == "auto":
            return default_backend(self.device)
        return self._runner.attention

    @property
    def num_slots(self) -> int:
        """Rows decoded together (the KV cache's slots)."""
        if self._cache is not None:
            return self._cache.num_slots
        if self._max_batch_size is not None:
            return self._max_batch_size
        config = self._hf.config
        num_heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // num_heads
        per_slot = kv_bytes_per_slot(
            int(config.num_hidden_layers), self.max_seq_len,
            int(getattr(config, "num_key_value_heads", None) or num_heads), int(head_dim), self.dtype,
        )  # fmt: skip
        budget = self._memory_budget
        if budget is None:
            if self.device.type != "cuda":
                return CPU_DEFAULT_SLOTS
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * CUDA_FREE_MEMORY_FRACTION)
        return max(1, min(MAX_AUTO_SLOTS, budget // per_slot))

    @property
    def tuner(self) -> DraftLengthTuner | None:
        """The draft-length tuner (``None`` without speculation or with a fixed ``num_draft_tokens``)."""
        return self._tuner

    @property
    def gate(self) -> AdaptiveGate | None:
        """The speculation gate (``None`` without speculation)."""
        return self._gate

    @property
    def graph_stats(self) -> dict[str, float]:
        """The graph cache's counters (empty before the first native ``generate``)."""
        return self._graphs.stats.as_dict() if self._graphs is not None else {}

    # ------------------------------------------------------------------ the drafter
    @property
    def drafter(self) -> Drafter | None:
        """What speculation drafts with (`SuffixDrafter`, a frozen `EagleDrafter`, ...), or ``None``.

        Assigning replaces it (the graphs captured for the old one are freed); `set_drafter`
        publishes new weights, in place where it can.
        """
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Drafter | None) -> None:
        if drafter is self._drafter:
            return
        self._drafter = drafter
        if self._staged is not None and drafter is self._staged[0]:
            self._drafter_handle, self._staged = self._staged[1], None  # its graphs are kept: captured already
        else:
            self._handles += 1
            self._drafter_handle = self._handles
        if self._graphs is not None:
            keep = {self._drafter_handle, *(() if self._staged is None else (self._staged[1],))}
            self._graphs.drop(lambda profile: profile.phase == "spec" and eagle_handle(profile) not in keep)

    def stage_drafter(self, drafter: EagleDrafter) -> None:
        """Get ready for an EAGLE drafter that `set_drafter` will publish later.

        While a model-free drafter speculates (TLT's cold start: the suffix drafter until the EAGLE
        drafter's acceptance beats it), the engine keeps a frozen copy of ``drafter`` under a graph
        handle of its own; publishing copies the weights into that copy, so the graphs captured for
        it stay valid across every later publication. Nothing drafts with it until then. Its step
        functions are compiled (once, for every batch bucket and draft length) at the first
        speculative step of the drafter it will take over from, so that its hand-over, typically an
        RL step or two later, compiles nothing; no graph is captured for it ahead of use: each
        profile is captured when first met.

        Args:
            drafter: the drafter to be published (a training drafter is copied, never held).
        """
        if not capability(drafter, "runs_on_device"):
            raise TypeError(f"stage_drafter takes an EagleDrafter, got {type(drafter).__name__}")
        if not self._spec_on or self._drafter_on_device():
            return  # nothing speculates, or publishing copies into the current EAGLE drafter in place
        if tuple(drafter.feature_layers or ()) != self._capture_layers():
            return  # an EAGLE-3 drafter needs other feature buffers: its hand-over rebuilds them anyway
        if any(p.requires_grad for p in drafter.parameters()):
            drafter = drafter.inference_copy(self.dtype)
        self._handles += 1
        self._staged = (drafter, self._handles)
        self._staged_compiled = False

    def set_drafter(self, drafter: Drafter | None, version: int | None = None) -> bool:
        """Publish ``drafter`` to the engine; returns whether it was taken.

        An `EagleDrafter` whose weights are not all finite is refused with a warning (the engine
        keeps drafting with what it has: a diverged co-trained drafter never reaches a rollout).
        When the engine already drafts with an `EagleDrafter` of the same layout, the weights are
        copied into it in place (captured graphs stay valid); when one of the same layout was
        staged (`stage_drafter`), they are copied into that and it takes over, graphs and all;
        otherwise the engine takes a frozen `EagleDrafter.inference_copy` (or ``drafter`` itself
        when it is frozen already, or not an EAGLE drafter).

        Args:
            drafter: the drafter (a training `EagleDrafter` is copied, never held).
            version: the version to record; ``None`` advances `drafter_version` by one.
        """
        if drafter is not None and capability(drafter, "runs_on_device"):
            drafter = cast(EagleDrafter, drafter)  # the one device drafter: weights published in place
            bad = [name for name, t in drafter.state_dict().items() if not bool(torch.isfinite(t).all())]
            if bad:
                warnings.warn(
                    f"refusing to publish a drafter with non-finite weights ({', '.join(bad[:3])}"
                    f"{', ...' if len(bad) > 3 else ''}); the engine keeps drafter version {self.drafter_version}",
                    stacklevel=2,
                )
                return False
            current, staged = self._drafter, None if self._staged is None else self._staged[0]
            if self._drafter_on_device() and current is not drafter and cast(EagleDrafter, current).same_layout(drafter):
                cast(EagleDrafter, current).copy_weights_from(drafter)
            elif staged is not None and staged is not drafter and staged.same_layout(drafter):
                staged.copy_weights_from(drafter)
                self.drafter = staged
            elif any(p.requires_grad for p in drafter.parameters()):
                self.drafter = drafter.inference_copy(self.dtype)
            else:
                self.drafter = drafter
        else:
            self.drafter = drafter
        self.drafter_version = self.drafter_version + 1 if version is None else int(version)
        return True

    def _drafter_on_device(self) -> bool:
        """Whether the current drafter runs inside the step's graph (an EAGLE drafter), not on the host."""
        return self._drafter is not None and bool(capability(self._drafter, "runs_on_device"))

    # ------------------------------------------------------------------ adaptive state
    def adaptive_state_dict(self) -> dict[str, Any]:
        """What the engine learned about speculating (gate, tuner, draft vocabulary), for checkpoints."""
        if not self._spec_on:
            return {}
        return {
            "gate": None if self._gate is None else self._gate.state_dict(),
            "tuner": None if self._tuner is None else self._tuner.state_dict(),
            "draft_vocab": self._vocab.state_dict(),
        }

    def load_adaptive_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `adaptive_state_dict` returned."""
        if not state_dict or not self._spec_on:
            return
        if state_dict.get("gate") is not None and self._gate is not None:
            self._gate.load_state_dict(state_dict["gate"])
        if state_dict.get("tuner") is not None and self._tuner is not None:
            self._tuner.load_state_dict(state_dict["tuner"])
        if state_dict.get("draft_vocab") is not None:
            self._vocab.load_state_dict(state_dict["draft_vocab"])

    # ------------------------------------------------------------------ listeners
    def add_listener(self, fn: StepListener) -> None:
        """Call ``fn(StepEvent)`` after every step, and once with phase "done" at the end."""
        self._listeners.append(fn)

    def remove_listener(self, fn: StepListener) -> None:
        self._listeners.remove(fn)

    def _emit(self, event: StepEvent) -> None:
        for fn in list(self._listeners):
            fn(event)

    # ------------------------------------------------------------------ public API
    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingConfig | None = None,
        num_samples: int = 1,
        generator: torch.Generator | None = None,
    ) -> RolloutOutput:
        """Sample ``num_samples`` completions of every prompt.

        Args:
            prompts: token-id lists.
            sampling: temperature (0 = greedy), top-k, top-p, max new tokens, stop tokens.
            num_samples: completions per prompt (TRL's ``num_generations``).
            generator: seeds the sampling (the same seed gives the same rollouts); advanced by
                one draw. ``None`` draws a seed from torch's default generator.

        Returns:
            `RolloutOutput`, grouped by prompt (all samples of prompt 0 first).
        """
        sampling = sampling or SamplingConfig()
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples!r}")
        ids = validate_prompts(prompts, self.vocab_size, max_new_tokens=sampling.max_new_tokens,
                               max_seq_len=self.max_seq_len, positions=policy_positions(self._hf))
        stop_ids = eos_token_ids(self._model) if sampling.stop_token_ids is None else list(sampling.stop_token_ids)
        check_stop_ids(sampling.stop_token_ids or [], self.vocab_size)  # the caller's; the model's are its own
        if len(stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids are supported, got {stop_ids!r}")
        seed = self._seed(generator)
        gen = self._generator(seed)
        keys = row_keys(seed, ids, num_samples)
        requests = [
            Request(p * num_samples + g, p, ids[p], keys[p * num_samples + g])
            for p in range(len(ids)) for g in range(num_samples)
        ]  # fmt: skip
        if self._copy is not None:
            self._copy.sync()  # the policy trained since the last call
        was_training = self._hf.training
        self._hf.eval()
        if self._runner is not None:
            self._runner.sync_fused()  # the policy may have trained since the last call
        run = _Run(bar=self._progress_bar(len(requests) * sampling.max_new_tokens))
        start = time.perf_counter()
        try:
            if self._runner is None:
                run.results, run.steps, run.tokens = generate_hf(
                    self._hf, requests, sampling, stop_ids, gen, slots=self.num_slots, emit=self._emit,
                    bar=run.bar, timers=run.timers,
                )
                self._emit(StepEvent(run.steps, "done", 0, 0, self.num_slots, 0.0))
            else:
                self._generate_native(requests, sampling, stop_ids, gen, run)
        finally:
            self._hf.train(was_training)
            if run.bar is not None:
                run.bar.close()
        return self._output(requests, run, stop_ids, time.perf_counter() - start)

    @staticmethod
    def _seed(generator: torch.Generator | None) -> int:
        """The call's seed: one draw from ``generator`` (advancing it), or from torch's default one."""
        source = "cpu" if generator is None else generator.device
        return int(torch.randint(0, 2**62, (1,), generator=generator, device=source).item())

    def _generator(self, seed: int) -> torch.Generator:
        """The engine's device generator, seeded with ``seed``: what host drafters' ``draft`` draws from
        (the engine's own sampling uses keyed noise, `lightning_tlt.core.sampling.row_keys`)."""
        device = self.device
        if self._gen is None or self._gen.device != device:
            self._gen = torch.Generator(device)
        self._gen.manual_seed(seed)
        return self._gen

    # ------------------------------------------------------------------ buffers
    def _capture_layers(self) -> tuple[int, ...]:
        """HF ``hidden_states`` indices an EAGLE-3 drafter reads (``()``: the last hidden state)."""
        layers = capability(self._drafter, "feature_layers") if self._spec_on and self._drafter is not None else None
        return tuple(layers) if layers else ()

    def _ensure_buffers(self) -> None:
        assert self._runner is not None
        spec = self._runner.spec
        device, dtype = self.device, self.dtype
        capture = self._capture_layers()
        layout = (device, dtype, self.num_slots if self._cache is None else self._cache.num_slots, capture)
        if self._cache is not None and self._layout == layout:
            return
        slots = self.num_slots
        room = self.max_draft_tokens + 1 if self._spec_on else 0
        cache_len = -(-(self.max_seq_len + room) // 64) * 64  # padded to whole 64-position blocks
        self._cache = KVCache.allocate(
            spec.num_layers, slots, cache_len, spec.num_kv_heads, spec.head_dim, device=device, dtype=dtype
        )
        self._state = SlotState.allocate(
            slots, self.max_seq_len, spec.hidden_size * max(1, len(capture)), device=device, dtype=dtype,
            max_draft_tokens=self.max_draft_tokens if self._spec_on else 0,
        )  # fmt: skip
        on_cuda = device.type == "cuda"
        use_graphs = on_cuda if self._use_cuda_graphs is None else self._use_cuda_graphs
        if use_graphs and not on_cuda:
            warnings.warn("use_cuda_graphs=True without CUDA: running eagerly", stacklevel=3)
            use_graphs = False
        self._gen = self._gen if self._gen is not None and self._gen.device == device else torch.Generator(device)
        backend = CUDAGraphBackend(device) if use_graphs else None  # keyed noise: no generator in a graph
        use_compile = on_cuda if self._compile is None else self._compile
        # compiled, a lone row is padded to two: Dynamo specialises size 1 even under dynamic=True, so a
        # batch-1 step would compile every step function again when the tail first runs down to one row
        buckets = tuple(b for b in DEFAULT_BUCKETS if b > 1) if use_compile and slots > 1 else DEFAULT_BUCKETS
        self._graphs = CUDAGraphProfileCache(
            backend, buckets=buckets, max_batch=slots, memory_budget_bytes=self._graph_memory_budget
        )
        self._forward, self._decode_update = self._model_step, decode_update
        self._compiled = use_compile
        if use_compile:
            allow_recompiles()
            self._load_compile_cache(capture)
            # one version of each step function for every batch bucket and draft length: the forward's
            # rows (and a verify's tokens per row) are marked dynamic at each call (`mark_rows_dynamic`),
            # the updates are dynamic throughout; the forward has two versions, decode (one token a row,
            # which Dynamo specialises) and verify
            self._forward = torch.compile(self._model_step, fullgraph=True)
            self._decode_update = torch.compile(decode_update, fullgraph=True, dynamic=True)
        if self._spec_on:
            self._spec_step = SpeculativeStep(self.max_draft_tokens, self._vocab, compile=use_compile,
                                              coupled=self.speculative.verification == "coupled")
            rows = min(slots, self._graphs.bucket(min(self.speculative.threshold, slots)))
            assert self._gate is not None  # kept (with what it learned), capped to the rows the buffers serve
            self._gate.threshold = min(self.speculative.threshold, rows)
            self._gate.hard_limit = rows
            if self._tuner is not None:
                self._tuner.set_device(device)
        self._pinned = [
            (torch.zeros(slots, dtype=torch.bool, pin_memory=on_cuda), torch.zeros(slots, dtype=torch.long, pin_memory=on_cuda))
            for _ in range(2)
        ]
        self._pinned_next = 0
        self._layout = layout

    def _load_compile_cache(self, capture: tuple[int, ...]) -> None:
        """Point the tracker at this layout's persistent compile cache and load it (once per process)."""
        assert self._runner is not None
        cache = None
        if self._compile_cache_dir is not None:
            key = {"model": dataclasses.asdict(self._runner.spec), "dtype": str(self.dtype),
                   "device": device_key(self.device), "attention": self.attention,
                   "fuse_projections": self._runner.fuse_projections, "capture_layers": list(capture)}
            cache = CompileCache(self._compile_cache_dir, key)
            cache.load()
        self._tracker.cache = cache

    def _check_params(self) -> None:
        """Captured graphs hold parameter addresses: drop them if a parameter tensor was replaced."""
        ptrs = tuple(p.data_ptr() for p in self._hf.parameters())
        if ptrs != self._param_ptrs and self._graphs is not None:
            self._graphs.clear()
        self._param_ptrs = ptrs

    def _model_step(
        self, tokens: Tensor, positions: Tensor, k: list[Tensor], v: list[Tensor], capture: tuple[int, ...] = (),
        kv_len: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Logits ``(B, q, V)`` and features ``(B, q, F)``: the last hidden state, or the EAGLE-3
        concatenation of the ``capture`` layers' hidden states."""
        assert self._runner is not None
        out = self._runner.forward(tokens, positions, k, v, capture_layers=capture, kv_len=kv_len)
        assert out.logits is not None
        if not capture:
            return out.logits, out.hidden
        return out.logits, torch.cat([out.layer_hidden[i] for i in capture], dim=-1)

    def _context(self) -> StepContext:
        assert self._state is not None and self._cache is not None and self._graphs is not None
        assert self._forward is not None and self._gen is not None
        # the forward is looked up at each call: a compiler failure swaps in the uncompiled one mid-step
        return StepContext(self._state, self._cache, self._call_forward, self._graphs, self._run_step, self._gen,
                           self._capture_layers(), self.attention)

    def _call_forward(self, tokens: Tensor, positions: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
        """The (compiled) forward, its rows and tokens per row marked dynamic: one version serves every shape."""
        assert self._forward is not None
        if self._compiled:
            mark_rows_dynamic(tokens, positions)
        return self._forward(tokens, positions, *args)

    # ------------------------------------------------------------------ steps
    def _decode_step(self, batch: int, sampling: SamplingKey, kv_len: int | None) -> None:
        """One plain decode step over slots ``0..batch-1``, in place (graph-capturable)."""
        st, cache = self._state, self._cache
        assert st is not None and cache is not None and self._forward is not None
        capture = self._capture_layers()
        logits, hidden = self._call_forward(st.tokens[:batch, None], st.positions[:batch, None], cache.k, cache.v,
                                            capture, kv_len)
        self._decode_update(st, batch, logits, hidden, sampling)

    def _run_plain(self, batch: int, sampling: SamplingKey, kv_len: int | None) -> None:
        """The plain decode step over ``batch`` slots, from its profile's graph."""
        self._run_step(GraphProfile("decode", batch, 1, (sampling, kv_len)),
                       functools.partial(self._decode_step, batch, sampling, kv_len))  # fmt: skip

    def _run_step(self, profile: GraphProfile, fn: Callable[[], None]) -> None:
        graphs = self._graphs
        assert graphs is not None and self._state is not None
        if graphs.enabled and profile not in graphs:
            reset = self._state.snapshot()  # every warm-up run and the capture see the live step's state
            self._tracker.before_capture(graphs.stats, f"{profile.phase} step over {profile.batch} rows")
            with self._compiling():
                graphs.capture([profile], lambda _: fn, reset)
            reset()
            self._captures += 1  # this step's time includes the capture: the tuner leaves it out
        try:
            with self._compiling():
                graphs.run(profile, fn)
        except Exception as err:
            if not self._compiled:
                raise
            # a compiler failure must cost speed, not the rollout: continue uncompiled
            warnings.warn(f"torch.compile of the engine's steps failed ({err!r}); running uncompiled", stacklevel=2)
            self.compile_failures.append(repr(err))
            self._compiled = False
            self._forward, self._decode_update = self._model_step, decode_update
            if self._spec_step is not None:
                self._spec_step.use_eager()
            graphs.clear()
            self._run_step(profile, fn)  # fn reads the (now eager) functions at call time

    def _compiling(self) -> contextlib.AbstractContextManager[None]:
        """Around every call of the steps: compiled, they compile under `compile_settings`."""
        return compile_settings() if self._compiled else contextlib.nullcontext()

    def _kv_len(self, run: _Run, active: Sequence[Request], q: int) -> int | None:
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

    # ------------------------------------------------------------------ prefill
    def _prefill(self, admitted: list[tuple[int, Request]]) -> None:
        """Fill the KV prefix (all prompt tokens but the last) of newly admitted slots.

        Each distinct prompt is prefilled once; a prompt whose sibling is already decoding copies
        that sibling's prefix instead. The last prompt token is fed by the next step, which samples
        the first completion token. With an EAGLE drafter the prompt also runs through the drafter,
        so its history starts at the row's own prefill.
        """
        st, cache, runner = self._state, self._cache, self._runner
        assert st is not None and cache is not None and runner is not None
        device = self.device
        drafter = cast(EagleDrafter, self._drafter) if self._spec_on and self._drafter_on_device() else None
        new_slots = {slot for slot, _ in admitted}
        by_prompt: dict[int, list[int]] = {}
        prompt_of: dict[int, tuple[int, ...]] = {}
        for slot, request in admitted:
            by_prompt.setdefault(request.prompt_index, []).append(slot)
            prompt_of[request.prompt_index] = request.prompt
        copy_src: list[int] = []
        copy_dst: list[int] = []
        to_prefill: list[int] = []
        features: dict[int, Tensor] = {}
        for prompt_index, slots in by_prompt.items():
            if len(prompt_of[prompt_index]) == 1:
                continue
            sibling = next(
                (s for s, r in enumerate(self._scheduler.active) if r.prompt_index == prompt_index and s not in new_slots),
                None,
            )
            if sibling is not None:
                copy_src += [sibling] * len(slots)
                copy_dst += slots
            else:
                to_prefill.append(prompt_index)
        if copy_dst:
            length = max(len(prompt_of[self._scheduler.active[s].prompt_index]) for s in copy_src) - 1
            src, dst = torch.tensor(copy_src, device=device), torch.tensor(copy_dst, device=device)
            cache.copy_slots(dst, src, length)
            for s, d in zip(copy_src, copy_dst):
                features[d] = self._prompt_features[self._scheduler.active[s].prompt_index]
            if drafter is not None and st.spec is not None and st.spec.dcache is not None:
                st.spec.dcache.copy_slots(dst, src, length)
        # prefill distinct prompts in chunks of at most prefill_chunk_tokens padded tokens, longest first
        to_prefill.sort(key=lambda p: -len(prompt_of[p]))
        capture = self._capture_layers()
        while to_prefill:
            longest = len(prompt_of[to_prefill[0]]) - 1
            n = max(1, min(len(to_prefill), self.prefill_chunk_tokens // longest))
            chunk, to_prefill = to_prefill[:n], to_prefill[n:]
            tokens = torch.zeros(len(chunk), longest + 1, dtype=torch.long)
            for row, p in enumerate(chunk):
                tokens[row, : len(prompt_of[p])] = torch.tensor(prompt_of[p])
            tokens = tokens.to(device)
            spec = runner.spec
            scratch = KVCache.allocate(spec.num_layers, len(chunk), longest, spec.num_kv_heads, spec.head_dim,
                                       device=device, dtype=cache.dtype)
            positions = torch.arange(longest, device=device)[None].expand(len(chunk), longest)
            out = runner.forward(tokens[:, :-1], positions, scratch.k, scratch.v, prefill=True, logits=False,
                                 capture_layers=capture)
            hidden = torch.cat([out.layer_hidden[i] for i in capture], -1) if capture else out.hidden
            last = torch.tensor([len(prompt_of[p]) - 2 for p in chunk], device=device)
            feats = hidden[torch.arange(len(chunk), device=device), last]  # (Bp, F): what the drafter reads first
            dst_t = torch.tensor([s for p in chunk for s in by_prompt[p]], device=device)
            src_t = torch.tensor([row for row, p in enumerate(chunk) for _ in by_prompt[p]], device=device)
            cache.write_prefix(dst_t, scratch.k, scratch.v, src_t)
            for row, p in enumerate(chunk):
                self._prompt_features[p] = feats[row]
                for s in by_prompt[p]:
                    features[s] = feats[row]
            if drafter is not None and self._spec_step is not None:
                dcache = st.ensure_drafter_cache(drafter.num_kv_heads, drafter.head_dim, cache.max_seq_len,
                                                 drafter.fc.weight.dtype)
                dscratch = self._spec_step.prefill_drafter(self._context(), drafter, hidden, tokens[:, 1:], last + 1)
                dcache.write_prefix(dst_t, dscratch.k, dscratch.v, src_t)
        slots = [s for s, _ in admitted]
        slot_ids = torch.tensor(slots, device=device)
        zero = st.hidden.new_zeros(st.hidden.shape[1])
        lengths = torch.tensor([len(r.prompt) for _, r in admitted], device=device)
        prefix_end = (lengths - 2) if drafter is not None else None
        st.reset_rows(
            slot_ids,
            torch.tensor([r.prompt[-1] for _, r in admitted], device=device),
            lengths - 1,
            torch.stack([features.get(s, zero) for s in slots]),
            prefix_end,
            torch.tensor([r.key for _, r in admitted], device=device),
        )

    # ------------------------------------------------------------------ the loop
    def _generate_native(
        self, requests: list[Request], sampling: SamplingConfig, stop_ids: list[int], gen: torch.Generator, run: _Run
    ) -> None:
        self._ensure_buffers()
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

    def _choose_k(self, n: int) -> int:
        """Draft tokens for the next step over ``n`` rows: 0 (plain) unless the gate is on, then the tuner's."""
        if self._spec_step is None or self._gate is None or self._drafter is None:
            return 0
        if not self._gate.update(n):
            return 0
        if self._tuner is None:
            return self.max_draft_tokens
        return self._tuner.choose(n)

    def _launch_plain(self, run: _Run, key: SamplingKey, n: int) -> None:
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

    def _launch_speculative(self, run: _Run, key: SamplingKey, n: int, k: int) -> None:
        """An EAGLE step: nothing is read back now (the flags and counts follow one step late)."""
        graphs, st = self._graphs, self._state
        assert graphs is not None and st is not None and st.spec is not None and self._spec_step is not None
        assert self._drafter is not None  # `_choose_k` speculates only with one
        active = list(self._scheduler.active)
        batch = graphs.bucket(n)
        kv_len = self._kv_len(run, active, k + 1)
        timing = self._tuner.start(k, n) if self._tuner is not None else None
        captures = self._captures
        self._spec_step.run(self._context(), active, batch, k, key, self._drafter, self._drafter_handle, kv_len)
        if timing is not None and self._tuner is not None:
            self._tuner.stop(timing, st.spec.emitted[:n], captured=self._captures != captures)
        self._speculative_steps += 1
        run.pending.append(self._flags(active, "speculative", k))

    def _host_speculative(self, run: _Run, key: SamplingKey, k: int) -> None:
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
            self._compile_staged(batch, k, key, kv_len)
        timing = self._tuner.start(k, n) if self._tuner is not None else None
        t0, captures = time.perf_counter(), self._captures
        new_tokens = self._spec_step.run(self._context(), active, batch, k, key, self._drafter,
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

    def _compile_staged(self, batch: int, k: int, sampling: SamplingKey, kv_len: int | None) -> None:
        """Compile the staged EAGLE drafter's step functions now, at the first speculative step of the
        model-free drafter it will take over from: its hand-over (a later RL step, once the drafter is
        published) then captures graphs only, and no compile lands in the steady steps. One EAGLE step
        runs on the live state and is undone, as a capture's warm-up runs are; nothing is captured."""
        assert self._staged is not None and self._state is not None and self._spec_step is not None
        self._staged_compiled = True  # once, whatever happens below
        drafter = self._staged[0]
        reset = self._state.snapshot()
        self._tracker.before_capture(self._graphs.stats if self._graphs is not None else None,
                                     f"the staged EAGLE drafter's step over {batch} rows")
        try:
            with self._compiling():
                self._spec_step.compile_ahead(self._context(), batch, k, sampling, drafter, kv_len)
        except Exception as err:  # the hand-over compiles (or falls back) as it would have without this
            warnings.warn(f"compiling the staged drafter's step ahead failed ({err!r}); it compiles at its "
                          "hand-over instead", stacklevel=2)
        finally:
            reset()

    def _flags(self, snapshot: list[Request], phase: str, k: int = 0) -> _Pending:
        """Start the copy of the step's finish flags (and emitted counts) to the host, without waiting."""
        st = self._state
        assert st is not None
        n = len(snapshot)
        emitted = st.spec.emitted[:n] if phase == "speculative" and st.spec is not None else None
        if st.finished.device.type != "cuda":
            return _Pending(snapshot, phase, st.finished[:n].clone(), None if emitted is None else emitted.clone(), None, k)
        flags_buf, emitted_buf = self._pinned[self._pinned_next]
        self._pinned_next ^= 1
        flags_buf[:n].copy_(st.finished[:n], non_blocking=True)
        if emitted is not None:
            emitted_buf[:n].copy_(emitted, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Pending(snapshot, phase, flags_buf[:n], None if emitted is None else emitted_buf[:n], event, k)

    def _process(self, done: _Pending, run: _Run) -> None:
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

    def _account(self, run: _Run, phase: str, new_tokens: int, dt: float, k: int = 0) -> None:
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

    def _finish_call(self, run: _Run) -> None:
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
    def _output(self, requests: list[Request], run: _Run, stop_ids: list[int], wall: float) -> RolloutOutput:
        stops = set(stop_ids)
        completions = [run.results[r.index][0] for r in requests]
        reasons: list[FinishReason] = ["stop" if c and c[-1] in stops else "length" for c in completions]
        generated = sum(len(c) for c in completions)
        stats: dict[str, float] = {
            "tokens": float(generated),
            "steps": float(run.steps),
            "row_steps": float(run.tokens),
            "wall_time_s": wall,
            "tokens_per_s": generated / wall if wall > 0 else 0.0,
        }
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
        self.last_stats = stats
        return RolloutOutput(
            prompt_ids=[list(r.prompt) for r in requests],
            completion_ids=completions,
            logprobs=[run.results[r.index][1] for r in requests],
            finish_reasons=reasons,
            stats=stats,
        )

    def _progress_bar(self, total: int) -> Any:
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="tok", desc="rollout", leave=False)


def draft_cost_model(draft_cost: float) -> Callable[[int, int], float]:
    """The deterministic tuner's cost of a step drafting ``k`` tokens a row: ``1 + draft_cost * k`` plain steps."""
    return functools.partial(_draft_cost, draft_cost)


def _draft_cost(draft_cost: float, k: int, rows: int) -> float:
    return 1.0 + draft_cost * k


def default_drafter(config: SpeculativeConfig, model: nn.Module) -> Drafter | None:
    """The drafter a `SpeculativeConfig` asks for: a `SuffixDrafter`, or a frozen `EagleDrafter`
    (loaded from ``drafter_path``, else cold from the policy)."""
    if config.method == "suffix":
        return SuffixDrafter()
    if config.method == "eagle":
        if config.drafter_path is not None:
            return EagleDrafter.from_pretrained(config.drafter_path, model).inference_copy()
        return EagleDrafter.from_target(model).inference_copy()
    return None


