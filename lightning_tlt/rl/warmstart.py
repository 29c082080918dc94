"""Warm start: a zoo model fine-tuned on a task's worked solutions, cached on disk.

No pretrained policy exists offline, so demos and benchmarks start RL from a zoo model trained
with `lightning_tlt.rl.sft.SFTModule` (a real Lightning ``Trainer``) on the task's worked
solutions. The result is saved as an HF directory keyed by every setting that changes it, so the
second call with the same settings loads it instead of training.

Command line (prints loss, held-out accuracy and time)::

    python -m lightning_tlt.rl.warmstart --task arithmetic --size tiny --steps 1000
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from typing_extensions import override

from lightning_tlt.core.cli_options import OptionParser
from lightning_tlt.core.compile_cache import default_cache_dir
from lightning_tlt.models.tokenizer import build_tokenizer, encode_prompt
from lightning_tlt.models.zoo import ARCHS, ZOO_SIZES, build_model, count_parameters, load_model, save_model
from lightning_tlt.rl.sft import LengthGroupedBatchSampler, SFTCollator, SFTConfig, SFTModule
from lightning_tlt.tasks import Task, get_task

__all__ = [
    "METADATA_FILE",
    "WARMSTART_VERSION",
    "WarmStartConfig",
    "default_cache_dir",
    "evaluate_accuracy",
    "generate_completions",
    "main",
    "warm_start",
    "warm_start_dir",
    "warm_start_key",
    "warm_start_metadata",
]

WARMSTART_VERSION = "2"
"""Bumped whenever the data, the model builder or the recipe change what a cached run holds."""

METADATA_FILE = "warmstart.json"
"""Written next to the weights: the settings, the loss curve summary and the training time."""


@dataclass(frozen=True)
class WarmStartConfig:
    """Settings of a warm start (`warm_start`, `warm_start_dir`, a `PolicySpec`'s ``warm_start:``).

    Every field from ``task`` to ``max_time_s`` changes what is trained and so names the cached
    directory (`warm_start_key`); ``cache_dir``, ``device``, ``progress`` and ``cpu_threads`` only say
    where and how it runs.
    """

    task: str = "arithmetic"
    """A registered task name (`lightning_tlt.tasks.TASKS`)."""
    arch: str | None = None
    """Zoo architecture (``qwen2``, ``llama``, ``qwen3``); ``None``: ``qwen2`` (in a `PolicySpec`: the policy's)."""
    size: str | None = None
    """Zoo size (a key of `lightning_tlt.models.zoo.ZOO_SIZES`); ``None``: ``tiny`` (in a `PolicySpec`: the
    policy's)."""
    difficulty: int = 1
    """Task difficulty of the training data."""
    seed: int | None = None
    """Seed of the model init and of the data; ``None``: 0 (in a `PolicySpec`: the policy's)."""
    steps: int = 1000
    """Optimizer steps."""
    batch_size: int = 32
    """Sequences per step."""
    lr: float = 3e-3
    """Peak learning rate (cosine schedule, 5 % warmup)."""
    max_length: int | None = None
    """Longest SFT sequence in tokens (longer ones are cut); ``None``: 64 plus the task's length budget
    (`Task.max_completion_tokens`)."""
    batch_tokens: int | None = None
    """Most padded tokens per batch: a batch of long sequences holds fewer than ``batch_size`` (bounds memory
    at a large vocabulary); ``None``: ``batch_size`` always."""
    max_time_s: float | None = None
    """Stop training after this many seconds even before ``steps`` (Lightning's ``max_time``; the steps made
    are recorded as ``steps_done``); ``None``: no bound."""
    cache_dir: str | Path | None = None
    """Root of the cache; ``None``: `default_cache_dir`."""
    device: str = "cpu"
    """``"cpu"`` or ``"cuda"`` (bf16 mixed precision there)."""
    progress: bool = True
    """Show a progress bar over the SFT steps (only when it trains); the "loaded from the cache" /
    "training" messages are printed either way (``rank_zero_info``)."""
    cpu_threads: int | None = 1
    """Torch intra-op threads while training on the CPU (restored afterwards); ``None`` keeps torch's
    setting. The zoo's small models gain little from threads, and on a CPU shared with other jobs one
    thread was measured 5-10x faster than two oversubscribed OpenMP threads."""

    def __post_init__(self) -> None:
        get_task(self.task).check_difficulty(self.difficulty)
        if self.arch is not None and self.arch not in ARCHS:
            raise ValueError(f"arch must be one of {list(ARCHS)}, got {self.arch!r}")
        if self.size is not None and self.size not in ZOO_SIZES:
            raise ValueError(f"size must be one of {list(ZOO_SIZES)}, got {self.size!r}")
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size!r}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr!r}")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be >= 2 or None, got {self.max_length!r}")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise ValueError(f"batch_tokens must be >= 1 or None, got {self.batch_tokens!r}")
        if self.max_time_s is not None and not self.max_time_s > 0:
            raise ValueError(f"max_time_s must be > 0 or None, got {self.max_time_s!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 or None, got {self.cpu_threads!r}")

    def settings(self) -> dict[str, Any]:
        """What the cached run is keyed by (and what its `METADATA_FILE` records as ``settings``)."""
        # real-valued settings as floats: a YAML config's ``max_time_s: 300`` names the same run (and cache
        # directory) as ``300.0`` from the command line, whose JSON would otherwise hash differently
        max_time_s = None if self.max_time_s is None else float(self.max_time_s)
        optional = (("max_length", self.max_length), ("batch_tokens", self.batch_tokens), ("max_time_s", max_time_s))
        bounds = {k: v for k, v in optional if v is not None}
        return bounds | {
            "task": get_task(self.task).name,
            "arch": "qwen2" if self.arch is None else self.arch,
            "size": "tiny" if self.size is None else self.size,
            "difficulty": self.difficulty,
            "seed": 0 if self.seed is None else self.seed,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "lr": float(self.lr),
            "version": WARMSTART_VERSION,
        }


def warm_start_key(settings: dict[str, Any]) -> str:
    """Directory name of a cached run: readable settings plus a hash of all of them."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]
    return (
        f"{settings['task']}-{settings['arch']}-{settings['size']}-d{settings['difficulty']}"
        f"-s{settings['seed']}-{settings['steps']}steps-{digest}"
    )


def warm_start_dir(config: WarmStartConfig = WarmStartConfig()) -> Path:  # noqa: B008 (frozen: one shared default is safe)
    """Where `warm_start` with ``config`` caches its result."""
    root = Path(config.cache_dir).expanduser() if config.cache_dir is not None else default_cache_dir()
    return root / warm_start_key(config.settings())


def warm_start(config: WarmStartConfig = WarmStartConfig()) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:  # noqa: B008
    """A zoo model fine-tuned on ``config.task``'s worked solutions, trained once and then loaded from disk.

    Trains ``config.size`` ``config.arch`` (seeded init) for ``config.steps`` AdamW steps of
    ``config.batch_size`` fresh worked solutions (train split, ``config.difficulty``) with `SFTModule`
    under a Lightning ``Trainer``, then saves model, tokenizer and `METADATA_FILE` under
    ``warm_start_dir(config)``. A later call with the same settings loads that directory (a printed
    line says which happened).

    Args:
        config: what to train, where to cache it and how to run (`WarmStartConfig`).

    Returns:
        ``(model, tokenizer)``, the model in eval mode on the CPU, float32.
    """
    settings = config.settings()
    task, arch, size, difficulty, steps, lr = (
        config.task, settings["arch"], settings["size"], config.difficulty, config.steps, config.lr,
    )
    device, progress, cpu_threads = config.device, config.progress, config.cpu_threads
    directory = warm_start_dir(config)
    name = f"{settings['arch']}/{settings['size']} on {settings['task']} (difficulty {difficulty})"
    if (directory / METADATA_FILE).is_file() and (directory / "config.json").is_file():
        rank_zero_info(f"warm start: {name} loaded from the cache {directory}")
        model, tokenizer = load_model(directory, dtype=torch.float32)
        return model, tokenizer

    rank_zero_info(f"warm start: training {name} for {steps} SFT steps on {device} (not cached yet; "
                   f"saved to {directory})")
    start = time.perf_counter()
    previous_threads = torch.get_num_threads()
    if cpu_threads is not None and device == "cpu":
        torch.set_num_threads(cpu_threads)
    train_threads = torch.get_num_threads()
    try:
        model, tokenizer, history = _train(settings, device=device, progress=progress)
    finally:
        torch.set_num_threads(previous_threads)
    seconds = time.perf_counter() - start
    tail = history[-max(1, len(history) // 20) :]
    if not all(math.isfinite(x) for x in tail) or not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
        # never cache (or hand back) a diverged policy: every run after it would start from NaN weights
        raise RuntimeError(
            f"warm start diverged: {task} {arch}/{size} at lr={lr} reached a non-finite loss or weights after "
            f"{len(history)} of {steps} SFT steps (loss {history[0]:.3f} -> {tail[-1]:.3f}); nothing was cached. Lower lr (the "
            "defaults suit the tiny and small sizes: try 5e-4 or less for 100m and larger)"
        )
    metadata = {
        "settings": settings,
        "parameters": count_parameters(model),
        "steps_done": len(history),
        "first_loss": history[0],
        "final_loss": sum(tail) / len(tail),
        "train_seconds": round(seconds, 2),
        "device": device,
        "cpu_threads": train_threads if device == "cpu" else None,
        "torch": torch.__version__,
    }
    # write into a private directory and rename: a concurrent reader never sees half a model
    tmp = directory.with_name(f"{directory.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=2))
    try:
        os.replace(tmp, directory)
    except OSError:  # another process cached the same run first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    rank_zero_info(
        f"warm start: trained in {seconds:.1f} s, loss {history[0]:.3f} -> {metadata['final_loss']:.3f}, "
        f"saved to {directory}"
    )
    return model.eval(), tokenizer


def warm_start_metadata(directory: str | Path) -> dict[str, Any]:
    """The `METADATA_FILE` of a cached warm start (settings, losses, training time)."""
    return json.loads((Path(directory) / METADATA_FILE).read_text())


def _train(
    settings: dict[str, Any], *, device: str, progress: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, list[float]]:
    task = get_task(settings["task"])
    tokenizer = build_tokenizer()
    model = build_model(settings["arch"], settings["size"], seed=settings["seed"]).train()
    n = settings["steps"] * settings["batch_size"]
    data = task.make_sft_dataset(n, difficulty=settings["difficulty"], seed=settings["seed"]).to_list()
    # long solutions are cut at the task's length budget (they still teach the tail's start)
    max_length = settings.get("max_length") or 64 + task.max_completion_tokens(settings["difficulty"])
    collator = SFTCollator(tokenizer, max_length=max_length)
    lengths = [min(max_length, len(row["prompt"]) + len(row["completion"]) + 2) for row in data]
    sampler = LengthGroupedBatchSampler(
        lengths, settings["batch_size"], seed=settings["seed"], max_tokens=settings.get("batch_tokens")
    )
    loader = DataLoader(data, batch_sampler=sampler, collate_fn=collator)
    module = SFTModule(model, SFTConfig(learning_rate=settings["lr"]))
    trainer = Trainer(
        accelerator=device,
        devices=1,
        precision="bf16-mixed" if device == "cuda" else "32-true",
        max_steps=settings["steps"],
        max_time=None if settings.get("max_time_s") is None else timedelta(seconds=settings["max_time_s"]),
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,  # Lightning's bar would count epochs of a sampler: ours counts the SFT steps
        callbacks=[_StopOnDivergence(), *([_SFTProgress(settings["steps"], f"warm start SFT ({settings['task']})")]
                                          if progress else [])],
        num_sanity_val_steps=0,
    )
    trainer.fit(module, train_dataloaders=loader)
    trained: PreTrainedModel = module.model.cpu().float().eval()
    return trained, tokenizer, module.loss_history


class _StopOnDivergence(Callback):
    """Ends the SFT once its last ``window`` losses are all non-finite: the run is lost (the caller
    raises and caches nothing), so the remaining steps would only cost time."""

    def __init__(self, window: int = 5) -> None:
        self.window = window

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recent = list(getattr(pl_module, "loss_history", []))[-self.window :]
        if len(recent) == self.window and not any(math.isfinite(x) for x in recent):
            trainer.should_stop = True


class _SFTProgress(Callback):
    """A tqdm bar over the warm start's ``total`` optimizer steps, with the latest loss."""

    def __init__(self, total: int, description: str) -> None:
        self.total, self.description = total, description
        self._bar: Any = None

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=self.total, desc=self.description, unit="step", dynamic_ncols=True)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._bar.update(trainer.global_step - self._bar.n)
        history = getattr(pl_module, "loss_history", None)
        if history:
            self._bar.set_postfix(loss=f"{history[-1]:.3f}", refresh=False)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._bar.close()


@torch.no_grad()
def generate_completions(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Any],
    *,
    max_new_tokens: int,
    batch_size: int = 64,
) -> list[str]:
    """Greedy completions of TRL prompts with HF ``generate`` (batched, left-padded), special tokens dropped."""
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor(
            [[pad] * (width - len(ids)) + ids for ids in encoded], device=device
        )  # (B, P)
        attention_mask = (
            torch.arange(width, device=device)
            >= torch.tensor([width - len(ids) for ids in encoded], device=device)[:, None]
        ).long()
        out = model.generate(  # type: ignore[operator]
            input_ids=input_ids,
            attention_mask=attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )  # (B, P + new)
        texts += tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    return texts


def evaluate_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: str | Task = "arithmetic",
    n: int = 200,
    difficulty: int = 1,
    seed: int = 0,
    max_new_tokens: int | None = None,
    *,
    conversational: bool = False,
    batch_size: int = 64,
) -> float:
    """Share of ``n`` held-out prompts (test split) that the model solves greedily (task's correctness reward).

    ``max_new_tokens`` defaults to the task's `Task.max_completion_tokens` at ``difficulty``.
    """
    task = get_task(task)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    dataset = task.make_dataset(
        n, difficulty=difficulty, seed=seed, conversational=conversational, split="test"
    )
    budget = max_new_tokens if max_new_tokens is not None else task.max_completion_tokens(difficulty)
    was_training = model.training
    model.eval()
    completions = generate_completions(
        model, tokenizer, list(dataset["prompt"]), max_new_tokens=budget, batch_size=batch_size
    )
    model.train(was_training)
    columns = {k: list(dataset[k]) for k in dataset.column_names if k != "prompt"}
    rewards = task.reward_funcs[0](list(dataset["prompt"]), completions, **columns)
    return sum(rewards) / len(rewards)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lightning_tlt.rl.warmstart``: warm-start (or load) a policy, print loss, accuracy, time."""
    parser = OptionParser(
        "lightning-tlt warmstart",
        "Warm-start (or load from the cache) a zoo policy on a task's worked solutions, then print its loss, "
        "held-out greedy accuracy and time. The cache is $LIGHTNING_TLT_CACHE, else ~/.cache/lightning_tlt.",
    )
    parser.add_option("task", default="arithmetic", help="registered task (arithmetic, countdown, countdown_search)")
    parser.add_option("arch", default="qwen2", choices=["qwen2", "llama", "qwen3"])
    parser.add_option("size", default="tiny", choices=list(ZOO_SIZES))
    parser.add_option("difficulty", type=int, default=1, help="task difficulty of data and evaluation")
    parser.add_option("seed", type=int, default=0, help="seed of the init and the data")
    parser.add_option("steps", type=int, default=1000, help="optimizer steps")
    parser.add_option("batch_size", type=int, default=32, help="sequences per step")
    parser.add_option("lr", type=float, default=3e-3, help="peak learning rate (cosine)")
    parser.add_option("max_length", type=int, default=None, help="longest SFT sequence (default: task budget)")
    parser.add_option("batch_tokens", type=int, default=None, help="most padded tokens per batch")
    parser.add_option("max_time_s", type=float, default=None, help="stop training after this many seconds")
    parser.add_option("cache_dir", default=None, help="default: $LIGHTNING_TLT_CACHE or ~/.cache/lightning_tlt")
    parser.add_option("device", default="cpu", choices=["cpu", "cuda"])
    parser.add_option("eval_n", type=int, default=200, help="held-out prompts for the accuracy")
    parser.add_option("cpu_threads", type=int, default=1, help="torch threads while training on the CPU")
    parser.add_option("no_progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    try:  # what would otherwise fail after the model is built, as one line
        get_task(args.task).check_difficulty(args.difficulty)
    except ValueError as err:
        parser.error(f"--task/--difficulty: {err}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device: no GPU found (torch.cuda.is_available() is False), but --device cuda asks for one; "
                     "give --device cpu")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.device == "cpu" and args.cpu_threads is not None:
        torch.set_num_threads(args.cpu_threads)  # this process only: evaluation runs with it too
    config = WarmStartConfig(
        task=args.task, arch=args.arch, size=args.size, difficulty=args.difficulty, seed=args.seed, steps=args.steps,
        batch_size=args.batch_size, lr=args.lr, max_length=args.max_length, batch_tokens=args.batch_tokens,
        max_time_s=args.max_time_s, cache_dir=args.cache_dir, device=args.device, progress=not args.no_progress,
        cpu_threads=args.cpu_threads,
    )
    start = time.perf_counter()
    model, tokenizer = warm_start(config)
    directory = warm_start_dir(config)
    elapsed = time.perf_counter() - start
    metadata = warm_start_metadata(directory)
    eval_start = time.perf_counter()
    accuracy = evaluate_accuracy(
        model, tokenizer, args.task, n=args.eval_n, difficulty=args.difficulty, seed=args.seed + 1
    )
    eval_seconds = time.perf_counter() - eval_start
    print(f"model      {args.arch}/{args.size}: {metadata['parameters']:,} parameters, {directory}")
    print(f"loss       {metadata['first_loss']:.3f} -> {metadata['final_loss']:.3f} ({args.steps} steps)")
    print(f"train time {metadata['train_seconds']:.1f} s (this call: {elapsed:.1f} s)")
    print(
        f"accuracy   {accuracy:.1%} on {args.eval_n} held-out {args.task} prompts (difficulty {args.difficulty}), "
        f"greedy, {eval_seconds:.1f} s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
