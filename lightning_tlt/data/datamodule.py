"""`RolloutDataModule`: each training batch is generated, scored and turned into advantages on demand.

The data of on-policy RL is made by the policy being trained, so this datamodule does not read
batches from disk: each time the training loop asks for a batch it takes the next
``prompts_per_step`` prompts of the dataset (TRL's prompt-only format), samples
``num_generations`` completions of each from the *current* policy through the `RolloutEngine`,
scores them with TRL-signature reward functions and computes GRPO's group-relative advantages
(TRL 1.16's ``_generate_and_score_completions``). It runs in the main process (``num_workers=0``)
and is exactly resumable: `state_dict` holds the data position and the sampling RNG.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset
from typing_extensions import override

from lightning_tlt.core.rank_state import gather_rank_states, rank_state
from lightning_tlt.core.types import (
    DrafterHost,
    RolloutBackend,
    RolloutOutput,
    SamplingConfig,
    SpeculativeConfig,
    StepListener,
    mixed_precision_dtype,
)
from lightning_tlt.data.rewards import (
    OnRewardError,
    RewardFunc,
    RewardScores,
    drop_overflowing_groups,
    reward_func_name,
)
from lightning_tlt.data.rollout_support import (
    batch_metrics,
    check_dataset_size,
    check_sampled_from_finite_logits,
    check_task_names,
    engine_metrics,
    load_tokenizer,
    module_settings,
    pick_heldout,
    score_completions,
    to_batch,
)
from lightning_tlt.data.sources import (
    check_prompt_column,
    is_task_name,
    load_prompts,
    resolve_reward_funcs,
)
from lightning_tlt.rl.advantages import combine_rewards, group_advantages, normalize_scale_rewards
from lightning_tlt.rl.batch import RolloutBatch, RolloutSettings
from lightning_tlt.rollout.factory import make_engine

if TYPE_CHECKING:
    from datasets import Dataset


@dataclass
class TrainerStateView:
    """The part of a Trainer's state handed to reward functions as ``trainer_state`` (TRL passes its own)."""

    global_step: int
    max_steps: int


class _RolloutStream(IterableDataset):
    """One epoch of rollout batches, generated lazily in ``__next__`` (never ahead of the training step)."""

    def __init__(self, dm: RolloutDataModule, stage: Literal["train", "eval"]) -> None:
        self.dm, self.stage = dm, stage

    def __len__(self) -> int:
        return self.dm.steps_per_epoch if self.stage == "train" else self.dm.eval_steps

    def __iter__(self) -> Iterator[RolloutBatch]:
        return self.dm._train_iter() if self.stage == "train" else self.dm._eval_iter()


class _ResumableLoader(DataLoader):
    """A DataLoader whose position is the datamodule's (so Lightning knows it resumes mid-epoch exactly)."""

    def __init__(self, dm: RolloutDataModule, stage: Literal["train", "eval"]) -> None:
        super().__init__(_RolloutStream(dm, stage), batch_size=None, num_workers=0)
        self._dm = dm

    def state_dict(self) -> dict[str, Any]:
        return self._dm.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._dm.load_state_dict(state_dict)


class RolloutDataModule(pl.LightningDataModule):
    """Generates a `RolloutBatch` per training step from the current policy.

    Args:
        dataset: a ``datasets.Dataset`` (or list of dicts) with a ``prompt`` column in TRL's format
            (a string, or a list of ``{"role", "content"}`` messages), the name of a zoo task
            (``lightning_tlt.tasks``, built with ``task_size``/``difficulty``), or a string naming a
            JSON/JSONL/Parquet/CSV file, a ``save_to_disk`` directory or a hub dataset id in the local
            HF cache (`lightning_tlt.data.sources`). Columns other than ``prompt`` reach the reward
            functions as keyword arguments, as in TRL.
        reward_funcs: TRL-signature reward functions (sync or async), or their import paths
            (``package.module:function``, ``path/to/file.py:function``); ``None`` takes the zoo task's.
        eval_dataset: prompts for validation, in any form ``dataset`` takes; ``None`` takes ``eval_split``
            of ``dataset`` when given, else a task's test split (a file or directory: no validation).
        split: the split of a ``save_to_disk``/hub/data-file directory to train on.
        eval_split: the split of ``dataset`` to validate on when ``eval_dataset`` is ``None``.
        tokenizer: an HF tokenizer or a directory to load one from; ``None`` takes the one saved with a policy
            loaded from an HF directory (``policy.path``, its chat template included), else builds the kit's.
        num_generations: completions per prompt; ``None`` takes the RL module's.
        prompts_per_step: prompts per training step (TRL's ``generation_batch_size / num_generations``).
        sampling: how to sample; ``None`` takes the RL module's (temperature, top-p/k, max length).
        speculative: the engine's speculation (`SpeculativeConfig`); ``None`` does not speculate.
        max_batch_size: engine slots; ``None`` fits one step's ``prompts_per_step * num_generations`` rows.
        max_seq_len: engine context; ``None`` is the longest prompt plus ``max_new_tokens``.
        engine: "native" (`RolloutEngine`, in-process over the policy's own parameters) or "vllm"
            (`lightning_tlt.rollout.vllm_engine.VLLMRolloutEngine` on a colocated ``vllm.LLM``, policy
            weights pushed after each optimizer step; needs ``pip install lightning-tlt[vllm]``).
        engine_kwargs: further options of the chosen engine (``use_cuda_graphs``, ``compile``, ``dtype``,
            ...; for vLLM ``gpu_memory_utilization``, ``enforce_eager``, ...). Under a ``bf16-mixed``
            Trainer the native engine's ``dtype`` defaults to bfloat16 (``16-mixed``: float16): the
            float32 policy rolls out from a copy of its weights in that dtype, refreshed every step.
        reward_weights: weight per reward function; ``None`` takes the module's, else 1 each.
        scale_rewards: "group", "batch" or "none"; ``None`` takes the module's.
        on_reward_error: "raise" stops on a reward function error (naming the prompt and completion),
            "skip" leaves the completions it cannot score out (NaN), never scoring them zero. A NaN or
            infinite reward (in float32: ``1e39`` overflows) is such an error (counted in
            ``rewards/<name>/nonfinite``), and so is a function that returns the wrong number of rewards
            or anything but numbers and ``None`` (for the whole batch); a group whose combined rewards
            or std overflow is left out (counted in ``rewards/overflow_groups``).
        seed: seeds the prompt order (reshuffled every epoch) and the sampling generator.
        shuffle: shuffle the prompts each epoch.
        task_size, difficulty, conversational, eval_size: how a zoo task's datasets are built.
    """

    def __init__(
        self,
        dataset: Any = "arithmetic",
        reward_funcs: Sequence[str | RewardFunc] | None = None,
        *,
        eval_dataset: Any = None,
        split: str = "train",
        eval_split: str | None = None,
        tokenizer: Any = None,
        num_generations: int | None = None,
        prompts_per_step: int = 4,
        sampling: SamplingConfig | None = None,
        speculative: SpeculativeConfig | None = None,
        max_batch_size: int | None = None,
        max_seq_len: int | None = None,
        engine: Literal["native", "vllm"] = "native",
        engine_kwargs: dict[str, Any] | None = None,
        reward_weights: list[float] | None = None,
        scale_rewards: str | None = None,
        on_reward_error: OnRewardError = "raise",
        seed: int = 0,
        shuffle: bool = True,
        task_size: int = 1024,
        difficulty: int = 1,
        conversational: bool = False,
        eval_size: int = 64,
    ) -> None:
        super().__init__()
        if num_generations is not None and num_generations < 1:
            raise ValueError(f"num_generations must be >= 1 or None, got {num_generations!r}")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step!r}")
        if on_reward_error not in ("raise", "skip"):
            raise ValueError(f"on_reward_error must be 'raise' or 'skip', got {on_reward_error!r}")
        if scale_rewards is not None:
            scale_rewards = normalize_scale_rewards(scale_rewards)
        if task_size < 1 or eval_size < 1:
            raise ValueError(f"task_size and eval_size must be >= 1, got {task_size!r}, {eval_size!r}")
        check_task_names(dataset, eval_dataset, difficulty)
        if eval_split is not None and isinstance(dataset, str) and is_task_name(dataset):
            raise ValueError(f"eval_split={eval_split!r} is for a file, directory or hub dataset; the task "
                             f"{dataset!r} validates on its own test split (eval_size prompts)")
        self._dataset_arg, self._eval_arg, self._tokenizer_arg = dataset, eval_dataset, tokenizer
        self.split, self.eval_split = split, eval_split
        self.reward_funcs: list[RewardFunc] = resolve_reward_funcs(reward_funcs) if reward_funcs is not None else []
        self._reward_funcs_given = reward_funcs is not None
        self.num_generations = num_generations
        self.prompts_per_step = prompts_per_step
        self.sampling = sampling
        self.speculative = speculative
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        if engine not in ("native", "vllm"):
            raise ValueError(f"engine must be 'native' or 'vllm', got {engine!r}")
        self.engine_kind = engine
        self.engine_kwargs = dict(engine_kwargs or {})
        self.reward_weights = reward_weights
        self.scale_rewards = scale_rewards
        self.on_reward_error: OnRewardError = on_reward_error
        self.seed, self.shuffle = seed, shuffle
        self.task_size, self.difficulty, self.conversational, self.eval_size = (
            task_size, difficulty, conversational, eval_size,
        )
        self.tokenizer: Any = None
        self.train_data: Dataset | None = None
        self.eval_data: Dataset | None = None
        self._engine: RolloutBackend | None = None
        self._listeners: list[StepListener] = []
        self._policy: torch.nn.Module | None = None
        self._generator: torch.Generator | None = None
        self._generator_state: torch.Tensor | None = None
        # the resumable position: epoch, prompts consumed in it, rollouts made, tokens seen
        self._epoch, self._index, self._rl_step, self._num_tokens = 0, 0, 0, 0
        self._adaptive_state: dict[str, Any] | None = None  # the engine's gate and tuner, until it exists
        self._heldout_prompt_ids: list[list[int]] = []  # `heldout_dataset`'s, for the engine's context
        self._setup_done = False

    # ------------------------------------------------------------------ setup
    @override
    def setup(self, stage: str) -> None:
        module = self.trainer.lightning_module if self.trainer is not None else None
        self.prepare(policy=getattr(module, "policy", None), settings=module_settings(module))

    def prepare(self, policy: torch.nn.Module | None = None, settings: RolloutSettings | None = None) -> None:
        """Load data, tokenizer and reward functions, and take unset options from ``settings``.

        Lightning calls it through `setup`; call it yourself to use the datamodule without a Trainer.
        """
        if policy is not None and policy is not self._policy:
            self._policy, self._engine = policy, None
        if settings is not None:
            self._inherit(settings)
        if self.num_generations is None:
            self.num_generations = 1
        if self.sampling is None:
            self.sampling = SamplingConfig()
        if self.scale_rewards is None:
            self.scale_rewards = "group"
        if not self._setup_done:
            self._load_all()
        if self._policy is not None:
            self._check_context(self._policy)

    def _load_all(self) -> None:
        self.tokenizer = load_tokenizer(self._tokenizer_arg, self._policy)
        self.train_data, task = self._load(self._dataset_arg, split="train", size=self.task_size)
        if self._eval_arg is not None:
            self.eval_data, _ = self._load(self._eval_arg, split="test", size=self.eval_size)
        elif self.eval_split is not None:
            self.eval_data = load_prompts(self._dataset_arg, split=self.eval_split)
        elif task is not None:
            self.eval_data, _ = self._load(self._dataset_arg, split="test", size=self.eval_size)
        if not self._reward_funcs_given:
            if task is None:
                raise ValueError("reward_funcs is required when dataset is not a zoo task name")
            self.reward_funcs = list(task.reward_funcs)
        if not self.reward_funcs:
            raise ValueError("reward_funcs must hold at least one reward function, got an empty list")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights needs one weight per reward function ({len(self.reward_funcs)}), "
                f"got {self.reward_weights!r}"
            )
        check_dataset_size(len(self.train_data), self.prompts_per_step, self._rank_world()[1])
        self._train_prompt_ids = [self._encode(p) for p in self.train_data["prompt"]]
        self._eval_prompt_ids = [self._encode(p) for p in self.eval_data["prompt"]] if self.eval_data else []
        self._setup_done = True

    def _check_context(self, policy: torch.nn.Module) -> None:
        """Refuse, before any rollout, a context longer than the policy has positions for."""
        assert self.sampling is not None
        positions = getattr(getattr(policy, "config", None), "max_position_embeddings", None)
        longest = self._longest_prompt()
        context = self.max_seq_len or longest + self.sampling.max_new_tokens
        if positions is not None and context > positions:
            given, fix = (
                (f"max_seq_len={self.max_seq_len}", "lower max_seq_len") if self.max_seq_len else (
                    f"the longest prompt ({longest} tokens) + max_completion_length={self.sampling.max_new_tokens}",
                    "lower max_completion_length (PPO: response_length)",
                )
            )
            raise ValueError(
                f"{given} = {context} tokens is more than the policy's {positions} positions "
                f"(config.max_position_embeddings); {fix}"
            )

    def _longest_prompt(self) -> int:
        """The longest prompt in tokens: training's, validation's and the held-out sets' (the engine's context)."""
        return max(len(p) for p in self._train_prompt_ids + self._eval_prompt_ids + self._heldout_prompt_ids)

    def heldout_dataset(self, size: int) -> Dataset:
        """``size`` distinct prompts never trained on, for an evaluation beside training (`EvalCallback`): a zoo
        task's test split (`lightning_tlt.tasks.base.split_of`: a statement's CRC32 puts it in one split only),
        else the validation prompts; checked against the training prompts (`pick_heldout`). Call it before the
        engine is built (a callback's ``setup``): the engine's context then fits the longest of them."""
        assert self.train_data is not None, "call setup/prepare first"
        arg, eval_data = self._dataset_arg, self.eval_data
        if isinstance(arg, str) and is_task_name(arg) and self._eval_arg is None:
            rows = pick_heldout(lambda n: self._load(arg, split="test", size=n)[0].to_list(), size,
                                self.train_data["prompt"])  # fmt: skip
        elif eval_data is not None:
            rows = pick_heldout(lambda n: eval_data.to_list(), size, self.train_data["prompt"])
        else:
            raise ValueError("no held-out prompts: give eval_dataset (or eval_split), or a zoo task name as dataset")
        from datasets import Dataset

        self._heldout_prompt_ids += [self._encode(row["prompt"]) for row in rows]
        return Dataset.from_list(rows)

    def generate_aside(
        self, prompt_ids: list[list[int]], sampling: SamplingConfig, num_samples: int, generator: torch.Generator
    ) -> RolloutOutput:
        """Generate with the training engine outside training (a held-out evaluation), as if it never happened:
        no step listener hears it (co-training, metrics, progress), and the engine's adaptive state (gate,
        tuner, draft vocabulary) and its last call's stats are put back afterwards. ``generator`` seeds it."""
        engine = self.engine
        adaptive, stats = engine.adaptive_state_dict(), dict(getattr(engine, "last_stats", {}))
        for fn in self._listeners:
            engine.remove_listener(fn)
        try:
            with torch.no_grad():
                return engine.generate(prompt_ids, sampling, num_samples=num_samples, generator=generator)
        finally:
            for fn in self._listeners:
                engine.add_listener(fn)
            engine.load_adaptive_state_dict(adaptive)
            if hasattr(engine, "last_stats"):
                engine.last_stats = stats

    def _inherit(self, settings: RolloutSettings) -> None:
        for name in ("num_generations", "sampling", "scale_rewards", "reward_weights"):
            ours, theirs = getattr(self, name), getattr(settings, name)
            if ours is None:
                setattr(self, name, theirs)
            elif theirs is not None and ours != theirs:
                raise ValueError(
                    f"RolloutDataModule.{name}={ours!r} disagrees with the RL module's config ({theirs!r}); "
                    f"leave it None to take the module's"
                )

    def _load(self, arg: Any, *, split: Literal["train", "test"], size: int) -> tuple[Dataset, Any]:
        from datasets import Dataset

        task = None
        if isinstance(arg, str) and is_task_name(arg):
            from lightning_tlt.tasks import get_task

            task = get_task(arg)
            data = task.make_dataset(
                size, difficulty=self.difficulty, seed=self.seed, conversational=self.conversational, split=split
            )
        elif isinstance(arg, str):
            data = load_prompts(arg, split=self.split if split == "train" else self.eval_split or "train")
        elif isinstance(arg, Dataset):
            data = arg
        elif isinstance(arg, list):
            data = Dataset.from_list(arg)
        else:
            raise ValueError(
                f"dataset must be a datasets.Dataset, a list of dicts, a task name or a file, directory or hub id, "
                f"got {type(arg)!r}"
            )
        check_prompt_column(data)
        return data, task

    def _encode(self, prompt: Any) -> list[int]:
        from lightning_tlt.models.tokenizer import encode_prompt

        return encode_prompt(self.tokenizer, prompt)

    def prompt_ids(self, split: Literal["train", "eval"] = "train") -> list[list[int]]:
        """The token ids of every prompt of ``split``, by dataset row (after `setup` or `prepare`)."""
        return [list(p) for p in (self._train_prompt_ids if split == "train" else self._eval_prompt_ids)]

    # ------------------------------------------------------------------ engine
    @property
    def policy(self) -> torch.nn.Module:
        if self._policy is None:
            raise RuntimeError("RolloutDataModule has no policy: attach it to a Trainer or call prepare(policy=...)")
        return self._policy

    @property
    def engine(self) -> RolloutBackend:
        """The rollout engine (``engine`` says which), created on first use on the policy's device."""
        if self._engine is None:
            assert self.sampling is not None and self.num_generations is not None
            longest = self._longest_prompt()
            rows = self.prompts_per_step * self.num_generations
            kwargs = dict(
                max_batch_size=self.max_batch_size or rows,
                max_seq_len=self.max_seq_len or longest + self.sampling.max_new_tokens,
                speculative=self.speculative,
                **self.engine_kwargs,
            )
            # under a bf16-mixed / 16-mixed Trainer a float32 policy (its master weights) rolls out from
            # the engine's copy in the autocast dtype (`lightning_tlt.rollout.inference_copy`), not in float32
            rollout_dtype = mixed_precision_dtype(getattr(getattr(self, "trainer", None), "precision", None))
            if rollout_dtype is not None and self.engine_kind == "native" and "dtype" not in kwargs:
                kwargs["dtype"] = rollout_dtype
            self._engine = make_engine(self.engine_kind, self.policy, tokenizer=self.tokenizer, **kwargs)
            for fn in self._listeners:
                self._engine.add_listener(fn)
            if self._adaptive_state is not None:
                self._engine.load_adaptive_state_dict(self._adaptive_state)
                self._adaptive_state = None
        return self._engine

    def drafter_host(self) -> DrafterHost:
        """The engine, as what a drafter's trainer publishes to (`lightning_tlt.core.types.DrafterHost`);
        a clear error when the backend cannot take a drafter."""
        engine = self.engine
        if not isinstance(engine, DrafterHost):
            raise TypeError(f"RolloutDataModule's engine {type(engine).__name__} ({self.engine_kind!r}) cannot take a "
                            "drafter: it is not a DrafterHost")  # fmt: skip
        return engine

    def add_listener(self, fn: StepListener) -> None:
        """Attach ``fn`` to the engine's `StepEvent` s (now, or when the engine is created)."""
        self._listeners.append(fn)
        if self._engine is not None:
            self._engine.add_listener(fn)

    def remove_listener(self, fn: StepListener) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)
        if self._engine is not None:
            self._engine.remove_listener(fn)

    @property
    def generator(self) -> torch.Generator:
        """The sampling generator (seeded from ``seed``; its state is part of `state_dict`)."""
        if self._generator is None:
            self._generator = torch.Generator(device=self.engine.device)
            if self._generator_state is not None:
                self._generator.set_state(self._generator_state)
            else:  # each DDP rank samples its own stream
                self._generator.manual_seed(self.seed + 1_000_003 * self._rank_world()[0])
        return self._generator

    # ------------------------------------------------------------------ dataloaders
    @property
    def steps_per_epoch(self) -> int:
        assert self.train_data is not None, "call setup/prepare first"
        return len(self.train_data) // (self.prompts_per_step * self._rank_world()[1])

    @property
    def eval_steps(self) -> int:
        return -(-len(self.eval_data) // self.prompts_per_step) if self.eval_data is not None else 0

    @override
    def train_dataloader(self) -> DataLoader:
        return _ResumableLoader(self, "train")

    @override
    def val_dataloader(self) -> DataLoader | list[Any]:
        if self.eval_data is None:
            if self.trainer is not None and self.trainer.state.fn == "validate":
                raise ValueError("validate needs eval_dataset (or a zoo task name as dataset)")
            return []  # fit without evaluation prompts: no validation loop
        return DataLoader(_RolloutStream(self, "eval"), batch_size=None, num_workers=0)

    def _order(self, epoch: int) -> list[int]:
        assert self.train_data is not None
        n = len(self.train_data)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(n, generator=g).tolist()

    def _rank_world(self) -> tuple[int, int]:
        if self.trainer is None:
            return 0, 1
        return int(self.trainer.global_rank), int(self.trainer.world_size)

    def _train_iter(self) -> Iterator[RolloutBatch]:
        # under DDP every rank takes its own prompts_per_step prompts of each global step (whole groups
        # per rank, so group advantages need no gathering)
        rank, world = self._rank_world()
        stride = self.prompts_per_step * world
        assert self.train_data is not None
        if self._index + stride > len(self.train_data):
            # the last pass ended but its iterator was not resumed past its last batch (Lightning stops at
            # len() without asking for one more): roll over here, or the next epoch would be an empty one
            self._epoch, self._index = self._epoch + 1, 0
        order = self._order(self._epoch)
        while self._index + stride <= len(order):
            start = self._index + rank * self.prompts_per_step
            batch = self.rollout(order[start : start + self.prompts_per_step])
            self._index += stride
            yield batch
        self._epoch, self._index = self._epoch + 1, 0

    def _eval_iter(self) -> Iterator[RolloutBatch]:
        assert self.eval_data is not None
        n = len(self.eval_data)
        g = torch.Generator(device=self.engine.device).manual_seed(self.seed + 1)  # eval never moves training's RNG
        for start in range(0, n, self.prompts_per_step):
            yield self.rollout(list(range(start, min(n, start + self.prompts_per_step))), split="eval", generator=g)

    # ------------------------------------------------------------------ one rollout
    def rollout(
        self, rows: list[int], *, split: Literal["train", "eval"] = "train", generator: torch.Generator | None = None
    ) -> RolloutBatch:
        """Generate, score and compute advantages for the dataset rows ``rows`` (one RL step)."""
        assert self.sampling is not None and self.num_generations is not None and self.scale_rewards is not None
        data = self.train_data if split == "train" else self.eval_data
        prompt_ids = self._train_prompt_ids if split == "train" else self._eval_prompt_ids
        assert data is not None
        g = self.num_generations
        records = data.select(rows).to_list() if hasattr(data, "select") else [data[i] for i in rows]
        with torch.no_grad():
            out = self.engine.generate(
                [prompt_ids[i] for i in rows], self.sampling, num_samples=g,
                generator=self.generator if generator is None else generator,
            )
        if len(out) != len(rows) * g:
            raise RuntimeError(f"the engine returned {len(out)} completions for {len(rows)} prompts x {g}")
        check_sampled_from_finite_logits(out, self._trainer_step())
        step = self._trainer_step()
        logged: dict[str, list[float]] = {}
        extra_columns: dict[str, list[Any]] = {}

        def log_metric(name: str, value: float) -> None:  # TRL's reward-function hook: a scalar metric
            logged.setdefault(name, []).append(float(value))

        def log_extra(column: str, values: list[Any]) -> None:  # TRL's hook: a column of the completions table
            extra_columns[column] = list(values)

        prompts, completions, (per_func, errors, nonfinite), reward_time = self.score(
            records, out, g, {"log_metric": log_metric, "log_extra": log_extra}
        )
        weights = torch.tensor(self.reward_weights, dtype=torch.float32) if self.reward_weights else None
        rewards, overflowed = drop_overflowing_groups(combine_rewards(per_func, weights), g, self.scale_rewards,
                                                      prompts, self.on_reward_error)
        advantages, adv_stats = group_advantages(rewards, g, self.scale_rewards)
        batch = to_batch(out, self.tokenizer.pad_token_id or 0, rewards, per_func, advantages, g, step)
        batch.prompts, batch.completions = prompts, completions
        batch.reward_func_names = [reward_func_name(f) for f in self.reward_funcs]
        if split == "train":
            self._num_tokens += int(batch.prompt_mask.sum() + batch.completion_mask.sum())
            self._rl_step += 1
        batch.metrics = batch_metrics(batch, out, adv_stats, errors, nonfinite, reward_time, self._num_tokens)
        if overflowed:
            batch.metrics["rewards/overflow_groups"] = float(overflowed)
        batch.metrics.update({name: sum(v) / len(v) for name, v in logged.items()})
        batch.extra_columns = extra_columns
        return batch

    def score(
        self, records: list[dict[str, Any]], out: RolloutOutput, num_samples: int, hooks: dict[str, Any] | None = None
    ) -> tuple[list[Any], list[Any], RewardScores, float]:
        """Score ``out`` (``num_samples`` completions of each of ``records``) with the reward functions, TRL's way
        (`score_completions`; ``hooks``: TRL's ``log_metric`` and ``log_extra``). Returns the prompts, the
        completions, the scores and the seconds the reward functions took."""
        kwargs = {"trainer_state": TrainerStateView(self._trainer_step(), self._max_steps()), **(hooks or {})}
        return score_completions(self.reward_funcs, self.tokenizer, records, out, num_samples, self.on_reward_error,
                                 kwargs)  # fmt: skip

    def _trainer_step(self) -> int:
        return int(self.trainer.global_step) if self.trainer is not None else self._rl_step

    def _max_steps(self) -> int:
        return int(self.trainer.max_steps) if self.trainer is not None else -1

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        """The position, the sampling generator and the engine's adaptive state: this rank's, and on rank 0
        every rank's (`lightning_tlt.core.rank_state`: each rank samples its own stream, so each resumes
        its own). A collective under several ranks: every rank calls it, as Lightning's checkpoint does."""
        return gather_rank_states(self._local_state(), self._rank_world()[1])

    def _local_state(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "index": self._index,
            "rl_step": self._rl_step,
            "num_tokens": self._num_tokens,
            "generator": self._generator.get_state() if self._generator is not None else self._generator_state,
            # what the engine learned about speculating (gate and draft-length tuner): a resumed run
            # speculates as the interrupted one would have
            "engine_adaptive": self._engine.adaptive_state_dict() if self._engine is not None else self._adaptive_state,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = rank_state(state_dict, self._rank_world()[0], "RolloutDataModule")
        self._epoch, self._index = int(state_dict["epoch"]), int(state_dict["index"])
        self._rl_step, self._num_tokens = int(state_dict["rl_step"]), int(state_dict["num_tokens"])
        self._generator_state = state_dict["generator"]
        if self._generator is not None and self._generator_state is not None:
            self._generator.set_state(self._generator_state)
        adaptive = state_dict.get("engine_adaptive")  # absent in checkpoints of earlier versions
        if adaptive:
            if self._engine is not None:
                self._engine.load_adaptive_state_dict(adaptive)
            else:
                self._adaptive_state = dict(adaptive)


__all__ = ["RolloutDataModule", "RolloutSettings", "check_dataset_size", "check_task_names", "engine_metrics"]
