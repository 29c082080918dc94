"""`DrafterTrainer`: the drafter's train step on static-shape packed batches, captured once as a CUDA graph.

TLT (arXiv 2511.16665) trains the drafter while the long tail of rollouts leaves the GPU nearly
idle. To use those stalls the step must cost the decode loop almost nothing on the host: here one
step (gather of a packed batch from the replay buffer, forward, EAGLE loss, backward, gradient
clipping, AdamW update, statistics) is one function with no host sync, so on CUDA it is captured
once as a graph and each later step is a ``copy_`` of a small batch plan plus ``graph.replay()`` on
a side stream: the decode loop enqueues it and never waits for it.

The capture follows PyTorch's whole-network recipe (``torch.cuda.graphs``): static inputs (the
plan) refilled by ``copy_``; ``torch.optim.AdamW(fused=True, capturable=True)`` with the learning
rate a device tensor computed inside the step (the warmup); gradients set to ``None`` before the
capture so that the captured backward owns them; warm-up iterations on the side stream before the
capture (with the update held back, so they change nothing); autocast without its weight cache.
A non-finite loss or gradient norm skips the update on the device through the fused AdamW's
``found_inf`` (as under ``GradScaler``: parameters, moments and step count untouched).

The same function runs everywhere (`DrafterTrainConfig.execution`):

- ``"graph"``: CUDA, captured and replayed on a side stream (``"auto"`` on CUDA);
- ``"stream"``: CUDA, the same step run eagerly on the side stream (where capture is not possible:
  it is the fallback when the capture raises);
- ``"eager"``: run at once on the calling thread (``"auto"`` on the CPU);
- ``"deferred"``: queued on the host and run at `DrafterTrainer.wait` (what a side stream does, made
  visible on the CPU; the ordering tests use it).

The ordering contract with the policy (`wait`, `resume_after_main`): the drafter reads the
policy's embedding and LM head by reference, so the main stream must wait for queued drafter steps
before the policy's optimizer overwrites them (`wait`), and the side stream must wait for the main
stream's writes at the step boundary (new features in the buffer, published or averaged weights)
before it trains on (`resume_after_main`).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lightning_tlt.drafters import side_streams
from lightning_tlt.drafters.buffer import FeatureReplayBuffer
from lightning_tlt.drafters.eagle import EagleBatch, EagleDrafter
from lightning_tlt.drafters.loss import DrafterLossOutput, eagle_loss
from lightning_tlt.drafters.side_streams import GREEN_CONTEXTS

Execution = Literal["auto", "graph", "stream", "eager", "deferred"]
_EXECUTIONS = ("auto", "graph", "stream", "eager", "deferred")
_STATS = ("applied", "skipped", "loss", "feature_loss", "token_loss", "top1_accuracy", "accept_rate", "num_rows")
_WARMUP_ITERATIONS = 3  # eager iterations on the side stream before the capture (PyTorch's recipe)


@dataclass
class DrafterTrainConfig:
    """How the drafter is trained: batch shape, AdamW, loss weights, execution (TLT's defaults where it has one)."""

    batch_size: int = 8
    """Rows per drafter step."""
    max_len: int = 512
    """Draft rows per batch row (the static length; rows pack windows of several sequences)."""
    pack_segments: int = 32
    """Most sequence windows packed into one batch row."""
    learning_rate: float = 1e-4
    """AdamW peak learning rate (TLT's 1e-6 assumes a drafter trained offline first)."""
    weight_decay: float = 0.01
    """AdamW weight decay (TLT: 0.01)."""
    adam_beta1: float = 0.9
    """AdamW beta1 (TLT: 0.9)."""
    adam_beta2: float = 0.95
    """AdamW beta2 (TLT: 0.95)."""
    warmup_steps: int = 10
    """Linear warmup of the learning rate over this many drafter steps."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (TLT: 1.0); 0 disables it."""
    feature_weight: float = 1.0
    """Weight of the SmoothL1 feature term (EAGLE: 1.0)."""
    token_weight: float = 0.1
    """Weight of the soft cross-entropy term (EAGLE: 0.1)."""
    eval_temperature: float = 1.0
    """Temperature of the acceptance rate ``Σ min(p, q)`` in the statistics and held-out evaluations."""
    execution: Execution = "auto"
    """"graph" (CUDA graph on a side stream), "stream" (eager on a side stream), "eager" (at once),
    "deferred" (queued, run at `DrafterTrainer.wait`), or "auto": "graph" on CUDA, "eager" on the CPU."""
    max_queued: int = 4
    """Most drafter steps in flight on the side stream (further requests wait for a later event)."""
    side_stream_sms: int | Literal["auto"] | None = "auto"
    """SMs the side stream's kernels may use (a CUDA green context, `torch.cuda.green_contexts`), so
    drafter steps leave the rest to decode instead of holding every SM for their whole run (stream
    priorities cannot do that: they order blocks waiting to start, not blocks running); ``None``: all
    SMs; ``"auto"`` (the default): a quarter of the device's, in steps of 8 (32 on an H100 or H200), where
    torch has green contexts and the device at least 32 SMs, else all (`lightning_tlt.drafters.side_streams.auto_sms`).
    Measured at 0.5 B: 32 SMs gave the most drafter steps a stall-second under a capped decode slowdown (16, 32
    and 64 SMs and all on the H200), and 2.1-2.8x the drafter steps an RL step of all SMs at the same 5 % in the
    e2e on an H100 (docs/benchmarks.md). Applies to ``"graph"`` and ``"stream"`` execution only (the CPU has no
    side stream)."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_len", "pack_segments", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(f"adam betas must be in [0, 1), got ({self.adam_beta1!r}, {self.adam_beta2!r})")
        if not self.max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0, got {self.max_grad_norm!r}")
        if not self.eval_temperature > 0:
            raise ValueError(f"eval_temperature must be > 0, got {self.eval_temperature!r}")
        if self.execution not in _EXECUTIONS:
            raise ValueError(f"execution must be one of {_EXECUTIONS}, got {self.execution!r}")
        if not side_streams.is_setting(self.side_stream_sms):
            raise ValueError(f"side_stream_sms must be 'auto', None (every SM) or a count >= 1, "
                             f"got {self.side_stream_sms!r}")


class DrafterTrainer:
    """Trains an `EagleDrafter` on a `FeatureReplayBuffer`, one static-shape step at a time.

    Args:
        drafter: the drafter to train (half-precision weights are turned into float32 master
            weights: an AdamW step of about ``lr`` is below one bf16 unit of weights of about 0.02;
            the forward runs under autocast in ``compute_dtype``).
        buffer: where batches come from.
        config: the settings.
        compute_dtype: the dtype the forward runs in (autocast where it is half); ``None``: the
            policy's (its embedding's). A policy with float32 master weights trained under
            ``bf16-mixed`` passes ``torch.bfloat16``: in float32 the step's full-vocabulary head
            matmuls took about 100 ms of an H200 per step at 0.5 B, beside decode.
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        buffer: FeatureReplayBuffer,
        config: DrafterTrainConfig,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.drafter = drafter
        self.buffer = buffer
        self.compute_dtype = compute_dtype or drafter.embed_weight.dtype
        if drafter.fc.weight.dtype in (torch.float16, torch.bfloat16):
            drafter.float()
        drafter.train()
        self.device = drafter.fc.weight.device
        execution = config.execution
        if execution == "auto":
            execution = "graph" if self.device.type == "cuda" else "eager"
        if execution in ("graph", "stream") and self.device.type != "cuda":
            raise ValueError(f"execution {execution!r} needs a CUDA drafter, got one on {self.device}")
        self.execution: Execution = execution
        dev = self.device
        self._params = [p for p in drafter.parameters() if p.requires_grad]
        # a graph bakes scalars in: on CUDA the learning rate is a device tensor the step writes; on
        # the CPU a float the step sets (the CPU fused kernel reads a tensor one back per parameter)
        capturable = dev.type == "cuda"
        self._lr = torch.tensor(config.learning_rate, dtype=torch.float32, device=dev) if capturable else None
        self.optimizer = torch.optim.AdamW(
            self._params, lr=self._lr if self._lr is not None else config.learning_rate,
            betas=(config.adam_beta1, config.adam_beta2), weight_decay=config.weight_decay,
            fused=True, capturable=capturable,
        )  # fmt: skip
        self._found_inf = torch.zeros((), dtype=torch.float32, device=dev)  # read by the fused AdamW
        self.optimizer.found_inf = self._found_inf  # type: ignore[attr-defined]
        self._hold = torch.zeros((), dtype=torch.float32, device=dev)  # 1: compute, apply nothing (warm-up)
        self._attempted = torch.zeros((), dtype=torch.float32, device=dev)  # steps run (the warmup's clock)
        self._attempted_host = 0  # the same, counted on the host (eager execution only)
        self._skipped = torch.zeros((), dtype=torch.float32, device=dev)  # non-finite steps skipped
        self._sums = torch.zeros(len(_STATS), dtype=torch.float64, device=dev)  # since the last take_stats
        self._plan = torch.full((config.batch_size, config.pack_segments, 3), -1, dtype=torch.long, device=dev)
        self._plan[..., 1:] = 0
        self._vocab: Tensor | None = None  # (Vd,) head rows the loss compares (`set_vocabulary`), None: all
        self._graph: Any = None
        self._captured_at: tuple[int, ...] = ()  # `input_addresses()` at the capture
        in_stream = execution in ("graph", "stream")
        self._stream: Any = None
        self.side_stream_sms: int | None = None
        """The SMs of the side stream's green context (``config.side_stream_sms`` resolved), ``None``: every SM or no
        side stream."""
        if in_stream:
            self._stream, self.side_stream_sms = GREEN_CONTEXTS.side_stream(dev, config.side_stream_sms, owner=self)
        slots = config.max_queued if self._stream is not None else 0
        self._pinned = [torch.empty_like(self._plan, device="cpu").pin_memory() for _ in range(slots)]
        self._slot_done: list[Any] = [None] * slots
        self._next_slot = 0
        self._timings: deque[tuple[Any, Any]] = deque()
        self._deferred: deque[Callable[[], None]] = deque()
        self._evaluation: tuple[Tensor, list[Tensor]] | None = None  # (device sums, inputs kept alive)
        self.steps_enqueued = 0
        """Drafter steps handed to the device (or run) so far."""
        self.train_time_s = 0.0
        """Time the finished steps took: GPU time from CUDA events, else host time."""
        self._window_time_s = 0.0  # the same since the last take_stats

    @property
    def side_stream(self) -> Any:
        """The CUDA stream the steps run on (``None``: the current stream, "eager" or "deferred" execution)."""
        return self._stream

    @property
    def plan(self) -> Tensor:
        """The ``(batch_size, pack_segments, 3)`` plan of the batch `step` trains on (`FeatureReplayBuffer.plan`):
        a static input, refilled in place before each step."""
        return self._plan

    @property
    def trained_parameters(self) -> tuple[Tensor, ...]:
        """The drafter's parameters the optimizer updates (in place: their storage never moves)."""
        return tuple(self._params)

    # ------------------------------------------------------------------ the step
    def loss(self, drafter: EagleDrafter, batch: EagleBatch) -> DrafterLossOutput:
        """The EAGLE loss of ``drafter`` on ``batch`` (autocast in ``compute_dtype`` when it is half)."""
        cfg = self.config
        dtype = drafter.fc.weight.dtype
        low = self.compute_dtype if self.compute_dtype in (torch.float16, torch.bfloat16) else None
        with torch.autocast(self.device.type, dtype=low or torch.bfloat16, enabled=low is not None, cache_enabled=False):
            pred = drafter(batch.features.to(dtype), batch.input_ids, batch.position_ids, batch.attention_mask)
            pred_logits = self.head_logits(drafter, pred)
            # the targets need no gradient: in the policy's dtype, the head is not copied to float32
            target_logits = self.head_logits(drafter, batch.target_features.to(low or dtype))
        return eagle_loss(
            pred, batch.target_features, pred_logits, target_logits, batch.loss_mask,
            feature_weight=cfg.feature_weight, token_weight=cfg.token_weight, temperature=cfg.eval_temperature,
        )  # fmt: skip

    def head_logits(self, drafter: EagleDrafter, features: Tensor) -> Tensor:
        """Next-token logits of features ``(..., H) -> (..., V)``, or ``(..., Vd)`` over the draft
        vocabulary (`set_vocabulary`): the one place that picks the head rows the loss compares."""
        return drafter.logits(features, self._vocab)

    @property
    def vocabulary(self) -> Tensor | None:
        """The head rows the loss compares (``(Vd,)`` long token ids), or ``None``: every row."""
        return self._vocab

    def set_vocabulary(self, ids: Tensor | None) -> None:
        """Compare the policy's head rows ``ids`` only, or every row (``None``).

        The engine drafts from its draft vocabulary (`lightning_tlt.rollout.spec_step.DraftVocabulary`,
        EAGLE-3's ``d2t``), so a drafted token is always one of its ids: training the drafter's
        softmax over the same rows fits what it drafts from, at ``Vd / V`` of the head's cost (at
        0.5 B the two full 151,936-row head matmuls are most of a drafter step). Ids of the same
        count are copied in place, ordered after the queued steps and before later ones (a captured
        step stays valid); another count is captured again.
        """
        if ids is None:
            if self._vocab is not None:
                self.wait()
                self._vocab, self._graph = None, None
            return
        ids = ids.to(device=self.device, dtype=torch.long).flatten()
        vocab = int(self.drafter.lm_head_weight.shape[0])
        if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"vocabulary ids must be a non-empty set of token ids in [0, {vocab}), got {ids.numel()} "
                             f"ids in [{int(ids.min()) if ids.numel() else None}, {int(ids.max()) if ids.numel() else None}]")  # fmt: skip
        if self._vocab is not None and self._vocab.shape == ids.shape:
            if torch.equal(self._vocab, ids):
                return
            self.wait()  # the main stream after the queued steps; the side stream after the copy
            self._vocab.copy_(ids)
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream())
            return
        self.wait()
        self._vocab, self._graph = ids.clone(), None

    def step(self) -> None:
        """One drafter update on the batch planned in `plan`, on the current stream, with no host sync: the body
        a CUDA graph captures. `enqueue` is how steps are trained: it plans each batch, runs or replays this
        step where it belongs and times it."""
        cfg = self.config
        batch = self.buffer.gather(self._plan, cfg.max_len)
        self.optimizer.zero_grad(set_to_none=True)  # under capture: the captured backward owns the grads
        out = self.loss(self.drafter, batch)
        out.loss.backward()
        finite = torch.isfinite(out.loss.detach())
        if cfg.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(self._params, cfg.max_grad_norm)
            finite = finite & torch.isfinite(norm)
        live = 1.0 - self._hold
        applied = finite.float() * live
        self._found_inf.copy_(1.0 - applied)
        if self._lr is None:
            self.optimizer.param_groups[0]["lr"] = self._schedule(self._attempted_host)
        elif cfg.warmup_steps:
            self._lr.copy_(cfg.learning_rate * torch.clamp((self._attempted + 1.0) / cfg.warmup_steps, max=1.0))
        self.optimizer.step()
        self._attempted_host += 1
        self._attempted.add_(live)
        skipped = (1.0 - finite.float()) * live
        self._skipped.add_(skipped)
        values = torch.stack([out.loss.detach()] + [out.stats[k] for k in _STATS[3:]]).double()
        self._sums.add_(torch.cat([torch.stack([applied, skipped]).double(), torch.where(applied > 0, values, 0.0)]))

    # ------------------------------------------------------------------ running steps
    def _side(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()

    def set_compute_dtype(self, dtype: torch.dtype) -> None:
        """Compute in ``dtype`` from the next step on (a captured step is captured again)."""
        if dtype != self.compute_dtype:
            self.wait()
            self.compute_dtype = dtype
            self._graph = None

    def prepare(self) -> None:
        """Capture the step as a CUDA graph (``"graph"`` execution), once; a no-op otherwise.

        Call it at a step boundary rather than in a stall (the capture synchronizes the device);
        `enqueue` calls it if needed. A capture that raises falls back to ``"stream"`` with a warning.
        """
        if self.execution != "graph":
            return
        if self._graph is not None:
            addresses = self.input_addresses()
            if addresses == self._captured_at:
                return
            # a graph replays fixed addresses: the policy's shared embedding or head (a reloaded or
            # re-sharded policy), the ring or the drafter moved, so capture again, never read freed memory
            if len(addresses) == len(self._captured_at):
                warnings.warn("the drafter step's inputs moved in memory since its capture; capturing it again",
                              stacklevel=2)
            self.wait()
            self._graph = None
        main = torch.cuda.current_stream()
        self._stream.wait_stream(main)  # everything the main stream wrote (buffer, weights) first
        with self._side(), torch.enable_grad():
            saved = self._plan.clone()
            self._plan[..., 0] = -1  # warm up on an empty plan: no draw from the buffer's generator
            self._hold.fill_(1.0)
            for _ in range(_WARMUP_ITERATIONS):
                self.step()
        main.wait_stream(self._stream)
        graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
        try:
            assert graph is not None
            with torch.enable_grad(), torch.cuda.graph(graph, stream=self._stream):
                self.step()
        except RuntimeError as err:  # e.g. parameters that move (sharded policies): run eagerly on the stream
            warnings.warn(f"capturing the drafter step failed ({err}); running it eagerly on a side stream", stacklevel=2)
            self.execution = "stream"
            graph = None
        with self._side():
            self._hold.fill_(0.0)
            self._plan.copy_(saved)
        self._graph = graph
        self._captured_at = self.input_addresses()

    def input_addresses(self) -> tuple[int, ...]:
        """Where the tensors the captured step reads live (the drafter's, the shared embedding and
        head, the buffer's ring)."""
        drafter, buffer = self.drafter, self.buffer
        ring = [t for t in (buffer.features, buffer.tokens, buffer.completion) if t is not None]
        return tuple(t.data_ptr() for t in (*drafter.parameters(), drafter.embed_weight, drafter.lm_head_weight, *ring))

    def _free_slot(self, block: bool) -> int | None:
        slot = self._next_slot
        done = self._slot_done[slot]
        if done is not None and not done.query():
            if not block:
                return None
            done.synchronize()
        self._next_slot = (slot + 1) % len(self._slot_done)
        return slot

    def enqueue(self, n: int, *, block: bool = False) -> int:
        """Hand up to ``n`` drafter steps to the device; returns how many were handed over.

        Never waits for the device unless ``block`` (then it waits for free queue slots): with
        ``max_queued`` steps in flight, further steps are refused, not queued.
        """
        if n <= 0 or self.buffer.num_train == 0:
            return 0
        self.prepare()
        done = 0
        for _ in range(n):
            if self._stream is None:
                plan = self.buffer.plan(self.config.batch_size, self.config.max_len, self.config.pack_segments)
                if self.execution == "deferred":
                    self._deferred.append(lambda plan=plan: self._run_eager(plan))  # type: ignore[misc]
                else:
                    self._run_eager(plan)
            else:
                slot = self._free_slot(block)
                if slot is None:
                    break
                self._pinned[slot].copy_(
                    self.buffer.plan(self.config.batch_size, self.config.max_len, self.config.pack_segments)
                )
                self._replay(slot)
            done += 1
        self.steps_enqueued += done
        return done

    def _run_eager(self, plan: Tensor) -> None:
        start = time.perf_counter()
        self._plan.copy_(plan)
        with torch.enable_grad():
            self.step()
        self._add_time(time.perf_counter() - start)

    def _add_time(self, seconds: float) -> None:
        self.train_time_s += seconds
        self._window_time_s += seconds

    def _replay(self, slot: int) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with self._side():
            start.record()
            self._plan.copy_(self._pinned[slot], non_blocking=True)
            if self._graph is not None:
                self._graph.replay()
            else:
                with torch.enable_grad():
                    self.step()
            end.record()
        self._slot_done[slot] = end
        self._timings.append((start, end))
        self._collect_timings()

    def _collect_timings(self) -> None:
        while self._timings and self._timings[0][1].query():
            start, end = self._timings.popleft()
            self._add_time(start.elapsed_time(end) / 1000.0)

    def in_flight(self) -> int:
        """Drafter steps handed over and not finished yet (never waits)."""
        if self._stream is not None:
            return sum(1 for e in self._slot_done if e is not None and not e.query())
        return len(self._deferred)

    def in_flight_states(self) -> list[str]:
        """Each handed-over step not finished yet, oldest first: ``"queued"`` (its start not reached: the side
        stream still runs earlier work or waits for the main stream) or ``"running"`` (started, not ended).
        Never waits; for a report of a stalled device (the e2e's watchdog). CUDA side stream only."""
        return ["running" if start.query() else "queued" for start, end in self._timings if not end.query()]

    def wait(self) -> None:
        """Order the main stream after every step handed over so far (the host does not wait on CUDA).

        CUDA: the current stream waits for the side stream. Deferred: the queued steps run now.
        """
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        while self._deferred:
            self._deferred.popleft()()

    def resume_after_main(self) -> None:
        """Order later side-stream work after everything the main stream has queued so far."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())

    # ------------------------------------------------------------------ held-out evaluation
    def evaluate(self, published: EagleDrafter | None, plans: list[Tensor]) -> None:
        """Queue the held-out acceptance ``Σ min(p, q)`` of the trained drafter and ``published``
        over ``plans`` (from `FeatureReplayBuffer.heldout_plans`), behind the queued steps;
        `take_evaluation` reads it later."""
        if not plans:
            return
        inputs = [p.pin_memory() if self._stream is not None else p for p in plans]
        drafters = [self.drafter, published if published is not None else self.drafter]
        if self._stream is not None:  # after what the main stream wrote (ring, published weights)
            self._stream.wait_stream(torch.cuda.current_stream())
        with self._side():  # allocated on the stream that adds into it
            sums = torch.zeros(4, dtype=torch.float64, device=self.device)

        @torch.no_grad()
        def run() -> None:
            for plan in inputs:
                batch = self.buffer.gather(plan.to(self.device, non_blocking=True), self.config.max_len)
                for i, drafter in enumerate(drafters):
                    stats = self.loss(drafter, batch).stats
                    sums[2 * i] += stats["accept_rate"].double() * stats["num_rows"].double()
                    sums[2 * i + 1] += stats["num_rows"].double()

        self._evaluation = (sums, inputs)
        if self.execution == "deferred":
            self._deferred.append(run)
        else:
            with self._side():
                run()

    def take_evaluation(self) -> tuple[float, float] | None:
        """The last queued evaluation's ``(trained, published)`` rates, once (host read: call it
        after `wait`, at a boundary), or ``None`` when none is pending or it saw no row."""
        if self._evaluation is None:
            return None
        self.wait()
        sums = self._evaluation[0].tolist()
        self._evaluation = None
        if sums[1] == 0:
            return None
        return sums[0] / sums[1], sums[2] / max(sums[3], 1.0)

    # ------------------------------------------------------------------ statistics and state
    def take_stats(self) -> dict[str, float]:
        """Since the last call: updates ``applied`` and ``skipped`` (non-finite), their mean loss
        statistics, ``rows`` trained on and ``train_time_s``; and ``skipped_total`` (one host read,
        after `wait`)."""
        self.wait()
        values = dict(zip(_STATS + ("skipped_total",), torch.cat([self._sums, self._skipped.double()[None]]).tolist()))
        with self._side():
            self._sums.zero_()
        self._collect_timings()
        out = {k: values.pop(k) for k in ("applied", "skipped", "skipped_total")}
        out["rows"] = values.pop("num_rows")
        out["train_time_s"], self._window_time_s = self._window_time_s, 0.0
        if out["applied"] > 0:
            out.update({k: v / out["applied"] for k, v in values.items()})
        return out

    @property
    def skipped_nonfinite(self) -> int:
        """Drafter updates skipped because the loss or gradient norm was NaN or infinite (host read)."""
        self.wait()
        return int(self._skipped.item())

    @property
    def applied_updates(self) -> int:
        """Drafter updates that changed the weights: live steps less the non-finite ones skipped (host read).

        Unlike `steps_enqueued`, it does not move on a step that was skipped (non-finite) or held, so
        whether the drafter changed since a publication is read from it."""
        self.wait()
        return int((self._attempted - self._skipped).item())

    def _schedule(self, attempted: float) -> float:
        """Linear warmup: the learning rate of the step after ``attempted`` steps."""
        warmup = self.config.warmup_steps
        return self.config.learning_rate * (min(1.0, (attempted + 1) / warmup) if warmup else 1.0)

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next step (host read)."""
        self.wait()
        return self._schedule(float(self._attempted.item()))

    @torch.no_grad()
    def average_(self, reduce_mean: Callable[[Tensor], Tensor]) -> None:
        """Replace the weights by ``reduce_mean`` of their flat concatenation (DDP), in place (the
        graph's addresses stay valid)."""
        self.wait()
        flat = torch.cat([p.detach().reshape(-1) for p in self._params])
        mean = reduce_mean(flat)
        offset = 0
        for p in self._params:
            p.copy_(mean[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def state_dict(self) -> dict[str, Any]:
        self.wait()
        return {
            "optimizer": _to_cpu(self.optimizer.state_dict()),
            "attempted": float(self._attempted.item()),
            "skipped": float(self._skipped.item()),
            "steps_enqueued": self.steps_enqueued,
            "vocabulary": None if self._vocab is None else self._vocab.cpu(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore optimizer and counters (the drafter's weights are the caller's: they are copied in place)."""
        self.wait()
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:
            # this trainer's kind of update, whatever the checkpoint's was: the step skips non-finite
            # updates through found_inf, which only the fused AdamW reads
            group["fused"], group["foreach"] = True, None
            group["capturable"] = self._lr is not None
            if self._lr is not None:  # keep the device learning rate the step writes
                self._lr.copy_(torch.as_tensor(group["lr"], dtype=torch.float32))
                group["lr"] = self._lr
            else:
                group["lr"] = float(group["lr"])
        self._attempted.fill_(float(state["attempted"]))
        self._attempted_host = int(state["attempted"])
        self._skipped.fill_(float(state["skipped"]))
        self.steps_enqueued = int(state["steps_enqueued"])
        self.set_vocabulary(state.get("vocabulary"))  # absent from checkpoints before it existed: every row
        self._graph = None  # the optimizer's state tensors are new: capture again


def _to_cpu(obj: Any) -> Any:
    """A copy of a nested state with every tensor cloned to the CPU (nothing aliases live state)."""
    if isinstance(obj, Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
