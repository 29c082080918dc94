"""`StepRunner`: the engine's buffers, its compiled forward and its graph-replayed steps, and prefill.

The KV cache and `SlotState` are allocated for a layout (device, dtype, slots, the layers an EAGLE-3
drafter reads) and kept while it holds; the steps compile once (`torch.compile`, every batch bucket
and draft length one version) and each step profile is captured once (`CUDAGraphProfileCache`); a
compiler failure continues uncompiled. Prefill writes each distinct prompt's KV prefix once into
all its slots (and runs an EAGLE drafter over it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import Tensor

from lightning_tlt.core.compile_cache import CompileCache, device_key
from lightning_tlt.core.kv_cache import KVCache
from lightning_tlt.core.stored_compile import CompileStore
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.rollout.cuda_graphs import (
    DEFAULT_BUCKETS,
    CUDAGraphBackend,
    CUDAGraphProfileCache,
    GraphBackend,
    GraphProfile,
)
from lightning_tlt.rollout.drafter_hosting import DrafterHosting
from lightning_tlt.rollout.scheduler import Request
from lightning_tlt.rollout.slot_state import SlotState
from lightning_tlt.rollout.spec_step import SpeculativeStep, StepContext, graph_group
from lightning_tlt.rollout.steps import (
    PolicyRegions,
    SamplingKey,
    allow_recompiles,
    compile_settings,
    decode_update,
    policy_step,
    regions_enabled,
    rows_dynamic,
)


class StepRunner(DrafterHosting):
    """Buffers, forward and steps of the engine (see the module's docstring)."""

    def allocate_buffers(self) -> None:
        """Allocate the buffers of the current layout now, if not yet: the KV cache, `slot_state`, the graph
        cache and the speculative step (the first native ``generate`` does it; a new layout, e.g. after a
        drafter reading other layers, allocates anew)."""
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
        if self._graphs is not None:  # closed now: its streams are given back before the new cache takes any
            self._graphs.clear()
        self._graphs = CUDAGraphProfileCache(
            backend, buckets=buckets, max_batch=slots, memory_budget_bytes=self._graph_memory_budget,
            group_of=graph_group,
        )
        self._forward, self._decode_update = policy_step, decode_update
        self._compiled = use_compile
        store = None
        if use_compile:
            allow_recompiles()
            store = self._compile_store(capture)
            # one version of each step function for every batch bucket and draft length: the forward's
            # rows (and a verify's tokens per row) are dynamic (`rows_dynamic`), the updates are dynamic
            # throughout; the forward has two versions, decode (one token a row, which Dynamo
            # specialises) and verify. Each version is stored: a restart loads it without tracing. By region
            # (the default), one decoder layer is compiled, which every layer runs.
            self._forward = PolicyRegions(store) if regions_enabled() else store.compile(
                policy_step, dynamic_dims=rows_dynamic)
            self._decode_update = store.compile(decode_update, dynamic=True)
        if self._spec_on:
            self._spec_step = SpeculativeStep(self.max_draft_tokens, self._vocab, compiler=store,
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

    def use_graph_backend(self, backend: GraphBackend) -> CUDAGraphProfileCache:
        """Allocate the buffers now and capture every step with ``backend`` from now on (until the buffers'
        layout changes): another capture mechanism, or a test double that records what is captured.

        The new graph cache has the engine's batch buckets, slots and graph memory budget; it is returned.
        """
        self.allocate_buffers()
        assert self._graphs is not None
        self._graphs.clear()
        self._graphs = CUDAGraphProfileCache(backend, buckets=self._graphs.buckets, max_batch=self.num_slots,
                                             memory_budget_bytes=self._graph_memory_budget, group_of=graph_group)
        return self._graphs

    def _compile_store(self, capture: tuple[int, ...]) -> CompileStore:
        """This layout's compile cache: Inductor's artifacts loaded (once per process) and tracked for saving,
        and the store of compiled versions (`lightning_tlt.core.stored_compile`), both under one key."""
        assert self._runner is not None
        if self._compile_cache_dir is None:
            self._tracker.cache = None
            return CompileStore(None)
        key = {"model": dataclasses.asdict(self._runner.spec), "dtype": str(self.dtype),
               "device": device_key(self.device), "attention": self.attention,
               "fuse_projections": self._runner.fuse_projections, "capture_layers": list(capture)}
        cache = CompileCache(self._compile_cache_dir, key)
        cache.load()
        self._tracker.cache = cache
        return CompileStore(self._compile_cache_dir, key)

    def _check_params(self) -> None:
        """Captured graphs hold parameter addresses: drop them if a parameter tensor was replaced."""
        ptrs = tuple(p.data_ptr() for p in self._hf.parameters())
        if ptrs != self._param_ptrs and self._graphs is not None:
            self._graphs.clear()
        self._param_ptrs = ptrs

    def step_context(self) -> StepContext:
        """What a step runs in: the buffers, the forward, the graph cache and the graph-replaying step runner
        (the `SpeculativeStep`'s argument; after `allocate_buffers`)."""
        assert self._state is not None and self._cache is not None and self._graphs is not None
        assert self._forward is not None and self._gen is not None
        # the forward is looked up at each call: a compiler failure swaps in the uncompiled one mid-step
        return StepContext(self._state, self._cache, self._call_forward, self._graphs, self._run_step, self._gen,
                           self._capture_layers(), self.attention)

    def _call_forward(self, tokens: Tensor, positions: Tensor, *args: Any) -> tuple[Tensor, Tensor]:
        """`policy_step` on the engine's policy (compiled: one version for every batch bucket, over the policy's
        `ModelRunner.frozen` view)."""
        assert self._forward is not None and self._runner is not None
        return self._forward(self._runner.frozen() if self._compiled else self._runner, tokens, positions, *args)

    # ------------------------------------------------------------------ steps
    def _decode_step(self, batch: int, sampling: SamplingKey, kv_len: int | None) -> None:
        """One plain decode step over slots ``0..batch-1``, in place (graph-capturable)."""
        st, cache = self._state, self._cache
        assert st is not None and cache is not None and self._forward is not None
        capture = self._capture_layers()
        logits, hidden = self._call_forward(st.tokens[:batch, None], st.positions[:batch, None], cache.k, cache.v,
                                            capture, kv_len)
        self._decode_update(st, logits, hidden, sampling)

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
            self._forward, self._decode_update = policy_step, decode_update
            if self._spec_step is not None:
                self._spec_step.use_eager()
            graphs.clear()
            self._run_step(profile, fn)  # fn reads the (now eager) functions at call time

    def _compiling(self) -> contextlib.AbstractContextManager[None]:
        """Around every call of the steps: compiled, they compile under `compile_settings`."""
        return compile_settings() if self._compiled else contextlib.nullcontext()

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
                dscratch = self._spec_step.prefill_drafter(self.step_context(), drafter, hidden, tokens[:, 1:],
                                                           last + 1)  # fmt: skip
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
