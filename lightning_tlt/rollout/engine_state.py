"""`EngineState`: what a `lightning_tlt.rollout.engine.RolloutEngine` holds, and its read-only view.

The engine's constructor (its settings, the gate, the tuner, the drafter it starts with, the slots
it will allocate), its read-only properties, its listeners and the call's seed. The parts built on
it, one file each: `DrafterHosting` (`drafter_hosting.py`: the drafter, its publication and
staging, the adaptive state), `StepRunner` (`step_runner.py`: buffers, the compiled forward,
graph-replayed steps, prefill) and `DecodeLoop` (`decode_loop.py`: admission, the step choice,
host reads one step late, harvest, the call's statistics); `RolloutEngine` (`engine.py`) is the
orchestrator on top, with ``generate``.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tlt.core.attention import default_backend
from lightning_tlt.core.compile_cache import resolve_cache_dir
from lightning_tlt.core.kv_cache import KVCache, kv_bytes_per_slot
from lightning_tlt.core.runner import ModelRunner, is_supported, unwrap_model
from lightning_tlt.core.sharding import is_sharded
from lightning_tlt.core.types import (
    SpeculativeConfig,
    StepEvent,
    StepListener,
)
from lightning_tlt.drafters.base import Drafter, capability
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.suffix import SuffixDrafter
from lightning_tlt.rollout.background_compile import BackgroundCompile
from lightning_tlt.rollout.compiling import CompileTracker
from lightning_tlt.rollout.cuda_graphs import CUDAGraphProfileCache, GraphProfile
from lightning_tlt.rollout.gate import AdaptiveGate
from lightning_tlt.rollout.inference_copy import InferenceCopy, resolve_dtype
from lightning_tlt.rollout.scheduler import SlotScheduler
from lightning_tlt.rollout.slot_state import SlotState
from lightning_tlt.rollout.spec_metrics import SpeculationMetrics
from lightning_tlt.rollout.spec_step import DraftVocabulary, SpeculativeStep
from lightning_tlt.rollout.steps import (
    decode_update,
)
from lightning_tlt.rollout.tuner import DraftLengthTuner

CPU_DEFAULT_SLOTS = 16
"""Slots on the CPU when neither ``max_batch_size`` nor a memory budget is given."""
MAX_AUTO_SLOTS = 256
"""Largest slot count chosen from a memory budget."""
CUDA_FREE_MEMORY_FRACTION = 0.4
"""Share of free CUDA memory the KV cache may take when no budget is given."""

Results = dict[int, tuple[list[int], list[float]]]


class EngineState:
    """The engine's settings and state (arguments: `lightning_tlt.rollout.engine.RolloutEngine`)."""

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
        background_compile: bool | None = None,
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
        own = next(unwrap_model(model).parameters()).dtype
        self._copy: InferenceCopy | None = None
        if is_sharded(unwrap_model(model)):  # the runner cannot read shards: a whole copy, gathered every call
            self._copy = InferenceCopy(model, wanted or own)
        elif wanted is not None and wanted != own:
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
        self._background_setting = background_compile
        self._background: BackgroundCompile | None = None  # the child compiling speculation (`background_compile`)
        self._background_tried = False
        self._background_told = False  # its end said on the console
        self._eagle_told = False  # that it stored the EAGLE drafter's steps, said on the console
        self._prefill_chunk_setting = prefill_chunk_tokens
        self._attention_setting = attention  # as given ("auto" stays "auto": the compiled steps guard on it)
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
        self._staged_compiled = False  # its functions compiled ahead of its hand-over (`compile_staged_drafter`)
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

    # ------------------------------------------------------------------ read API (inspection, tests)
    @property
    def graph_cache(self) -> CUDAGraphProfileCache | None:
        """The graph cache of the current buffers (``None`` before the first native ``generate``)."""
        return self._graphs

    def graph_profiles(self) -> list[GraphProfile]:
        """The step profiles whose graphs are captured now (empty before the first native ``generate``)."""
        return [] if self._graphs is None else self._graphs.profiles()

    @property
    def slot_state(self) -> SlotState | None:
        """Every per-slot tensor of the current buffers (``None`` before the first native ``generate``)."""
        return self._state

    @property
    def draft_vocabulary(self) -> DraftVocabulary:
        """The draft vocabulary an EAGLE drafter drafts from, and the token counts that choose it."""
        return self._vocab

    @property
    def speculative_step(self) -> SpeculativeStep | None:
        """The speculative step of the current buffers (``None`` without speculation or before them)."""
        return self._spec_step

    @property
    def compiled(self) -> bool:
        """Whether the steps run compiled (``False`` before buffers are built, or after a compiler failure)."""
        return self._compiled

    @property
    def kv_cache(self) -> KVCache | None:
        """The policy's KV cache of the current buffers (``None`` before the first native ``generate``)."""
        return self._cache

    @property
    def runner(self) -> ModelRunner | None:
        """The functional runner the engine decodes with (``None``: the HF fallback)."""
        return self._runner

    # ------------------------------------------------------------------ listeners
    def add_listener(self, fn: StepListener) -> None:
        """Call ``fn(StepEvent)`` after every step, and once with phase "done" at the end."""
        self._listeners.append(fn)

    def remove_listener(self, fn: StepListener) -> None:
        self._listeners.remove(fn)

    def _emit(self, event: StepEvent) -> None:
        for fn in list(self._listeners):
            fn(event)

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


def draft_cost_model(draft_cost: float) -> Callable[[int, int], float]:
    """The deterministic tuner's cost of a step drafting ``k`` tokens a row: ``1 + draft_cost * k`` plain steps."""
    return functools.partial(_draft_cost, draft_cost)


def _draft_cost(draft_cost: float, k: int, rows: int) -> float:
    return 1.0 + draft_cost * k


def default_drafter(config: SpeculativeConfig, model: nn.Module) -> Drafter | None:
    """The drafter a `SpeculativeConfig` asks for: a `SuffixDrafter`, or a frozen `EagleDrafter`
    (loaded from ``drafter_path``, else cold from the policy, its initialisation seeded: the same in
    every process, whatever the global RNG holds, so a restart proposes what the first run did)."""
    if config.method == "suffix":
        return SuffixDrafter()
    if config.method == "eagle":
        if config.drafter_path is not None:
            return EagleDrafter.from_pretrained(config.drafter_path, model).inference_copy()
        return EagleDrafter.from_target(model, generator=torch.Generator().manual_seed(0)).inference_copy()
    return None
