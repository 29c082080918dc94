"""`DrafterCoTrainCallback`: train the EAGLE drafter in generation stalls; publish, resume, export it.

TLT (arXiv 2511.16665) makes the drafter free by training it while the GPU would otherwise wait
for the long tail of rollouts. This callback does that inside a Lightning ``Trainer``:

1. **Harvest** (`on_train_batch_end`): the RL module's first training forward already computes the
   policy's last hidden state of every token (`lightning_tlt.rl.common.RLModule.harvest_features`,
   ``last_policy_features``); those features, tokens and completion masks go into a bounded
   `FeatureReplayBuffer` tagged with the RL step (a copy, not an extra forward).
2. **Stalls** (`on_step_event`, an engine listener): after a decode step with at most
   ``stall_threshold`` active rows, the callback runs drafter optimizer steps, bounded by
   ``time_budget_s`` and ``max_steps_per_event`` and checked between steps (preemptible), and in
   total to ``max_overhead`` of the stall time (the host thread is the decode loop's too). Under DDP,
   once this rank's ``generate`` is done it starts an asynchronous all-reduce that completes when
   every rank has finished generating, and trains while ``work.is_completed()`` is false. On CUDA
   the steps run on a side stream (the decode stream is never made to wait); on CPU they run
   synchronously, so tests count exactly what happened when. Outside stalls nothing is trained.
3. **Loss**: `lightning_tlt.drafters.loss.eagle_loss` (SmoothL1 on the next feature + 0.1 x soft
   cross-entropy), AdamW (TLT's betas 0.9/0.95, weight decay 0.01), warmup, gradient clipping; a
   non-finite loss skips the update and is counted.
4. **Publishing** (`on_train_batch_end`, the rollout boundary): under DDP the drafter weights are
   first averaged across ranks (all ranks meet there anyway); then every ``publish_every_n_steps``
   the weights are copied into the engine's frozen inference copy with a new version number,
   optionally only when the held-out acceptance rate improves (decided on the rank-mean, so all
   ranks agree).
5. **Resume**: `state_dict` holds the trained and the published drafter, optimizer, scheduler,
   version, counters, the engine tuner's state and the buffer's summary.
6. **Export**: `lightning_tlt.drafters.export.export_drafter(checkpoint, dir)` writes the vLLM
   EAGLE-1 directory from a checkpoint.

Engine contract (what `publish_drafter` needs): the engine has attributes ``drafter`` (the
inference `EagleDrafter` or ``None``) and ``drafter_version`` (int); publishing copies weights into
an existing drafter in place (CUDA graphs captured on its parameters stay valid) or sets a fresh
frozen copy. An engine ``tuner`` with ``state_dict``/``load_state_dict`` is checkpointed too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass
from typing import Any, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from typing_extensions import override

from lightning_tlt.core.runner import unwrap_model
from lightning_tlt.core.types import StepEvent
from lightning_tlt.drafters.buffer import FeatureReplayBuffer
from lightning_tlt.drafters.eagle import EagleBatch, EagleDrafter
from lightning_tlt.drafters.loss import eagle_loss, expected_acceptance_length


@dataclass
class DrafterCoTrainConfig:
    """Settings of `DrafterCoTrainCallback` (defaults after TLT where it has one)."""

    stall_threshold: int = 8
    """A decode step with at most this many active rows is a stall (the long tail)."""
    time_budget_s: float = 0.02
    """Most host time spent training per stall event (checked between drafter steps)."""
    max_steps_per_event: int = 4
    """Most drafter steps per stall event."""
    max_overhead: float | None = 0.05
    """Most drafter training time as a share of the stall time seen so far: every stall step earns
    ``max_overhead * step_time`` of training time, and a drafter step runs only once the earned time
    covers its measured cost. On one GPU the decode loop and the drafter share the host thread, so
    this is what keeps decoding within a few percent of its speed. ``None``: train up to
    ``time_budget_s`` after every stall step."""
    train_while_waiting: bool = True
    """Under DDP, train after this rank's generation is done while other ranks still generate."""
    wait_max_steps: int = 200
    """Most drafter steps while waiting for the other ranks (TLT: 200)."""
    wait_budget_s: float = 30.0
    """Most host time training while waiting for the other ranks."""
    batch_size: int = 8
    """Sequences per drafter step."""
    max_len: int = 512
    """Longest training window in tokens."""
    buffer_capacity: int = 256
    """Sequences kept in the replay buffer."""
    heldout_fraction: float = 0.1
    """Share of harvested sequences never trained on, to measure acceptance before publishing."""
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
    publish_every_n_steps: int = 1
    """Publish to the engine every this many RL steps (TLT's docs advise about 10)."""
    handoff_margin: float | None = 0.0
    """While the engine speculates with a model-free drafter (``SpeculativeConfig(method="suffix")``,
    TLT's cold start), the EAGLE drafter replaces it only once its held-out expected acceptance
    length beats the engine's measured one by this margin (tokens per verify step); ``None``
    publishes it from the first step regardless."""
    publish_if_improves: bool = False
    """Publish only when the held-out acceptance rate beats the published drafter's."""
    eval_temperature: float = 1.0
    """Temperature of the held-out acceptance rate ``Σ min(p, q)``."""
    eval_draft_tokens: int = 4
    """k of the logged expected acceptance length ``(1 - α^(k+1)) / (1 - α)``."""
    eval_max_sequences: int = 32
    """Newest held-out sequences used per evaluation."""
    average_across_ranks: bool = True
    """Average the drafter weights across ranks at each RL step boundary (DDP)."""
    feature_layers: tuple[int, int, int] | None = None
    """EAGLE-3 features (three HF ``hidden_states`` indices); ``None``: EAGLE-1 (last hidden state).
    Co-training needs ``None`` for now: the training step harvests the last hidden state only."""
    side_stream: bool = True
    """On CUDA, train on a side stream (concurrently with decode)."""
    seed: int = 0
    """Seeds the drafter's init and the buffer's generator."""

    def __post_init__(self) -> None:
        if self.stall_threshold < 1:
            raise ValueError(f"stall_threshold must be >= 1, got {self.stall_threshold!r}")
        for name in ("time_budget_s", "wait_budget_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if self.max_overhead is not None and not 0.0 < self.max_overhead <= 1.0:
            raise ValueError(f"max_overhead must be in (0, 1] or None, got {self.max_overhead!r}")
        for name in ("max_steps_per_event", "wait_max_steps", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("batch_size", "buffer_capacity", "publish_every_n_steps", "eval_max_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_len < 2:
            raise ValueError(f"max_len must be >= 2, got {self.max_len!r}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction!r}")
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError(f"adam betas must be in [0, 1), got ({self.adam_beta1!r}, {self.adam_beta2!r})")
        if not self.eval_temperature > 0:
            raise ValueError(f"eval_temperature must be > 0, got {self.eval_temperature!r}")
        if self.eval_draft_tokens < 1:
            raise ValueError(f"eval_draft_tokens must be >= 1, got {self.eval_draft_tokens!r}")
        if self.feature_layers is not None:
            layers = tuple(self.feature_layers)
            self.feature_layers = layers  # type: ignore[assignment]
            if len(layers) != 3:
                raise ValueError(
                    f"feature_layers must be three hidden_states indices or None, got {self.feature_layers!r}"
                )


def publish_drafter(engine: Any, drafter: EagleDrafter, version: int) -> EagleDrafter | None:
    """Publish ``drafter``'s weights to ``engine`` as ``version``; returns the engine's drafter.

    Engines with ``set_drafter`` (`lightning_tlt.rollout.engine.RolloutEngine`) refuse non-finite
    weights and copy in place where they can; others get ``drafter``/``drafter_version`` set.
    """
    if hasattr(engine, "set_drafter"):
        engine.set_drafter(drafter, version)
        return cast(EagleDrafter | None, engine.drafter)
    current = getattr(engine, "drafter", None)
    if isinstance(current, EagleDrafter) and current is not drafter and _same_layout(current, drafter):
        with torch.no_grad():
            source = drafter.state_dict()
            for name, tensor in current.state_dict().items():
                tensor.copy_(source[name])
    else:
        current = drafter.inference_copy()
        engine.drafter = current
    engine.drafter_version = int(version)
    return current


def engine_tuner_of(engine: Any) -> Any:
    """The engine's draft-length tuner (``engine.tuner``, else its speculative decoder's), or ``None``."""
    tuner = getattr(engine, "tuner", None)
    if tuner is None:
        tuner = getattr(getattr(engine, "_spec", None), "tuner", None)
    return tuner if hasattr(tuner, "state_dict") and hasattr(tuner, "load_state_dict") else None


def _same_layout(a: EagleDrafter, b: EagleDrafter) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape for k in sa)


class DrafterCoTrainCallback(Callback):
    """Co-trains an EAGLE drafter in the rollout engine's stalls (see the module docstring).

    Finds the policy as ``pl_module.policy`` and the engine as ``trainer.datamodule.engine``
    (`lightning_tlt.data.datamodule.RolloutDataModule`), unless one is given.

    Args:
        config: the settings (`DrafterCoTrainConfig`); ``None`` takes the defaults.
        drafter: a drafter to continue training (e.g. `EagleDrafter.from_pretrained`); ``None``
            builds a cold one from the policy at fit start.
        engine: the engine to listen to and publish to; ``None``: the datamodule's.
        **overrides: `DrafterCoTrainConfig` fields replacing those of ``config`` (e.g.
            ``DrafterCoTrainCallback(stall_threshold=16)``).

    Example::

        trainer = Trainer(max_steps=100, callbacks=[DrafterCoTrainCallback()])
        trainer.fit(GRPOModule(policy), datamodule=RolloutDataModule("arithmetic",
                    speculative=SpeculativeConfig(method="eagle")))
    """

    def __init__(
        self,
        config: DrafterCoTrainConfig | None = None,
        *,
        drafter: EagleDrafter | None = None,
        engine: Any | None = None,
        **overrides: Any,
    ) -> None:
        super().__init__()
        config = config or DrafterCoTrainConfig()
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(DrafterCoTrainConfig)})
        if unknown:
            raise ValueError(
                f"unknown DrafterCoTrainConfig fields {unknown}; allowed: see DrafterCoTrainConfig"
            )
        self.config = dataclasses.replace(config, **overrides) if overrides else config
        self.drafter: EagleDrafter | None = drafter
        self.published: EagleDrafter | None = None
        self._engine = engine
        self.buffer = FeatureReplayBuffer(
            self.config.buffer_capacity,
            self.config.heldout_fraction,
            self.config.max_len,
            seed=self.config.seed,
        )
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.version = 0
        self.publications = 0
        self.total_steps = 0
        self._skipped: Tensor | None = None  # device counter of skipped updates
        self._skipped_before = 0  # skipped updates restored from a checkpoint
        self._listening_to: Any = None
        self._trainer: pl.Trainer | None = None
        self._pending_state: dict[str, Any] | None = None
        self._pending_tuner_state: dict[str, Any] | None = None
        self._harvested_step: int | None = None
        self._stream: Any = None
        self._compute_dtype = torch.float32  # the policy's dtype (set with the drafter)
        self._window = _Window()
        self._allowance = 0.0  # earned stall training time not yet spent (max_overhead)
        self._step_cost = 0.0  # measured host time of the last drafter steps, per step
        self.last_metrics: dict[str, float] = {}
        """What `on_train_batch_end` logged last."""
        self.last_step_drafter_s = 0.0
        """Host time spent in drafter steps during the last RL step (stalls and waits)."""
        self.step_log: list[tuple[str, int, int]] = []
        """``(reason, active_rows, steps)`` of every event that trained (reason "stall" or "wait")."""

    # ------------------------------------------------------------------ setup
    def setup_drafter(self, policy: torch.nn.Module) -> EagleDrafter:
        """Build (or take) the drafter for ``policy``, its optimizer and schedule; apply a pending resume."""
        cfg = self.config
        if self.drafter is None:
            generator = torch.Generator().manual_seed(cfg.seed)
            self.drafter = EagleDrafter.from_target(
                unwrap_model(policy), feature_layers=cfg.feature_layers, generator=generator
            )
        if self.drafter.feature_layers is not None:
            raise ValueError(
                f"co-training harvests the policy's last hidden state only (EAGLE-1); an EAGLE-3 drafter "
                f"(feature_layers={self.drafter.feature_layers!r}) is trained offline: use feature_layers=None"
            )
        # float32 master weights: AdamW steps of ~lr are below one bf16 ulp of the weights; the
        # forward runs under autocast in the policy's dtype, and the engine drafts with a copy in it
        self._compute_dtype = self.drafter.embed_weight.dtype
        if self.drafter.fc.weight.dtype in (torch.float16, torch.bfloat16):
            self.drafter.float()
        self.drafter.train()
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(),
            lr=cfg.learning_rate,
            betas=(cfg.adam_beta1, cfg.adam_beta2),
            weight_decay=cfg.weight_decay,
            fused=True,  # reads `found_inf`: non-finite updates are skipped without a host sync
        )
        warmup = cfg.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        if self.drafter.fc.weight.is_cuda and cfg.side_stream:
            self._stream = torch.cuda.Stream(device=self.drafter.fc.weight.device)
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None
        return self.drafter

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        drafter = self.setup_drafter(cast(torch.nn.Module, pl_module.policy))
        setattr(pl_module, "harvest_features", True)  # noqa: B010  (RLModule's switch; typed loosely)
        engine = self.engine(trainer)
        if self.published is not None or not self._model_free(engine):
            self.published = publish_drafter(
                engine, self.published if self.published is not None else drafter, self.version
            )
        self._listen(trainer, engine)

    def _model_free(self, engine: Any) -> bool:
        """Whether the engine drafts with a model-free drafter that the EAGLE drafter must beat first."""
        current = getattr(engine, "drafter", None)
        return self.config.handoff_margin is not None and current is not None and not isinstance(current, EagleDrafter)

    def _beats_engine(self, trainer: pl.Trainer, engine: Any, heldout: tuple[float, float] | None) -> bool:
        """The hand-off test: held-out expected acceptance length vs the engine's measured one (rank-mean)."""
        assert self.config.handoff_margin is not None
        stats = getattr(engine, "last_stats", None) or {}
        measured = float(stats.get("spec/acceptance_length", 1.0))
        values = torch.tensor([measured if measured == measured else 1.0, -1.0 if heldout is None else heldout[0]],
                              dtype=torch.float64, device=self.drafter.fc.weight.device)  # type: ignore[union-attr]
        if _world_size() > 1:
            values = trainer.strategy.reduce(values, reduce_op="mean")
        if heldout is None:
            return False
        expected = expected_acceptance_length(min(1.0, max(0.0, float(values[1]))), self.config.eval_draft_tokens)
        return expected > float(values[0]) + self.config.handoff_margin

    def engine(self, trainer: pl.Trainer | None = None) -> Any:
        """The engine this callback publishes to (the given one, else ``trainer.datamodule.engine``)."""
        if self._engine is not None:
            return self._engine
        trainer = trainer or self._trainer
        datamodule = getattr(trainer, "datamodule", None)
        engine = getattr(datamodule, "engine", None)
        if engine is None:
            raise ValueError(
                "DrafterCoTrainCallback needs an engine: pass engine=... or fit with a RolloutDataModule"
            )
        return engine

    def _listen(self, trainer: pl.Trainer, engine: Any) -> None:
        if self._listening_to is not None:
            return
        datamodule = getattr(trainer, "datamodule", None)
        host: Any = datamodule if self._engine is None and hasattr(datamodule, "add_listener") else engine
        host.add_listener(self.on_step_event)
        self._listening_to = host

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._listening_to is not None:
            self._listening_to.remove_listener(self.on_step_event)
            self._listening_to = None
        if hasattr(pl_module, "harvest_features"):
            setattr(pl_module, "harvest_features", False)  # noqa: B010

    # ------------------------------------------------------------------ stalls
    def on_step_event(self, event: StepEvent) -> None:
        """The engine listener: train in stalls, or while other ranks still generate."""
        if self.drafter is None or self.optimizer is None:
            return
        if self._pending_tuner_state is not None:
            self._apply_tuner_state()
        trainer = self._trainer
        if trainer is not None and (not trainer.training or trainer.sanity_checking):
            return
        cfg = self.config
        if event.phase == "done":
            if cfg.train_while_waiting and _world_size() > 1:
                self._train_while_waiting()
            return
        if event.phase not in ("decode", "speculative") or not 0 < event.active_rows <= cfg.stall_threshold:
            return
        self._window.stall_available_s += event.step_time_s
        budget = cfg.time_budget_s
        if cfg.max_overhead is not None:
            # earn training time in proportion to the stall; spend it only when a step is affordable
            self._allowance = min(self._allowance + cfg.max_overhead * event.step_time_s, cfg.time_budget_s)
            if self._allowance < self._step_cost:
                return
            budget = self._allowance
        start = time.perf_counter()
        steps = self._train_steps(budget, cfg.max_steps_per_event)
        if steps:
            used = time.perf_counter() - start
            self._step_cost = used / steps
            if cfg.max_overhead is not None:
                self._allowance -= used
            self.step_log.append(("stall", event.active_rows, steps))

    def _train_while_waiting(self) -> None:
        cfg = self.config
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if dist.get_backend() == "nccl"
            else torch.device("cpu")
        )
        flag = torch.ones(1, device=device)
        work = dist.all_reduce(flag, async_op=True)  # completes once every rank has finished generating
        start = time.perf_counter()
        steps = self._train_steps(cfg.wait_budget_s, cfg.wait_max_steps, until=work.is_completed)
        work.wait()
        self._window.wait_s += time.perf_counter() - start
        self._window.wait_steps += steps
        if steps:
            self.step_log.append(("wait", 0, steps))

    def _train_steps(self, budget_s: float, max_steps: int, until: Any = None) -> int:
        """Drafter steps until the budget, the step cap or ``until()``, checked between steps."""
        if self.buffer.num_train == 0 or max_steps == 0:
            return 0
        start = time.perf_counter()
        steps = 0
        stream_ctx: Any = contextlib.nullcontext()
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream())
            stream_ctx = torch.cuda.stream(self._stream)
        with stream_ctx, torch.enable_grad():
            while steps < max_steps:
                if until is not None and until():
                    break
                if steps > 0 and time.perf_counter() - start >= budget_s:
                    break
                self._one_step()
                steps += 1
        self._window.stall_used_s += time.perf_counter() - start
        self._window.steps += steps
        return steps

    def _one_step(self) -> None:
        """One drafter update, with no host sync: a non-finite loss is skipped on the device.

        The fused AdamW reads ``found_inf`` (as under ``GradScaler``): when it is 1 the kernel
        leaves parameters, moments and the step count untouched, so a NaN or infinite loss is never
        applied, and the count of skipped steps stays a device tensor until it is logged.
        """
        assert self.drafter is not None and self.optimizer is not None and self.scheduler is not None
        cfg = self.config
        batch = self.buffer.sample(cfg.batch_size, device=self.drafter.fc.weight.device)
        out = self._loss(self.drafter, batch)
        self.total_steps += 1
        finite = torch.isfinite(out.loss.detach())
        found_inf = (~finite).to(torch.float32)
        self.optimizer.zero_grad(set_to_none=True)
        out.loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.max_grad_norm)
        self.optimizer.found_inf = found_inf  # type: ignore[attr-defined]
        self.optimizer.step()
        self.scheduler.step()
        self._skipped = found_inf if self._skipped is None else self._skipped + found_inf
        self._window.add(finite, out.loss.detach(), out.stats)

    @property
    def skipped_nonfinite(self) -> int:
        """Drafter updates skipped because the loss was NaN or infinite (reads a device counter)."""
        return self._skipped_before + (int(self._skipped.item()) if self._skipped is not None else 0)

    def _loss(self, drafter: EagleDrafter, batch: EagleBatch) -> Any:
        dtype = drafter.fc.weight.dtype
        device = drafter.fc.weight.device
        low = self._compute_dtype if self._compute_dtype in (torch.float16, torch.bfloat16) else None
        with torch.autocast(device_type=device.type, dtype=low or torch.bfloat16, enabled=low is not None):
            pred = drafter(batch.features.to(dtype), batch.input_ids, batch.position_ids, batch.attention_mask)
            target = batch.target_features.to(dtype)
            pred_logits, target_logits = drafter.logits(pred), drafter.logits(target)
        return eagle_loss(
            pred,
            target,
            pred_logits,
            target_logits,
            batch.loss_mask,
            feature_weight=self.config.feature_weight,
            token_weight=self.config.token_weight,
            temperature=self.config.eval_temperature,
        )

    # ------------------------------------------------------------------ the RL step boundary
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.drafter is None:
            return
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        self._harvest(pl_module)
        if _world_size() > 1 and self.config.average_across_ranks:
            self._average_across_ranks(trainer)
        heldout = self._heldout_accept_rates(trainer)
        step = trainer.global_step
        published = False
        engine = self.engine(trainer)
        handoff_pending = self._model_free(engine) and not self._beats_engine(trainer, engine, heldout)
        if step % self.config.publish_every_n_steps == 0 and not handoff_pending:
            improves = heldout is None or heldout[0] > heldout[1]
            if not self.config.publish_if_improves or (heldout is not None and improves):
                self.version += 1
                self.publications += 1
                self.published = publish_drafter(engine, self.drafter, self.version)
                published = True
        self._log(pl_module, heldout, published)
        pl_module.log("drafter/eagle_drafting", float(isinstance(getattr(engine, "drafter", None), EagleDrafter)),
                      on_step=True, on_epoch=False, batch_size=1)

    def _harvest(self, pl_module: pl.LightningModule) -> None:
        feats = getattr(pl_module, "last_policy_features", None)
        if feats is None or feats.step == self._harvested_step:
            return
        self._harvested_step = feats.step
        self.buffer.add(
            feats.hidden_states, feats.input_ids, feats.attention_mask, feats.completion_mask, feats.step
        )

    def _average_across_ranks(self, trainer: pl.Trainer) -> None:
        assert self.drafter is not None
        params = [p for p in self.drafter.parameters()]
        with torch.no_grad():
            flat = torch.nn.utils.parameters_to_vector(params)
            mean = trainer.strategy.reduce(flat, reduce_op="mean")
            torch.nn.utils.vector_to_parameters(mean, params)

    def _accept_rate(self, drafter: EagleDrafter, batch: EagleBatch) -> Tensor:
        """Mean ``Σ min(p, q)`` over the masked rows, ``batch_size`` sequences at a time (the
        ``(sequences, window, vocab)`` logits of a whole held-out set would not fit for large vocabularies)."""
        total = torch.zeros((), dtype=torch.float64, device=batch.input_ids.device)
        rows = torch.zeros((), dtype=torch.float64, device=batch.input_ids.device)
        for start in range(0, len(batch), self.config.batch_size):
            stats = self._loss(drafter, batch.select(start, start + self.config.batch_size)).stats
            total += stats["accept_rate"].double() * stats["num_rows"].double()
            rows += stats["num_rows"].double()
        return total / rows.clamp_min(1.0)

    @torch.no_grad()
    def _heldout_accept_rates(self, trainer: pl.Trainer) -> tuple[float, float] | None:
        """Held-out ``Σ min(p, q)`` of (the trained drafter, the published one), rank-mean; ``None`` without data."""
        assert self.drafter is not None
        batch = self.buffer.heldout(self.drafter.fc.weight.device, self.config.eval_max_sequences)
        local = torch.zeros(3, dtype=torch.float64, device=self.drafter.fc.weight.device)
        if batch is not None and bool(batch.loss_mask.any()):
            was_training = self.drafter.training
            self.drafter.eval()
            local[0] = self._accept_rate(self.drafter, batch)
            self.drafter.train(was_training)
            published = self.published if self.published is not None else self.drafter
            local[1] = self._accept_rate(published, batch)
            local[2] = 1.0
        if _world_size() > 1:
            local = trainer.strategy.reduce(local, reduce_op="sum")
        if float(local[2]) == 0:
            return None
        return float(local[0] / local[2]), float(local[1] / local[2])

    def _log(
        self, pl_module: pl.LightningModule, heldout: tuple[float, float] | None, published: bool
    ) -> None:
        w = self._window
        metrics: dict[str, float] = {
            "drafter/steps": float(self.total_steps),
            "drafter/steps_this_rl_step": float(w.steps),
            "drafter/skipped_nonfinite": float(self.skipped_nonfinite),
            "drafter/stall_time_available_s": w.stall_available_s,
            "drafter/stall_time_used_s": w.stall_used_s,
            "drafter/wait_steps": float(w.wait_steps),
            "drafter/version": float(self.version),
            "drafter/publications": float(self.publications),
            "drafter/published": float(published),
            "drafter/buffer_sequences": float(len(self.buffer)),
        }
        applied = float(w.applied) if w.applied is not None else 0.0
        if applied > 0 and w.loss is not None and w.stats is not None:
            metrics["drafter/loss"] = float(w.loss / applied)
            for key in ("feature_loss", "token_loss", "top1_accuracy", "accept_rate"):
                metrics[f"drafter/{key}"] = float(w.stats[key] / applied)
        if heldout is not None:
            metrics["drafter/heldout_accept_rate"] = heldout[0]
            metrics["drafter/heldout_accept_rate_published"] = heldout[1]
            metrics["drafter/heldout_accept_len"] = expected_acceptance_length(
                min(1.0, heldout[0]), self.config.eval_draft_tokens
            )
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        self.last_metrics = metrics
        self.last_step_drafter_s = w.stall_used_s
        self._window = _Window()

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        if self.drafter is None:
            return dict(self._pending_state or {})
        engine_tuner = engine_tuner_of(self._engine_or_none())
        tuner_state = engine_tuner.state_dict() if engine_tuner is not None else self._pending_tuner_state
        return {
            "drafter": {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()},
            "published": None
            if self.published is None
            else {k: v.detach().cpu().clone() for k, v in self.published.state_dict().items()},
            "drafter_config": self.drafter.config.to_dict(),
            "feature_layers": self.drafter.feature_layers,
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "version": self.version,
            "publications": self.publications,
            "total_steps": self.total_steps,
            "skipped_nonfinite": self.skipped_nonfinite,
            "harvested_step": self._harvested_step,
            "tuner": tuner_state,
            "buffer": self.buffer.state_dict(),
        }

    def _apply_tuner_state(self) -> None:
        """Hand a resumed tuner state to the engine's tuner once it exists (engines build it lazily)."""
        if self._pending_tuner_state is None:
            return
        tuner = engine_tuner_of(self._engine_or_none())
        if tuner is not None:
            tuner.load_state_dict(self._pending_tuner_state)
            self._pending_tuner_state = None

    def _engine_or_none(self) -> Any:
        try:
            return self.engine()
        except ValueError:
            return None

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callbacks before on_fit_start builds the drafter and its optimizer
        if self.drafter is not None and self.optimizer is not None:
            self._restore(state_dict)
        else:
            self._pending_state = dict(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        assert self.drafter is not None and self.optimizer is not None and self.scheduler is not None
        self.drafter.load_state_dict(state["drafter"])
        if state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("published") is not None:
            self.published = self.drafter.inference_copy()
            self.published.load_state_dict(state["published"])
        self.version = int(state["version"])
        self.publications = int(state["publications"])
        self.total_steps = int(state["total_steps"])
        self._skipped_before, self._skipped = int(state["skipped_nonfinite"]), None
        self._harvested_step = state.get("harvested_step")
        self.buffer.load_state_dict(state["buffer"])
        self._pending_tuner_state = state.get("tuner")
        self._apply_tuner_state()
        rank_zero_info(
            f"DrafterCoTrainCallback: resumed drafter version {self.version} after {self.total_steps} steps"
        )


@dataclass
class _Window:
    """Figures accumulated between two RL step boundaries (then logged and reset).

    Loss statistics stay device tensors until `_log` reads them once: no host read per step.
    """

    steps: int = 0
    wait_steps: int = 0
    wait_s: float = 0.0
    stall_available_s: float = 0.0
    stall_used_s: float = 0.0
    applied: Tensor | None = None
    loss: Tensor | None = None
    stats: dict[str, Tensor] | None = None

    def add(self, finite: Tensor, loss: Tensor, stats: dict[str, Tensor]) -> None:
        """Add one update's loss and stats, counted only if ``finite`` (a device bool)."""
        zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
        kept = {k: torch.where(finite, v.to(loss.dtype), zero) for k, v in stats.items()}
        loss = torch.where(finite, loss, zero)
        count = finite.to(loss.dtype)
        if self.applied is None or self.loss is None or self.stats is None:
            self.applied, self.loss, self.stats = count, loss, kept
            return
        self.applied = self.applied + count
        self.loss = self.loss + loss
        for key, value in kept.items():
            self.stats[key] = self.stats[key] + value


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
