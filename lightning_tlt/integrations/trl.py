"""TRL integration: the kit's `RolloutEngine` as ``trl.GRPOTrainer``'s ``rollout_func``.

TRL 1.16 calls ``rollout_func(prompts, trainer)`` with the prompts of this process, each already
repeated ``num_generations`` times in a row (its ``RepeatSampler``), and expects a dict with
``prompt_ids``, ``completion_ids`` and ``logprobs``, one entry per prompt it was given. The
function built here tokenizes the prompts as TRL does, finds the groups of repeated prompts, and
asks the engine for ``G`` samples of each distinct prompt: the engine prefills each prompt once
and copies its KV cache into its G slots, and speculates in the long tail if so configured.
TRL's other machinery (rewards, advantages, loss, logging) is untouched; the engine's figures
(``rollout/tokens_per_s``, ``spec/*``) are added to TRL's logged metrics.

Example::

    trainer = GRPOTrainer(model=model, reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                          rollout_func=rollout_func(speculative=SpeculativeConfig(method="suffix")))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_tlt.core.types import SamplingConfig, SpeculativeConfig
from lightning_tlt.data.datamodule import engine_metrics

RolloutFunc = Callable[[list[Any], Any], dict[str, Any]]


def group_repeats(prompts: list[Any]) -> tuple[list[Any], int]:
    """``(distinct prompts, G)`` when ``prompts`` is each of them repeated G times in a row, else ``(prompts, 1)``."""
    n = len(prompts)
    if n == 0:
        return [], 1
    run = 1
    while run < n and prompts[run] == prompts[0]:
        run += 1
    if n % run == 0 and all(prompts[i] == prompts[i - i % run] for i in range(n)):
        return prompts[::run], run
    return list(prompts), 1


def sampling_from_trl_args(args: Any) -> SamplingConfig:
    """The `SamplingConfig` of a ``trl.GRPOConfig`` (temperature, top-p, top-k, max completion length)."""
    return SamplingConfig(
        temperature=float(args.temperature),
        top_p=float(args.top_p),
        top_k=int(args.top_k or 0),
        max_new_tokens=int(args.max_completion_length),
    )


def rollout_func(
    engine: Any = None,
    tokenizer: Any = None,
    *,
    sampling: SamplingConfig | None = None,
    speculative: SpeculativeConfig | None = None,
    seed: int | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    log_metrics: bool = True,
) -> RolloutFunc:
    """Build a ``rollout_func`` for ``trl.GRPOTrainer`` that generates with the kit's engine.

    Args:
        engine: a `RolloutEngine` over the trainer's model; ``None`` creates one on the first call
            from ``trainer.model`` (with ``speculative`` and ``engine_kwargs``).
        tokenizer: encodes the prompts; ``None`` takes ``trainer.processing_class``.
        sampling: ``None`` follows the trainer's ``args`` (temperature, top_p, top_k,
            max_completion_length) at every call.
        speculative: speculation of an engine created here.
        seed: seeds the sampling generator; ``None`` takes ``trainer.args.seed``.
        engine_kwargs: other options of an engine created here (``max_batch_size``, ``max_seq_len``, ...);
            with TRL's ``bf16=True`` its ``dtype`` defaults to bfloat16 (a float32 model rolls out
            from a bf16 copy of its weights, refreshed at every call; a bf16 model is read as it is).
        log_metrics: add the engine's figures to TRL's logged metrics.

    Returns:
        ``f(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}``.
    """
    from lightning_tlt.models.tokenizer import encode_prompt

    state: dict[str, Any] = {"engine": engine, "generator": None}

    def _engine(trainer: Any, sampling: SamplingConfig, longest_prompt: int, rows: int) -> Any:
        if state["engine"] is None:
            from lightning_tlt.rollout.factory import make_engine

            opts = dict(engine_kwargs or {})
            opts.setdefault("max_seq_len", longest_prompt + sampling.max_new_tokens + 64)
            opts.setdefault("max_batch_size", rows)
            args = getattr(trainer, "args", None)
            if "dtype" not in opts and getattr(args, "bf16", False):  # float32 weights, bf16 autocast: bf16 rollouts
                opts["dtype"] = "bfloat16"
            model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
            state["engine"] = make_engine("native", model, speculative=speculative, **opts)
        return state["engine"]

    def _rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        smp = sampling or sampling_from_trl_args(trainer.args)
        tok = tokenizer if tokenizer is not None else trainer.processing_class
        distinct, g = group_repeats(list(prompts))
        ids = [encode_prompt(tok, p) for p in distinct]
        eng = _engine(trainer, smp, max(len(p) for p in ids), len(prompts))
        if state["generator"] is None:
            state["generator"] = torch.Generator(device=eng.device).manual_seed(
                int(trainer.args.seed if seed is None else seed)
            )
        with torch.no_grad():
            out = eng.generate(ids, smp, num_samples=g, generator=state["generator"])
        if len(out) != len(prompts):
            raise RuntimeError(f"the engine returned {len(out)} completions for {len(prompts)} prompts")
        if log_metrics:
            metrics = getattr(trainer, "_metrics", None)
            if metrics is not None:
                mode = "train" if trainer.model.training else "eval"
                for name, value in engine_metrics(out.stats).items():
                    metrics[mode][name].append(value)
        return {"prompt_ids": out.prompt_ids, "completion_ids": out.completion_ids, "logprobs": out.logprobs}

    _rollout.state = state  # type: ignore[attr-defined]  # the engine and generator, for inspection
    return _rollout
