"""`RolloutEngine`: continuous-batching generation over the policy's own parameters.

The engine samples rollouts from the model that Lightning is training, in the same process: the
functional runner (`lightning_tlt.core.runner`) reads the policy's parameters at every call, so
there is no copy and no weight sync, and the next ``generate`` after an optimizer step uses the
new weights. Each prompt is prefilled once and its KV prefix copied into its ``num_samples``
slots; finished rows free their slot at once and queued requests take it (continuous batching);
a decode step over ``n`` active rows is padded to a batch bucket and replayed from a captured
CUDA graph (`CUDAGraphProfileCache`), compiled with ``torch.compile(fullgraph=True)`` on CUDA.
Sampling is the exponential race of `lightning_tlt.core.sampling` (no host sync); the only
device-to-host copy per step is the small "finished" vector that the scheduler needs.

Models the runner does not know run through their own HF forward with ``past_key_values``
(`_generate_hf`): slower, no graphs, same contract.
"""

from __future__ import annotations

import functools
import inspect
import time
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_tlt.core.kv_cache import KVCache, kv_bytes_per_slot
from lightning_tlt.core.prompts import validate_prompts
from lightning_tlt.core.runner import ModelRunner, is_supported, unwrap_model
from lightning_tlt.core.sampling import processed_probs, sample, token_logprobs
from lightning_tlt.core.types import (
    FinishReason,
    RolloutOutput,
    SamplingConfig,
    SpeculativeConfig,
    StepEvent,
    StepListener,
)
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.rollout.cuda_graphs import CUDAGraphBackend, CUDAGraphProfileCache, GraphProfile
from lightning_tlt.rollout.scheduler import Request, SlotScheduler
from lightning_tlt.rollout.spec_decode import SpecDecoder, default_drafter

CPU_DEFAULT_SLOTS = 16
"""Slots on the CPU when neither ``max_batch_size`` nor a memory budget is given."""
MAX_AUTO_SLOTS = 256
"""Largest slot count chosen from a memory budget."""
CUDA_FREE_MEMORY_FRACTION = 0.4
"""Share of free CUDA memory the KV cache may take when no budget is given."""
_MAX_STOP_IDS = 8


def model_eos_ids(model: nn.Module) -> list[int]:
    """The model's eos id(s): ``generation_config.eos_token_id``, else ``config.eos_token_id``."""
    model = unwrap_model(model)
    for holder in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(holder, "eos_token_id", None)
        if eos is not None:
            return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
    return []


@dataclass
class _DecodeState:
    """Per-slot step state, static buffers that captured graphs read and write in place."""

    tokens: Tensor  # (S,) long: the next input token of each slot
    positions: Tensor  # (S,) long: its position (= the slot's KV length)
    num_generated: Tensor  # (S,) long
    finished: Tensor  # (S,) bool: finished, or an empty slot
    out_tokens: Tensor  # (S, M + 1) long: column M is a sink for inactive rows
    out_logprobs: Tensor  # (S, M + 1) float32
    stop_ids: Tensor  # (_MAX_STOP_IDS,) long, padded with -1
    max_new: Tensor  # () long
    hidden: Tensor  # (S, H) final hidden state at each slot's last fed token (EAGLE's feature)

    def tensors(self) -> list[Tensor]:
        return [self.tokens, self.positions, self.num_generated, self.finished, self.out_tokens, self.out_logprobs]

    def move_rows(self, src: Tensor, dst: Tensor) -> None:
        for t in [*self.tensors(), self.hidden]:
            t[dst] = t[src]


@dataclass
class _Pending:
    """A launched step whose finished flags are on their way to the host."""

    snapshot: list[Request]  # the request in each slot when the step was launched
    flags: Tensor  # (n,) bool, host side once ``event`` has completed
    event: Any  # torch.cuda.Event | None


@dataclass
class _Timers:
    phase_s: dict[str, float] = field(default_factory=dict)
    steps: dict[str, int] = field(default_factory=dict)

    def add(self, phase: str, seconds: float) -> None:
        self.phase_s[phase] = self.phase_s.get(phase, 0.0) + seconds
        self.steps[phase] = self.steps.get(phase, 0) + 1


class RolloutEngine:
    """Generates rollouts from a policy, in-process, over its own parameters.

    Args:
        model: an HF causal LM (Llama, Qwen2, Qwen3 run on the fast runner; others through their
            own forward). Wrappers with ``.module`` (DDP) are unwrapped. It is read, never copied.
        max_batch_size: slots (rows decoded together); ``None`` derives it from the memory budget.
        max_seq_len: longest prompt + completion a slot holds.
        memory_budget_bytes: KV-cache budget used to derive ``max_batch_size``; ``None`` takes a
            share of free CUDA memory, or `CPU_DEFAULT_SLOTS` slots on the CPU.
        use_cuda_graphs: capture decode steps as CUDA graphs; ``None``: on when on CUDA.
        compile: ``torch.compile(fullgraph=True)`` the model step; ``None``: on when on CUDA.
        speculative: when and how to speculate (see `SpeculativeConfig`); ``None`` never does.
        progress: show a tqdm bar over generated tokens.
        graph_memory_budget_bytes: budget of the graph cache (LRU eviction above it).
        prefill_chunk_tokens: most (padded) prompt tokens prefilled in one forward.
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
    ) -> None:
        if max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {max_seq_len!r}")
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1 or None, got {max_batch_size!r}")
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0 or None, got {memory_budget_bytes!r}")
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens must be >= 1, got {prefill_chunk_tokens!r}")
        self._model = model
        self.max_seq_len = max_seq_len
        self.speculative = speculative or SpeculativeConfig()
        self.progress = progress
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self._use_cuda_graphs = use_cuda_graphs
        self._compile = compile
        self._graph_memory_budget = graph_memory_budget_bytes
        self._memory_budget = memory_budget_bytes
        self._max_batch_size = max_batch_size
        self._listeners: list[StepListener] = []
        self._runner = ModelRunner(model) if is_supported(model) else None
        self._drafter: Any = default_drafter(self.speculative, model) if self.speculative.enabled else None
        self._drafter_handle = 0  # bumped whenever the drafter object is replaced (graph keys)
        self.drafter_version = 0
        """Version of the published drafter weights (`set_drafter` advances it)."""
        self._spec = SpecDecoder(self, self.speculative) if self.speculative.enabled and self._runner else None
        if self.speculative.enabled and self._runner is None:
            warnings.warn(
                f"{type(unwrap_model(model)).__name__} runs on the generic HF path, which does not speculate",
                stacklevel=2,
            )
        self._cache: KVCache | None = None
        self._state: _DecodeState | None = None
        self._graphs: CUDAGraphProfileCache | None = None
        self._gen: torch.Generator | None = None
        self._compiled: Callable[..., tuple[Tensor, Tensor]] | None = None
        self._layout: tuple[Any, ...] = ()
        self._param_ptrs: tuple[int, ...] = ()
        self._scheduler = SlotScheduler(1)
        self._prompt_features: dict[int, Tensor] = {}
        self._pinned: list[Tensor] = []
        self._pinned_next = 0
        self.last_stats: dict[str, float] = {}
        self._pending_adaptive: dict[str, Any] | None = None

    # ------------------------------------------------------------------ read-only properties
    @property
    def model(self) -> nn.Module:
        """The policy (as given, wrappers included)."""
        return self._model

    @property
    def _hf(self) -> Any:  # the unwrapped HF model, whose config and submodules are reached by name
        return unwrap_model(self._model)

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
        )
        budget = self._memory_budget
        if budget is None:
            if self.device.type != "cuda":
                return CPU_DEFAULT_SLOTS
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * CUDA_FREE_MEMORY_FRACTION)
        return max(1, min(MAX_AUTO_SLOTS, budget // per_slot))

    @property
    def tuner(self) -> Any:
        """The draft-length tuner (`DraftLengthTuner`, built at the first speculative ``generate``
        when ``num_draft_tokens`` is ``None``), or ``None``; its ``state_dict`` is what to checkpoint."""
        return None if self._spec is None else self._spec.tuner

    @property
    def graph_stats(self) -> dict[str, float]:
        """The graph cache's counters (empty before the first native ``generate``)."""
        return self._graphs.stats.as_dict() if self._graphs is not None else {}

    # ------------------------------------------------------------------ the drafter
    @property
    def drafter(self) -> Any:
        """What speculation drafts with (`SuffixDrafter`, a frozen `EagleDrafter`, ...), or ``None``.

        Assigning replaces it (the graphs captured for the old one are dropped); `set_drafter`
        publishes new weights, in place where it can.
        """
        return self._drafter

    @drafter.setter
    def drafter(self, drafter: Any) -> None:
        if drafter is self._drafter:
            return
        self._drafter = drafter
        self._drafter_handle += 1
        if self._graphs is not None:
            self._graphs.drop(lambda profile: profile.phase == "draft")

    def set_drafter(self, drafter: Any, version: int | None = None) -> bool:
        """Publish ``drafter`` to the engine; returns whether it was taken.

        An `EagleDrafter` whose weights are not all finite is refused with a warning (the engine
        keeps drafting with what it has: a diverged co-trained drafter never reaches a rollout).
        When the engine already drafts with an `EagleDrafter` of the same layout, the weights are
        copied into it in place (captured graphs stay valid); otherwise the engine takes a frozen
        `EagleDrafter.inference_copy` (or ``drafter`` itself when it is frozen already, or not an
        EAGLE drafter).

        Args:
            drafter: the drafter (a training `EagleDrafter` is copied, never held).
            version: the version to record; ``None`` advances `drafter_version` by one.
        """
        if isinstance(drafter, EagleDrafter):
            bad = [name for name, t in drafter.state_dict().items() if not bool(torch.isfinite(t).all())]
            if bad:
                warnings.warn(
                    f"refusing to publish a drafter with non-finite weights ({', '.join(bad[:3])}"
                    f"{', ...' if len(bad) > 3 else ''}); the engine keeps drafter version {self.drafter_version}",
                    stacklevel=2,
                )
                return False
            current = self._drafter
            if isinstance(current, EagleDrafter) and current is not drafter and _same_layout(current, drafter):
                with torch.no_grad():
                    source = drafter.state_dict()
                    for name, tensor in current.state_dict().items():
                        tensor.copy_(source[name])
            elif any(p.requires_grad for p in drafter.parameters()):
                self.drafter = drafter.inference_copy()
            else:
                self.drafter = drafter
        else:
            self.drafter = drafter
        self.drafter_version = self.drafter_version + 1 if version is None else int(version)
        return True

    # ------------------------------------------------------------------ adaptive state
    def adaptive_state_dict(self) -> dict[str, Any]:
        """What the engine has learned about speculating (the gate's and the tuner's state), for checkpoints."""
        spec = self._spec
        if spec is None:
            return {}
        return {
            "gate": None if spec.gate is None else spec.gate.state_dict(),
            "tuner": None if spec.tuner is None else spec.tuner.state_dict(),
        }

    def load_adaptive_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `adaptive_state_dict` returned (applied once the engine has built its parts)."""
        self._pending_adaptive = dict(state_dict) if state_dict else None
        self._apply_adaptive_state()

    def _apply_adaptive_state(self) -> None:
        state, spec = self._pending_adaptive, self._spec
        if state is None or spec is None:
            return
        if state.get("gate") is not None and spec.gate is not None:
            spec.gate.load_state_dict(state["gate"])
            state["gate"] = None
        if state.get("tuner") is not None and spec.tuner is not None:
            spec.tuner.load_state_dict(state["tuner"])
            state["tuner"] = None
        if state.get("gate") is None and state.get("tuner") is None:
            self._pending_adaptive = None

    # ------------------------------------------------------------------ listeners
    def add_listener(self, fn: StepListener) -> None:
        """Call ``fn(StepEvent)`` after every step, and once with phase "done" at the end."""
        self._listeners.append(fn)

    def remove_listener(self, fn: StepListener) -> None:
        self._listeners.remove(fn)

    def _emit(self, event: StepEvent) -> None:
        for fn in list(self._listeners):
            fn(event)

    # ------------------------------------------------------------------ validation
    def _validate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingConfig, num_samples: int
    ) -> list[tuple[int, ...]]:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples!r}")
        return validate_prompts(
            prompts, self.vocab_size, max_new_tokens=sampling.max_new_tokens, max_seq_len=self.max_seq_len
        )

    def _stop_ids(self, sampling: SamplingConfig) -> list[int]:
        ids = model_eos_ids(self._model) if sampling.stop_token_ids is None else list(sampling.stop_token_ids)
        if len(ids) > _MAX_STOP_IDS:
            raise ValueError(f"at most {_MAX_STOP_IDS} stop token ids are supported, got {ids!r}")
        return ids

    def _generator(self, generator: torch.Generator | None) -> torch.Generator:
        """The engine's device generator, seeded from ``generator`` (advancing it) or at random."""
        device = self.device
        if self._gen is None or self._gen.device != device:
            self._gen = torch.Generator(device)
        source = "cpu" if generator is None else generator.device
        seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=source).item())
        self._gen.manual_seed(seed)
        return self._gen

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
        ids = self._validate(prompts, sampling, num_samples)
        stop_ids = self._stop_ids(sampling)
        gen = self._generator(generator)
        requests = [Request(p * num_samples + g, p, ids[p]) for p in range(len(ids)) for g in range(num_samples)]
        was_training = self._hf.training
        self._hf.eval()
        try:
            if self._runner is None:
                return self._generate_hf(requests, sampling, stop_ids, gen)
            return self._generate_native(requests, sampling, stop_ids, gen)
        finally:
            self._hf.train(was_training)

    # ------------------------------------------------------------------ native path
    def _ensure_buffers(self) -> None:
        assert self._runner is not None
        spec = self._runner.spec
        device, dtype = self.device, self.dtype
        capture = self._capture_layers()
        layout = (device, dtype, self.num_slots if self._cache is None else self._cache.num_slots, capture)
        if self._cache is not None and self._layout == layout:
            return
        slots = self.num_slots
        # positions padded to a multiple of 64: aligned attention masks keep SDPA's fused kernels eligible
        room = (self.speculative.num_draft_tokens or max(self.speculative.draft_candidates)) + 1
        cache_len = -(-(self.max_seq_len + (room if self.speculative.enabled else 0)) // 64) * 64
        self._cache = KVCache.allocate(
            spec.num_layers, slots, cache_len, spec.num_kv_heads, spec.head_dim, device=device, dtype=dtype
        )
        m = self.max_seq_len
        self._state = _DecodeState(
            tokens=torch.zeros(slots, dtype=torch.long, device=device),
            positions=torch.zeros(slots, dtype=torch.long, device=device),
            num_generated=torch.zeros(slots, dtype=torch.long, device=device),
            finished=torch.ones(slots, dtype=torch.bool, device=device),
            out_tokens=torch.zeros(slots, m + 1, dtype=torch.long, device=device),
            out_logprobs=torch.zeros(slots, m + 1, dtype=torch.float32, device=device),
            stop_ids=torch.full((_MAX_STOP_IDS,), -1, dtype=torch.long, device=device),
            max_new=torch.zeros((), dtype=torch.long, device=device),
            hidden=torch.zeros(slots, spec.hidden_size * max(1, len(capture)), dtype=dtype, device=device),
        )
        on_cuda = device.type == "cuda"
        use_graphs = on_cuda if self._use_cuda_graphs is None else self._use_cuda_graphs
        if use_graphs and not on_cuda:
            warnings.warn("use_cuda_graphs=True without CUDA: running eagerly", stacklevel=3)
            use_graphs = False
        backend = None
        if use_graphs:
            assert self._gen is not None
            backend = CUDAGraphBackend(device, generators=[self._gen])
        self._graphs = CUDAGraphProfileCache(
            backend, max_batch=slots, memory_budget_bytes=self._graph_memory_budget
        )
        use_compile = on_cuda if self._compile is None else self._compile
        self._compiled = self._model_step
        if use_compile:
            # the batch dimension turns dynamic after the second bucket: two compilations serve all buckets
            self._compiled = torch.compile(self._model_step, fullgraph=True)
        if self._spec is not None:
            self._spec.allocate(slots, cache_len, device, dtype)
        self._pinned = [torch.zeros(slots, dtype=torch.bool, pin_memory=on_cuda) for _ in range(2)]
        self._pinned_next = 0
        self._layout = layout

    def _check_params(self) -> None:
        """Captured graphs hold parameter addresses: drop them if a parameter tensor was replaced."""
        ptrs = tuple(p.data_ptr() for p in self._hf.parameters())
        if ptrs != self._param_ptrs and self._graphs is not None:
            self._graphs.clear()
        self._param_ptrs = ptrs

    def _capture_layers(self) -> tuple[int, ...]:
        """HF ``hidden_states`` indices an EAGLE-3 drafter reads (``()``: the last hidden state)."""
        layers = getattr(self.drafter, "feature_layers", None) if self._spec_on_runner else None
        return tuple(layers) if layers else ()

    @property
    def _spec_on_runner(self) -> bool:
        return self.speculative.enabled and self._runner is not None

    def _model_step(
        self, tokens: Tensor, positions: Tensor, k: list[Tensor], v: list[Tensor], capture: tuple[int, ...] = ()
    ) -> tuple[Tensor, Tensor]:
        """Logits ``(B, q, V)`` and features ``(B, q, F)``: the last hidden state, or the EAGLE-3
        concatenation of the ``capture`` layers' hidden states."""
        assert self._runner is not None
        out = self._runner.forward(tokens, positions, k, v, capture_layers=capture)
        assert out.logits is not None
        if not capture:
            return out.logits, out.hidden
        return out.logits, torch.cat([out.layer_hidden[i] for i in capture], dim=-1)

    def _sample(self, logits: Tensor, sampling: SamplingConfig) -> tuple[Tensor, Tensor]:
        """``(B, V)`` logits -> sampled tokens ``(B,)`` and their logprobs ``(B,)``."""
        if sampling.greedy:
            return logits.argmax(-1), torch.zeros(logits.shape[0], device=logits.device)
        probs = processed_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        tokens = sample(probs, self._gen)
        return tokens, token_logprobs(probs, tokens)

    def _decode_step(self, batch: int, sampling: SamplingConfig) -> None:
        """One decode step over slots ``0..batch-1``, in place on the static state (graph-capturable)."""
        st, cache = self._state, self._cache
        assert st is not None and cache is not None and self._compiled is not None
        tokens, positions = st.tokens[:batch], st.positions[:batch]
        capture = self._capture_layers()
        logits, hidden = self._compiled(tokens[:, None], positions[:, None], cache.k, cache.v, capture)
        new, logp = self._sample(logits[:, -1], sampling)
        active = ~st.finished[:batch]
        st.hidden[:batch] = hidden[:, -1]
        count = st.num_generated[:batch]
        column = torch.where(active, count, st.out_tokens.shape[1] - 1)[:, None]
        st.out_tokens[:batch].scatter_(1, column, new[:, None])
        st.out_logprobs[:batch].scatter_(1, column, logp[:, None].float())
        count = count + active.long()
        stop = (new[:, None] == st.stop_ids[None, :]).any(-1)
        st.finished[:batch] = st.finished[:batch] | (active & (stop | (count >= st.max_new)))
        st.num_generated[:batch] = count
        st.tokens[:batch] = torch.where(active, new, tokens)
        st.positions[:batch] = positions + active.long()

    def _snapshot(self) -> Callable[[], None]:
        """Save the step state (and generator) so a graph warm-up leaves no trace; returns the restore."""
        st = self._state
        assert st is not None and self._gen is not None
        tensors = [*st.tensors(), st.hidden]
        if self._spec is not None and self._spec.buffers is not None:
            tensors += self._spec.buffers.state_tensors()
        saved = [t.clone() for t in tensors]
        gen_state = self._gen.get_state()

        def restore() -> None:
            for t, s in zip(tensors, saved):
                t.copy_(s)
            self._gen.set_state(gen_state)  # type: ignore[union-attr]

        return restore

    def _run_step(self, profile: GraphProfile, fn: Callable[[], None]) -> None:
        graphs = self._graphs
        assert graphs is not None
        if graphs.enabled and profile not in graphs:
            restore = self._snapshot()
            graphs.capture([profile], lambda _: fn)
            restore()
        try:
            graphs.run(profile, fn)
        except Exception as err:
            if self._compiled is self._model_step:
                raise
            # a compiler failure must cost speed, not the rollout: continue uncompiled
            warnings.warn(f"torch.compile of the decode step failed ({err!r}); running it uncompiled", stacklevel=2)
            self._compiled = self._model_step
            graphs.clear()
            self._run_step(profile, fn)

    def _prefill(self, admitted: list[tuple[int, Request]]) -> None:
        """Fill the KV prefix (all prompt tokens but the last) of newly admitted slots.

        Each distinct prompt is prefilled once; a prompt whose sibling is already decoding copies
        that sibling's prefix instead. The last prompt token is fed by the next decode step,
        which samples the first completion token.
        """
        st, cache, runner = self._state, self._cache, self._runner
        assert st is not None and cache is not None and runner is not None
        device = self.device
        new_slots = {slot for slot, _ in admitted}
        by_prompt: dict[int, list[int]] = {}
        prompt_of: dict[int, tuple[int, ...]] = {}
        for slot, request in admitted:
            by_prompt.setdefault(request.prompt_index, []).append(slot)
            prompt_of[request.prompt_index] = request.prompt
        copy_src: list[int] = []
        copy_dst: list[int] = []
        to_prefill: list[int] = []
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
            cache.copy_slots(torch.tensor(copy_dst, device=device), torch.tensor(copy_src, device=device), length)
        # prefill distinct prompts in chunks of at most prefill_chunk_tokens padded tokens, longest first
        to_prefill.sort(key=lambda p: -len(prompt_of[p]))
        while to_prefill:
            longest = len(prompt_of[to_prefill[0]]) - 1
            n = max(1, min(len(to_prefill), self.prefill_chunk_tokens // longest))
            chunk, to_prefill = to_prefill[:n], to_prefill[n:]
            tokens = torch.zeros(len(chunk), longest, dtype=torch.long)
            for row, p in enumerate(chunk):
                prefix = prompt_of[p][:-1]
                tokens[row, : len(prefix)] = torch.tensor(prefix)
            spec = runner.spec
            scratch = KVCache.allocate(
                spec.num_layers, len(chunk), longest, spec.num_kv_heads, spec.head_dim,
                device=device, dtype=cache.dtype,
            )
            positions = torch.arange(longest, device=device)[None].expand(len(chunk), longest)
            capture = self._capture_layers()
            out = runner.forward(tokens.to(device), positions, scratch.k, scratch.v, prefill=True, logits=False,
                                 capture_layers=capture)
            hidden = torch.cat([out.layer_hidden[i] for i in capture], -1) if capture else out.hidden
            last = torch.tensor([len(prompt_of[p]) - 2 for p in chunk], device=device)
            features = hidden[torch.arange(len(chunk), device=device), last]  # (Bp, F)
            for row, p in enumerate(chunk):  # what an EAGLE drafter reads first (no re-prefill needed)
                self._prompt_features[p] = features[row]
            dst = [s for p in chunk for s in by_prompt[p]]
            src = [row for row, p in enumerate(chunk) for _ in by_prompt[p]]
            cache.write_prefix(torch.tensor(dst, device=device), scratch.k, scratch.v, torch.tensor(src, device=device))
        slot_ids = torch.tensor([s for s, _ in admitted], device=device)
        zero = st.hidden.new_zeros(st.hidden.shape[1])
        st.hidden[slot_ids] = torch.stack([self._prompt_features.get(r.prompt_index, zero) for _, r in admitted])
        st.tokens[slot_ids] = torch.tensor([r.prompt[-1] for _, r in admitted], device=device)
        st.positions[slot_ids] = torch.tensor([len(r.prompt) - 1 for _, r in admitted], device=device)
        st.num_generated[slot_ids] = 0
        st.finished[slot_ids] = False

    def _generate_native(
        self, requests: list[Request], sampling: SamplingConfig, stop_ids: list[int], gen: torch.Generator
    ) -> RolloutOutput:
        self._ensure_buffers()
        self._check_params()
        st, graphs = self._state, self._graphs
        assert st is not None and graphs is not None
        st.finished.fill_(True)
        st.positions.zero_()
        st.tokens.zero_()
        st.stop_ids.fill_(-1)
        if stop_ids:
            st.stop_ids[: len(stop_ids)] = torch.tensor(stop_ids, device=st.stop_ids.device)
        st.max_new.fill_(sampling.max_new_tokens)
        sampling_key = (sampling.greedy, sampling.temperature, sampling.top_k, sampling.top_p)
        self._scheduler = sched = SlotScheduler(self._cache.num_slots, requests)  # type: ignore[union-attr]
        results: dict[int, tuple[list[int], list[float]]] = {}
        timers = _Timers()
        bar = self._progress_bar(len(requests) * sampling.max_new_tokens)
        counters = {"step": 0, "tokens": 0}
        pending: deque[_Pending] = deque()
        spec = self._spec
        self._prompt_features = {}
        if spec is not None:
            spec.begin()
            self._apply_adaptive_state()
        start = last = time.perf_counter()
        while True:
            admitted = sched.admit()
            if admitted:
                t0 = time.perf_counter()
                self._prefill(admitted)
                dt = time.perf_counter() - t0
                timers.add("prefill", dt)
                counters["step"] += 1
                self._emit(StepEvent(counters["step"], "prefill", sched.num_active, sched.num_queued,
                                     sched.num_slots, dt))
            n = sched.num_active
            if n and spec is not None and spec.wants(n):
                while pending:  # speculation reads the rows' state: settle the plain steps in flight
                    now = time.perf_counter()
                    self._process(pending.popleft(), results, timers, counters, bar, now - last)
                    last = now
                n = sched.num_active
                if n == 0:
                    continue
                new_tokens, dt = spec.step(n, sampling, sampling_key)
                done_slots = st.finished[:n].nonzero().flatten().tolist()
                if done_slots:
                    self._harvest(done_slots, results)
                timers.add("speculative", dt)
                counters["step"] += 1
                counters["tokens"] += new_tokens
                if bar is not None:
                    bar.update(new_tokens)
                last = time.perf_counter()
                self._emit(StepEvent(counters["step"], "speculative", sched.num_active, sched.num_queued,
                                     sched.num_slots, dt, new_tokens=new_tokens))
                continue
            if n:
                batch = graphs.bucket(n)
                profile = GraphProfile("decode", batch, 1, sampling_key)
                self._run_step(profile, functools.partial(self._decode_step, batch, sampling))
                pending.append(self._flags(list(sched.active)))
                if spec is not None:
                    spec.plain_step()
            if not pending:
                break
            # process the previous step's flags while this one runs (one step of lag, no bubble)
            if len(pending) > 1 or not n:
                now = time.perf_counter()
                self._process(pending.popleft(), results, timers, counters, bar, now - last)
                last = now
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - start
        self._emit(StepEvent(counters["step"], "done", 0, 0, sched.num_slots, 0.0))
        return self._output(requests, results, stop_ids, sampling, timers, wall, counters["step"], counters["tokens"])

    def _flags(self, snapshot: list[Request]) -> _Pending:
        """Start the copy of the step's finished flags to the host, without waiting for it."""
        st = self._state
        assert st is not None
        n = len(snapshot)
        if st.finished.device.type != "cuda":
            return _Pending(snapshot, st.finished[:n].clone(), None)
        buf = self._pinned[self._pinned_next]
        self._pinned_next ^= 1
        buf[:n].copy_(st.finished[:n], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return _Pending(snapshot, buf[:n], event)

    def _process(
        self,
        done: _Pending,
        results: dict[int, tuple[list[int], list[float]]],
        timers: _Timers,
        counters: dict[str, int],
        bar: Any,
        dt: float,
    ) -> None:
        """Harvest the rows a finished step ended, and tell the listeners about that step."""
        if done.event is not None:
            done.event.synchronize()
        flags = done.flags.tolist()
        live = [r for r in done.snapshot if r.index not in results]
        new_tokens = len(live)
        ended = [r for r, f in zip(done.snapshot, flags) if f and r.index not in results]
        if ended:
            slot_of = {r.index: s for s, r in enumerate(self._scheduler.active)}
            self._harvest([slot_of[r.index] for r in ended], results)
        sched = self._scheduler
        timers.add("decode", dt)
        if self._spec is not None:
            self._spec.metrics.update_step(False, "decode", new_tokens, dt)
        counters["step"] += 1
        counters["tokens"] += new_tokens
        if bar is not None:
            bar.update(new_tokens)
        self._emit(StepEvent(counters["step"], "decode", sched.num_active, sched.num_queued, sched.num_slots, dt,
                             new_tokens=new_tokens))

    def _harvest(self, done_slots: list[int], results: dict[int, tuple[list[int], list[float]]]) -> None:
        """Read finished rows' completions, free their slots and repack the active rows."""
        st, cache, sched = self._state, self._cache, self._scheduler
        assert st is not None and cache is not None
        idx = torch.tensor(done_slots, device=st.tokens.device)
        counts = st.num_generated[idx].cpu().tolist()
        longest = max(counts)
        toks = st.out_tokens[idx, :longest].cpu().tolist()
        lps = st.out_logprobs[idx, :longest].cpu().tolist()
        finished, moves = sched.release(done_slots)
        for request, c, t, lp in zip(finished, counts, toks, lps):
            results[request.index] = (t[:c], lp[:c])
        if self._spec is not None:
            self._spec.finished(finished)
        if moves:
            src = torch.tensor([s for s, _ in moves], device=idx.device)
            dst = torch.tensor([d for _, d in moves], device=idx.device)
            cache.copy_slots(dst, src)
            st.move_rows(src, dst)
            if self._spec is not None:
                self._spec.move_rows(src, dst)
        st.finished[sched.num_active :] = True

    def _output(
        self,
        requests: list[Request],
        results: dict[int, tuple[list[int], list[float]]],
        stop_ids: list[int],
        sampling: SamplingConfig,
        timers: _Timers,
        wall: float,
        steps: int,
        tokens_total: int,
    ) -> RolloutOutput:
        stops = set(stop_ids)
        completions = [results[r.index][0] for r in requests]
        reasons: list[FinishReason] = ["stop" if c and c[-1] in stops else "length" for c in completions]
        generated = sum(len(c) for c in completions)
        stats: dict[str, float] = {
            "tokens": float(generated),
            "steps": float(steps),
            "row_steps": float(tokens_total),
            "wall_time_s": wall,
            "tokens_per_s": generated / wall if wall > 0 else 0.0,
        }
        for phase, seconds in timers.phase_s.items():
            stats[f"time_{phase}_s"] = seconds
            stats[f"steps_{phase}"] = float(timers.steps[phase])
        if self._spec is not None and self._runner is not None:
            stats.update(self._spec.stats())
        if self._graphs is not None and self._graphs.enabled:
            stats.update({f"graphs_{k}": float(v) for k, v in self._graphs.stats.as_dict().items()})
        self.last_stats = stats
        return RolloutOutput(
            prompt_ids=[list(r.prompt) for r in requests],
            completion_ids=completions,
            logprobs=[results[r.index][1] for r in requests],
            finish_reasons=reasons,
            stats=stats,
        )

    def _progress_bar(self, total: int) -> Any:
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="tok", desc="rollout", leave=False)

    # ------------------------------------------------------------------ generic HF fallback
    def _generate_hf(
        self, requests: list[Request], sampling: SamplingConfig, stop_ids: list[int], gen: torch.Generator
    ) -> RolloutOutput:
        """Waves of ``num_slots`` rows through the model's own forward with ``past_key_values``."""
        model, device = self._hf, self.device
        stops = torch.tensor(stop_ids or [-1], device=device)
        results: dict[int, tuple[list[int], list[float]]] = {}
        timers = _Timers()
        slots = self.num_slots
        step = tokens_total = 0
        bar = self._progress_bar(len(requests) * sampling.max_new_tokens)
        start = time.perf_counter()
        for w in range(0, len(requests), slots):
            wave = requests[w : w + slots]
            width = max(len(r.prompt) for r in wave)
            ids = torch.zeros(len(wave), width, dtype=torch.long)
            mask = torch.zeros(len(wave), width, dtype=torch.long)
            for row, r in enumerate(wave):  # left padding
                ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
                mask[row, width - len(r.prompt) :] = 1
            ids, mask = ids.to(device), mask.to(device)
            position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
            finished = torch.zeros(len(wave), dtype=torch.bool, device=device)
            out_t: list[Tensor] = []
            out_lp: list[Tensor] = []
            past = None
            cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            t0 = time.perf_counter()
            for i in range(sampling.max_new_tokens):
                out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                            **{cache_kw: past})
                past = getattr(out, "past_key_values", None) or getattr(out, "cache", None)
                new, logp = self._sample(out.logits[:, -1], sampling)
                new = torch.where(finished, torch.zeros_like(new), new)
                out_t.append(new)
                out_lp.append(logp)
                active = int((~finished).sum())
                tokens_total += active
                if bar is not None:
                    bar.update(active)
                finished = finished | (new[:, None] == stops[None]).any(-1)
                dt = time.perf_counter() - t0
                timers.add("prefill" if i == 0 else "decode", dt)
                step += 1
                remaining = int((~finished).sum())
                self._emit(StepEvent(step, "prefill" if i == 0 else "decode", remaining,
                                     len(requests) - w - len(wave), slots, dt, new_tokens=active))
                t0 = time.perf_counter()
                if remaining == 0:
                    break
                ids = new[:, None]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                position_ids = position_ids[:, -1:] + 1
            toks = torch.stack(out_t, 1).tolist()
            lps = torch.stack(out_lp, 1).tolist()
            for r, t, lp in zip(wave, toks, lps):
                n = next((j + 1 for j, tok in enumerate(t) if tok in stop_ids), len(t))
                results[r.index] = (t[:n], lp[:n])
        if bar is not None:
            bar.close()
        wall = time.perf_counter() - start
        self._emit(StepEvent(step, "done", 0, 0, slots, 0.0))
        return self._output(requests, results, stop_ids, sampling, timers, wall, step, tokens_total)


def _same_layout(a: EagleDrafter, b: EagleDrafter) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape for k in sa)
