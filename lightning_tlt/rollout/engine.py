"""`RolloutEngine`: continuous-batching generation over the policy's own parameters.

The engine samples rollouts from the model that Lightning is training, in the same process: the
functional runner (`lightning_tlt.core.runner`) reads the policy's parameters at every call, so
there is no copy and no weight sync, and the next ``generate`` after an optimizer step uses the
new weights. Each prompt is prefilled once and its KV prefix copied into its ``num_samples``
slots; finished rows free their slot at once and queued requests take it (continuous batching).

A step over ``n`` active rows is padded to a batch bucket and replayed from a captured CUDA graph
(`CUDAGraphProfileCache`): the policy's forward, compiled once with ``torch.compile``; attention
that reads each row's own length (`lightning_tlt.core.attention`); the sampling and the state
update compiled with it (`lightning_tlt.rollout.steps`). `RolloutEngine` is the one orchestrator,
built from parts of a few hundred lines each: `EngineState` (`engine_state.py`: settings, read-only
properties, listeners), `DrafterHosting` (`drafter_hosting.py`: the drafter, its publication and
staging, the adaptive state), `StepRunner` (`step_runner.py`: buffers, the compiled forward,
graph-replayed steps, prefill) and `DecodeLoop` (`decode_loop.py`), which runs a call:

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

import time
from collections.abc import Sequence
from typing import Any

import torch

from lightning_tlt.core.prompts import check_stop_ids, policy_positions, validate_prompts
from lightning_tlt.core.runner import eos_token_ids
from lightning_tlt.core.sampling import call_seed, row_keys
from lightning_tlt.core.types import (
    RolloutOutput,
    SamplingConfig,
    StepEvent,
)
from lightning_tlt.rollout.decode_loop import CallState, DecodeLoop
from lightning_tlt.rollout.engine_state import (
    CPU_DEFAULT_SLOTS,
    CUDA_FREE_MEMORY_FRACTION,
    MAX_AUTO_SLOTS,
    default_drafter,
    draft_cost_model,
)
from lightning_tlt.rollout.hf_fallback import generate_hf
from lightning_tlt.rollout.scheduler import Request
from lightning_tlt.rollout.slot_state import MAX_STOP_IDS

__all__ = [
    "CPU_DEFAULT_SLOTS",
    "CUDA_FREE_MEMORY_FRACTION",
    "MAX_AUTO_SLOTS",
    "RolloutEngine",
    "default_drafter",
    "draft_cost_model",
]


class RolloutEngine(DecodeLoop):
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
        background_compile: compile the speculative steps in a child process while the first calls decode
            without speculation, when the compile cache holds none of them yet
            (`lightning_tlt.rollout.background_compile`): a cold first RL step costs what speculation off
            costs. ``None``: on when ``LIGHTNING_TLT_BACKGROUND_COMPILE=1``.
    """

    @property
    def background_compile_job(self) -> Any:
        """The child compiling speculation (`BackgroundCompile`), or ``None``: not started (off, warm, eager)."""
        return self._background

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
        seed = call_seed(generator)
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
        run = CallState(bar=self._progress_bar(len(requests) * sampling.max_new_tokens))
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

    def _progress_bar(self, total: int) -> Any:
        if not self.progress:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, unit="tok", desc="rollout", leave=False)
