"""`DrafterCoTrainCallback`: train the EAGLE drafter in generation stalls; publish, resume, export it.

TLT (arXiv 2511.16665) makes the drafter free by training it while the GPU would otherwise wait
for the long tail of rollouts. This callback does that inside a Lightning ``Trainer``; the parts
live in `lightning_tlt.drafters`:

1. **Harvest** (`on_train_batch_end`): the RL module hands over the policy's last hidden state of
   every token of the step (`lightning_tlt.rl.common.PolicyFeatureSource`: a copy of what its
   training forward computed anyway); they go into a token-bounded `FeatureReplayBuffer`.
2. **Stalls** (`on_step_event`, an engine listener, handing each event to the `StallScheduler`,
   `lightning_tlt.drafters.stalls`): after a decode step with at most ``stall_threshold`` active
   rows, the `StallPacer` decides how many drafter steps to queue (so that the measured decode
   slowdown stays under ``max_decode_slowdown``), and the `DrafterTrainer` hands them to the device:
   on CUDA a captured graph replayed on a side stream (the decode loop never waits for it), on the
   CPU the same step run at once. Under DDP, once this rank's ``generate`` is done it also trains
   while the other ranks still generate.
3. **Ordering** (`on_before_optimizer_step`, called by Lightning before every policy optimizer
   step, under manual optimization too): the main stream waits for the queued drafter steps, which
   read the policy's embedding and LM head, before the policy's update overwrites them.
4. **Boundary** (`on_train_batch_end`): weights averaged across ranks (DDP); published to the
   engine every ``publish_every_n_steps`` if an update was applied since (a step skipped as non-finite
   changes nothing, so it publishes no new version) (`engine.set_drafter`: finite-checked,
   in place, versioned), unless the rules of `lightning_tlt.drafters.publishing` hold it back (the
   hand-over from a model-free drafter, ``publish_if_improves``); held-out acceptance queued on the
   side stream every ``eval_every_n_steps`` and read one boundary later.
5. **Warm start** (``warm_start``): train before the EAGLE drafter speculates, from a task's
   worked solutions at fit start or from the first RL step's rollouts.
6. **Resume**: `state_dict` holds the drafter (trained and published), optimizer and counters, and
   the replay buffer's contents, so a resumed run makes the same drafter updates.
7. **Export**: `lightning_tlt.drafters.export.export_drafter(checkpoint, dir)` writes the vLLM
   EAGLE-1 directory from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_tlt.callbacks.cotrain_config import STATE_FORMAT as STATE_FORMAT
from lightning_tlt.callbacks.cotrain_config import DrafterCoTrainConfig as DrafterCoTrainConfig
from lightning_tlt.callbacks.cotrain_config import WarmStart as WarmStart
from lightning_tlt.core.rank_state import current_rank, gather_rank_states, rank_state
from lightning_tlt.core.runner import unwrap_model
from lightning_tlt.core.sharding import is_sharded
from lightning_tlt.core.types import DrafterHost, StepEvent, mixed_precision_dtype
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.drafters.buffer import FeatureReplayBuffer
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.loss import expected_acceptance_length
from lightning_tlt.drafters.offline import add_policy_features
from lightning_tlt.drafters.pacing import StallPacer
from lightning_tlt.drafters.publishing import Heldout, agree_across_ranks, drafts_model_free, publish_due
from lightning_tlt.drafters.publishing import publish_drafter as publish_drafter
from lightning_tlt.drafters.stalls import StallScheduler
from lightning_tlt.drafters.trainer import DrafterTrainer
from lightning_tlt.rl.common import PolicyFeatureSource


class _Laps:
    """Host seconds between successive calls, by name (`DrafterCoTrainCallback.last_boundary`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = now - self._last
        self._last = now


def shared_weights(policy: torch.nn.Module, engine: DrafterHost) -> torch.nn.Module | None:
    """What a drafter of ``policy`` reads the embedding and LM head from, when not the policy itself.

    A sharded policy (FSDP2) holds a slice of each on every rank; the native engine's inference copy
    holds them whole (gathered before every rollout, in the engine's dtype), so the drafter reads those,
    in training and in drafting alike. ``None`` for an unsharded policy.

    Raises:
        ValueError: a sharded policy on an engine without a whole copy (the vLLM backend).
    """
    if not is_sharded(unwrap_model(policy)):
        return None
    copy = getattr(engine, "inference_copy", None)
    if copy is None or not getattr(copy, "sharded", False):
        raise ValueError(
            f"DrafterCoTrainCallback under a sharded policy (FSDP) trains the drafter against the embedding and LM "
            f"head of the native engine's gathered copy; the {type(engine).__name__} backend keeps none. Use "
            "RolloutDataModule(engine='native'), or train the drafter offline (lightning-tlt train-drafter)"
        )
    return cast(torch.nn.Module, copy.module)


def _weights(module: torch.nn.Module | None) -> dict[str, torch.Tensor] | None:
    return None if module is None else {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


class DrafterCoTrainCallback(Callback):
    """Co-trains an EAGLE drafter in the rollout engine's stalls (see the module docstring).

    Finds the policy as ``pl_module.policy`` and the engine as ``trainer.datamodule.engine``
    (`lightning_tlt.data.datamodule.RolloutDataModule`), unless one is given; the LightningModule
    must be a `lightning_tlt.rl.common.PolicyFeatureSource` (as `GRPOModule` and `PPOModule` are).

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
        engine: DrafterHost | None = None,
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
        cfg = self.config
        self.drafter: EagleDrafter | None = drafter
        self.published: EagleDrafter | None = None
        self.learner: DrafterTrainer | None = None
        """Runs the drafter's train steps (built at fit start with the drafter)."""
        self._engine = engine
        self.buffer = FeatureReplayBuffer(cfg.buffer_tokens, cfg.heldout_fraction, seed=cfg.seed)
        pacer = StallPacer(cfg.max_steps_per_event, cfg.max_decode_slowdown,
                           step_cost=cfg.drafter_step_cost if cfg.deterministic else None)
        self.stalls = StallScheduler(cfg.stall_threshold, pacer, deterministic=cfg.deterministic,
                                     wait_max_steps=cfg.wait_max_steps, wait_budget_s=cfg.wait_budget_s,
                                     frozen=cfg.freeze_after_warm_start)
        """Queues the drafter steps of the stalls (and of the wait for other ranks), paced."""
        self.version = 0
        self.publications = 0
        self.rl_steps = 0
        """RL step boundaries seen (rollout batches trained on)."""
        self._published_updates = -1  # learner.applied_updates at the last publication
        self._heldout: Heldout | None = None  # rank-mean (trained, published) of the last evaluation
        self._eval_ready: Heldout | None = None  # an evaluation read early (at a checkpoint)
        self._last_eval_step = 0  # the RL step whose weights the last queued evaluation measures
        self._warm_started = cfg.warm_start == "none"
        self._listening_to: RolloutDataModule | DrafterHost | None = None
        self._trainer: pl.Trainer | None = None
        self._pending_state: dict[str, Any] | None = None
        self._shares_copy = False  # the drafter reads the engine's gathered copy (a sharded policy)
        self.last_metrics: dict[str, float] = {}
        """What `on_train_batch_end` logged last."""
        self.last_boundary: dict[str, float] = {}
        """Host seconds of each part of the last RL-step boundary (`on_train_batch_end`), in order: ``harvest``,
        (``warm_start``, ``average``,) ``evaluation_read``, ``publish``, ``stats``, ``vocabulary``, ``prepare``,
        (``evaluation_queued``,) ``log``. A part that reads the device back (``stats``, ``publish``'s finite check)
        also holds the wait for the work queued before it: where a boundary's time goes, for a profile."""
        self.evaluations: list[tuple[int, float, float]] = []
        """``(rl_step, trained, published)`` held-out acceptance rates (rank-mean) by the RL step
        whose weights they measured."""

    @property
    def resume_pending(self) -> bool:
        """Whether a loaded checkpoint state waits for the drafter (built at fit start) to take it."""
        return self._pending_state is not None

    @property
    def pacer(self) -> StallPacer:
        """How many drafter steps each stall event queues (the `StallScheduler`'s)."""
        return self.stalls.pacer

    @property
    def step_log(self) -> list[tuple[str, int, int]]:
        """``(reason, active_rows, steps)`` of every event that queued drafter steps (reason "stall" or "wait")."""
        return self.stalls.step_log

    # ------------------------------------------------------------------ setup
    def setup_drafter(
        self, policy: torch.nn.Module, compute_dtype: torch.dtype | None = None, shared: torch.nn.Module | None = None
    ) -> EagleDrafter:
        """Build (or take) the drafter for ``policy`` and its trainer; apply a pending resume.

        ``compute_dtype``: what the drafter's step computes in (autocast) and the buffer stores
        features in; ``None``: the policy's dtype. `on_fit_start` passes the Trainer's half
        precision (``bf16-mixed``: float32 master weights, bf16 compute, as the policy's own update).
        ``shared``: the model whose embedding and LM head the drafter reads, when not ``policy``'s own
        (a sharded policy's: the engine's gathered copy, `shared_weights`); the drafter's own weights
        are in ``policy``'s dtype either way.
        """
        cfg = self.config
        if self.drafter is None:
            generator = torch.Generator().manual_seed(cfg.seed)
            dtype = next(policy.parameters()).dtype
            self.drafter = EagleDrafter.from_target(
                unwrap_model(shared if shared is not None else policy), feature_layers=cfg.feature_layers,
                generator=generator, dtype=dtype,
            )  # fmt: skip
        if self.drafter.feature_layers is not None:
            raise ValueError(
                f"co-training harvests the policy's last hidden state only (EAGLE-1); an EAGLE-3 drafter "
                f"(feature_layers={self.drafter.feature_layers!r}) is trained offline: use feature_layers=None"
            )
        if self.learner is None or self.learner.drafter is not self.drafter:  # a second fit keeps its optimizer
            if self.buffer.features is None:  # compact: in the compute dtype, beside the drafter
                self.buffer.place(self.drafter.fc.weight.device, compute_dtype or self.drafter.embed_weight.dtype)
            self.learner = DrafterTrainer(self.drafter, self.buffer, cfg, compute_dtype)
        elif compute_dtype is not None and compute_dtype != self.learner.compute_dtype:
            self.learner.set_compute_dtype(compute_dtype)
            if self.buffer.features is None:  # storage not allocated yet: it takes the new dtype
                self.buffer.place(self.buffer.device or self.drafter.fc.weight.device, compute_dtype)
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None
        return self.drafter

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trainer = trainer
        if not isinstance(pl_module, PolicyFeatureSource):
            raise TypeError(
                f"DrafterCoTrainCallback needs a LightningModule that hands over the policy's features "
                f"(lightning_tlt.rl.common.PolicyFeatureSource, e.g. GRPOModule), got {type(pl_module).__name__}"
            )
        policy = cast(torch.nn.Module, pl_module.policy)
        engine = self.engine(trainer)
        shared = shared_weights(policy, engine)
        self._shares_copy = shared is not None
        drafter = self.setup_drafter(policy, mixed_precision_dtype(trainer.precision), shared)
        pl_module.request_policy_features(True)
        if not self._warm_started and self.config.warm_start == "sft":
            self._warm_start_sft(trainer, cast(torch.nn.Module, pl_module.policy))
        if self.published is not None:  # resumed: the engine drafts with what it drafted with
            self.published = publish_drafter(engine, self.published, self.version)
        elif self.config.warm_start == "sft" and not self._model_free(engine):
            self._publish(engine, drafter)  # version 1: trained
        elif self._warm_started and not self._model_free(engine):
            self.published = publish_drafter(engine, drafter, self.version)  # version 0: cold
            self._published_updates = self.learner.applied_updates if self.learner is not None else 0
        if self.published is None and self._model_free(engine):
            engine.stage_drafter(drafter)  # its steps compile in the first rollout's warm-up, not at the hand-over
        if self.learner is not None and self.buffer.num_train:  # resumed with data: capture now, not in a stall
            self.learner.prepare()
        self._listen(trainer, engine)

    def _model_free(self, engine: DrafterHost) -> bool:
        return drafts_model_free(engine, self.config.handoff_margin)

    def engine(self, trainer: pl.Trainer | None = None) -> DrafterHost:
        """The engine this callback publishes to (the given one, else ``trainer.datamodule.engine``)."""
        if self._engine is not None:
            if not isinstance(self._engine, DrafterHost):
                raise TypeError(f"DrafterCoTrainCallback publishes to a DrafterHost (lightning_tlt.core.types); "
                                f"{type(self._engine).__name__} is not one")  # fmt: skip
            return self._engine
        trainer = trainer or self._trainer
        datamodule = getattr(trainer, "datamodule", None)
        if not isinstance(datamodule, RolloutDataModule):
            raise ValueError(
                "DrafterCoTrainCallback needs an engine: pass engine=... or fit with a RolloutDataModule, "
                f"got datamodule {type(datamodule).__name__}"
            )
        return datamodule.drafter_host()

    def _listen(self, trainer: pl.Trainer, engine: DrafterHost) -> None:
        if self._listening_to is not None:
            return
        # the datamodule's listeners follow its engine when it is rebuilt; an engine given directly is the host
        datamodule = getattr(trainer, "datamodule", None)
        host: RolloutDataModule | DrafterHost = (
            datamodule if self._engine is None and isinstance(datamodule, RolloutDataModule) else engine
        )
        host.add_listener(self.on_step_event)
        self._listening_to = host

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._listening_to is not None:
            self._listening_to.remove_listener(self.on_step_event)
            self._listening_to = None
        if isinstance(pl_module, PolicyFeatureSource):
            pl_module.request_policy_features(False)
        if self.learner is not None:
            self.learner.wait()

    # ------------------------------------------------------------------ warm start
    def _warm_start_sft(self, trainer: pl.Trainer, policy: torch.nn.Module) -> None:
        """Fill the buffer with the policy's features over a task's worked solutions and train on them."""
        from lightning_tlt.data.drafter_data import sft_sequences

        cfg = self.config
        datamodule = getattr(trainer, "datamodule", None)
        task = cast(str, cfg.warm_start_task)
        tokenizer = getattr(datamodule, "tokenizer", None)
        sequences, prompt_lengths = sft_sequences(
            task, cfg.warm_start_sequences, tokenizer=tokenizer,
            difficulty=getattr(datamodule, "difficulty", 1), seed=cfg.seed,
        )  # fmt: skip
        add_policy_features(self.buffer, policy, sequences, prompt_lengths)
        self._run_warm_start(trainer)

    def _run_warm_start(self, trainer: pl.Trainer) -> None:
        """``warm_start_steps`` steps now, then a held-out evaluation read at once (a one-off sync)."""
        assert self.learner is not None
        start = time.perf_counter()
        self.learner.resume_after_main()  # the features just added to the buffer first
        before = self._evaluate_now(trainer)
        self.learner.enqueue(self.config.warm_start_steps, block=True)
        after = self._evaluate_now(trainer)
        self._warm_started = True
        if after is not None:
            self._heldout = after
        rank_zero_info(
            f"DrafterCoTrainCallback: warm start of {self.config.warm_start_steps} drafter steps in "
            f"{time.perf_counter() - start:.1f} s, held-out acceptance rate "
            f"{'n/a' if before is None else f'{before[0]:.3f}'} -> {'n/a' if after is None else f'{after[0]:.3f}'}"
        )

    def _evaluate_now(self, trainer: pl.Trainer) -> Heldout | None:
        assert self.learner is not None
        self.learner.evaluate(self.published, self.heldout_plans())
        return self._agree(trainer, 0.0, self.learner.take_evaluation())[1]

    def heldout_plans(self) -> list[torch.Tensor]:
        """The held-out evaluation's batch plans (the buffer's newest ``eval_max_sequences`` held-out sequences)."""
        cfg = self.config
        return self.buffer.heldout_plans(cfg.batch_size, cfg.max_len, cfg.pack_segments, cfg.eval_max_sequences)

    # ------------------------------------------------------------------ stalls
    def on_step_event(self, event: StepEvent) -> None:
        """The engine listener: queue drafter steps in stalls, or while other ranks still generate."""
        learner = self.learner
        if learner is None:
            return
        trainer = self._trainer
        if trainer is not None and (not trainer.training or trainer.sanity_checking):
            return
        cfg = self.config
        if event.phase == "done":
            # how long the wait lasts is timing: nothing is trained then in deterministic mode (nor when frozen)
            waits = cfg.train_while_waiting and not cfg.deterministic and not cfg.freeze_after_warm_start
            if waits and trainer is not None and trainer.world_size > 1:
                self.stalls.train_while_waiting(learner)
            return
        self.stalls.on_step(event, learner)

    # ------------------------------------------------------------------ ordering
    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # the queued drafter steps read the policy's embedding and LM head: they must be done before
        # the policy's update overwrites them (the main stream waits; the host does not)
        if self.learner is not None:
            self.learner.wait()

    # ------------------------------------------------------------------ the RL step boundary
    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        learner = self.learner
        if learner is None:
            return
        laps = _Laps()
        learner.wait()
        self.rl_steps += 1
        self._harvest(pl_module)
        laps("harvest")
        if not self._warm_started:  # warm_start="rollouts": the first boundary, on every rank
            self._run_warm_start(trainer)
            laps("warm_start")
        if trainer.world_size > 1 and self.config.average_across_ranks:
            learner.average_(lambda flat: trainer.strategy.reduce(flat, reduce_op="mean"))
            laps("average")
        evaluated = self._eval_ready or learner.take_evaluation()
        self._eval_ready = None
        engine = self.engine(trainer)
        measured = float(engine.last_stats.get("spec/acceptance_length", 1.0))
        # the weights changed only through an applied update: skipped (non-finite) steps publish no new version
        changed = self.published is None or learner.applied_updates != self._published_updates
        measured, heldout, changed = self._agree(trainer, measured if measured == measured else 1.0, evaluated, changed)
        if heldout is not None:
            self._heldout = heldout
            self.evaluations.append((self._last_eval_step, *heldout))
        laps("evaluation_read")
        published = self._maybe_publish(engine, measured, changed)
        laps("publish")
        stats = learner.take_stats()  # before the evaluation is queued: reading it then would wait for it
        laps("stats")
        vocab = engine.draft_vocab_ids()
        if vocab is not None:  # the rows the next rollout drafts from: the loss compares those only
            learner.set_vocabulary(vocab)
        laps("vocabulary")
        if self.buffer.num_train:
            learner.prepare()  # the graph capture synchronizes: here, not in a stall
        learner.resume_after_main()  # later drafter steps see this boundary's buffer and weights
        laps("prepare")
        if self._warm_started and (self.rl_steps == 1 or self.rl_steps % self.config.eval_every_n_steps == 0):
            learner.evaluate(self.published, self.heldout_plans())
            self._last_eval_step = self.rl_steps
            if self._shares_copy:  # it reads the engine's copy, which the next rollout's gather overwrites first
                learner.wait()
            laps("evaluation_queued")
        self._log(pl_module, engine, heldout, published, stats)
        laps("log")
        self.last_boundary = laps.seconds

    def _harvest(self, pl_module: pl.LightningModule) -> None:
        features = pl_module.take_policy_features() if isinstance(pl_module, PolicyFeatureSource) else None
        if features is None:
            return
        self.buffer.add(
            features.hidden_states, features.input_ids, features.attention_mask, features.completion_mask, features.step
        )

    def _agree(
        self, trainer: pl.Trainer, measured: float, heldout: Heldout | None, changed: bool = False
    ) -> tuple[float, Heldout | None, bool]:
        """What every rank decides on (`lightning_tlt.drafters.publishing.agree_across_ranks`: one reduce)."""
        assert self.drafter is not None
        return agree_across_ranks(measured, heldout, changed, world_size=trainer.world_size,
                                  reduce_sum=lambda t: trainer.strategy.reduce(t, reduce_op="sum"),
                                  device=self.drafter.fc.weight.device)  # fmt: skip

    def _maybe_publish(self, engine: DrafterHost, measured: float, changed: bool) -> bool:
        assert self.drafter is not None
        cfg = self.config
        if not self._warm_started or self.rl_steps % cfg.publish_every_n_steps or not changed:
            return False
        if cfg.freeze_after_warm_start and self.publications > 0:  # frozen: published once, kept
            return False
        if not publish_due(self._heldout, measured, model_free=self._model_free(engine),
                           has_published=self.published is not None, handoff_margin=cfg.handoff_margin,
                           draft_tokens=cfg.eval_draft_tokens, publish_if_improves=cfg.publish_if_improves):
            return False
        self._publish(engine, self.drafter)
        return True

    def _publish(self, engine: DrafterHost, drafter: EagleDrafter) -> None:
        assert self.learner is not None
        self.version += 1
        self.publications += 1
        self.published = publish_drafter(engine, drafter, self.version)
        self._published_updates = self.learner.applied_updates

    def _log(
        self, pl_module: pl.LightningModule, engine: DrafterHost, heldout: Heldout | None, published: bool,
        stats: dict[str, float],
    ) -> None:
        assert self.learner is not None
        metrics: dict[str, float] = {
            "drafter/steps": float(self.learner.steps_enqueued),
            "drafter/steps_this_rl_step": stats["applied"] + stats["skipped"],
            "drafter/skipped_nonfinite": stats["skipped_total"],
            "drafter/train_time_s": stats["train_time_s"],
            **self.stalls.take_metrics(),
            "drafter/version": float(self.version),
            "drafter/publications": float(self.publications),
            "drafter/published": float(published),
            "drafter/buffer_sequences": float(len(self.buffer)),
            "drafter/buffer_tokens": float(self.buffer.num_tokens),
            "drafter/eagle_drafting": float(isinstance(engine.drafter, EagleDrafter)),
        }
        if stats["applied"] > 0:
            for key in ("loss", "feature_loss", "token_loss", "top1_accuracy", "accept_rate"):
                metrics[f"drafter/{key}"] = stats[key]
        if heldout is not None:
            metrics["drafter/heldout_accept_rate"] = heldout[0]
            metrics["drafter/heldout_accept_rate_published"] = heldout[1]
            metrics["drafter/heldout_accept_len"] = expected_acceptance_length(
                min(1.0, heldout[0]), self.config.eval_draft_tokens
            )
        for name, value in metrics.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1)
        self.last_metrics = metrics

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the last evaluation queued has no later boundary to be read at: record it now
        if self.learner is not None:
            evaluated = self._eval_ready or self.learner.take_evaluation()
            self._eval_ready = None
            heldout = self._agree(trainer, 0.0, evaluated)[1]
            if heldout is not None:
                self._heldout = heldout
                self.evaluations.append((self._last_eval_step, *heldout))

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        """This rank's drafter, optimizer, buffer and counters, and on rank 0 every rank's (each harvested
        its own rollouts and trained in its own stalls: `lightning_tlt.core.rank_state`). A collective under
        several ranks: every rank calls it, as Lightning's checkpoint does."""
        world = self._trainer.world_size if self._trainer is not None else 1
        return gather_rank_states(self._local_state(), world)

    def _local_state(self) -> dict[str, Any]:
        if self.drafter is None or self.learner is None:
            return dict(self._pending_state or {})
        self.learner.wait()  # the weights read below are those after every queued step
        if self._eval_ready is None:  # an evaluation in flight is read now, so a resumed run has it too
            self._eval_ready = self.learner.take_evaluation()
        return {
            "format": STATE_FORMAT,
            "drafter": _weights(self.drafter),
            "published": _weights(self.published),
            "drafter_config": self.drafter.config.to_dict(),
            "feature_layers": self.drafter.feature_layers,
            "trainer": self.learner.state_dict(),
            "buffer": self.buffer.state_dict(),
            "version": self.version,
            "publications": self.publications,
            "rl_steps": self.rl_steps,
            "published_updates": self._published_updates,
            "heldout": self._heldout,
            "eval_ready": self._eval_ready,
            "last_eval_step": self._last_eval_step,
            "warm_started": self._warm_started,
            "pacer": self.pacer.state_dict(),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("format") != STATE_FORMAT:  # before any state is touched
            raise ValueError(
                f"DrafterCoTrainCallback: the checkpoint's drafter state is of format {state_dict.get('format')!r}, "
                f"this version reads format {STATE_FORMAT} only; resume with the version that wrote it, or drop "
                "the callback's entry from the checkpoint to start the drafter afresh"
            )
        rank = self._trainer.global_rank if self._trainer is not None else current_rank()
        state_dict = rank_state(state_dict, rank, "DrafterCoTrainCallback")  # this rank's own
        # Lightning restores callbacks before on_fit_start builds the drafter and its trainer
        if self.drafter is not None and self.learner is not None:
            self._restore(state_dict)
        else:
            self._pending_state = dict(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        assert self.drafter is not None and self.learner is not None
        self.drafter.load_state_dict(state["drafter"])
        if state.get("published") is not None:
            self.published = self.drafter.inference_copy()
            self.published.load_state_dict(state["published"])
        self.version = int(state["version"])
        self.publications = int(state["publications"])
        self.buffer.load_state_dict(state["buffer"])
        self.learner.load_state_dict(state["trainer"])
        self.rl_steps = int(state["rl_steps"])
        self._published_updates = int(state["published_updates"])
        self._heldout = None if state["heldout"] is None else tuple(state["heldout"])  # type: ignore[assignment]
        self._eval_ready = None if state["eval_ready"] is None else tuple(state["eval_ready"])  # type: ignore[assignment]
        self._last_eval_step = int(state["last_eval_step"])
        self._warm_started = bool(state["warm_started"])
        self.pacer.load_state_dict(state["pacer"])
        if self._listening_to is not None and self.published is not None:
            # restored after on_fit_start (a strategy that loads its checkpoint once the model is sharded:
            # ModelParallelStrategy): the engine still drafts with what on_fit_start handed it, the cold
            # drafter, and a resumed run's first rollout would differ from the uninterrupted run's
            self.published = publish_drafter(self.engine(), self.published, self.version)
        rank_zero_info(
            f"DrafterCoTrainCallback: resumed drafter version {self.version} after {self.learner.steps_enqueued} steps"
        )

