"""lightning_tlt: fast RL training of reasoning LLMs on PyTorch Lightning.

Speculative rollouts with a drafter trained in generation stalls (Taming the Long-Tail,
arXiv 2511.16665). The public API is re-exported here lazily, so that ``import lightning_tlt``
stays light and works without the optional packages (trl, wandb, vllm).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # rollout
    "SamplingConfig": "lightning_tlt.core.types",
    "SpeculativeConfig": "lightning_tlt.core.types",
    "RolloutOutput": "lightning_tlt.core.types",
    "StepEvent": "lightning_tlt.core.types",
    "RolloutEngine": "lightning_tlt.rollout.engine",
    "CUDAGraphProfileCache": "lightning_tlt.rollout.cuda_graphs",
    # drafters
    "Drafter": "lightning_tlt.drafters.base",
    "EagleDrafter": "lightning_tlt.drafters.eagle",
    "SuffixDrafter": "lightning_tlt.drafters.suffix",
    "DraftProposal": "lightning_tlt.drafters.base",
    "FeatureReplayBuffer": "lightning_tlt.drafters.buffer",
    "eagle_loss": "lightning_tlt.drafters.loss",
    "DrafterTrainer": "lightning_tlt.drafters.trainer",
    "DrafterTrainConfig": "lightning_tlt.drafters.trainer",
    "train_drafter": "lightning_tlt.drafters.offline",
    "export_drafter": "lightning_tlt.drafters.export",
    "verify_chain": "lightning_tlt.rollout.verify",
    "verify_coupled": "lightning_tlt.rollout.verify",
    "AdaptiveGate": "lightning_tlt.rollout.gate",
    "DraftLengthTuner": "lightning_tlt.rollout.tuner",
    "SpeculationMetrics": "lightning_tlt.rollout.spec_metrics",
    # models
    "build_tokenizer": "lightning_tlt.models.tokenizer",
    "encode_prompt": "lightning_tlt.models.tokenizer",
    "build_model": "lightning_tlt.models.zoo",
    "count_parameters": "lightning_tlt.models.zoo",
    "save_model": "lightning_tlt.models.zoo",
    "load_model": "lightning_tlt.models.zoo",
    "warm_start": "lightning_tlt.rl.warmstart",
    "WarmStartConfig": "lightning_tlt.rl.warmstart",
    "evaluate_accuracy": "lightning_tlt.rl.warmstart",
    # tasks
    "TASKS": "lightning_tlt.tasks",
    "get_task": "lightning_tlt.tasks",
    # data
    "RolloutBatch": "lightning_tlt.rl.batch",
    "RolloutSettings": "lightning_tlt.rl.batch",
    "RolloutDataModule": "lightning_tlt.data.datamodule",
    # rl
    "SFTModule": "lightning_tlt.rl.sft",
    "SFTConfig": "lightning_tlt.rl.sft",
    "GRPOConfig": "lightning_tlt.rl.config",
    "PPOConfig": "lightning_tlt.rl.config",
    "PolicySpec": "lightning_tlt.rl.common",
    "PolicyFeatureSource": "lightning_tlt.rl.common",
    "PolicyFeatures": "lightning_tlt.rl.common",
    "GRPOModule": "lightning_tlt.rl.grpo",
    "PPOModule": "lightning_tlt.rl.ppo",
    # callbacks
    "DrafterCoTrainCallback": "lightning_tlt.callbacks.drafter_cotrain",
    "DrafterCoTrainConfig": "lightning_tlt.callbacks.drafter_cotrain",
    "RolloutMetricsCallback": "lightning_tlt.callbacks.rollout_metrics",
    "RolloutProgressCallback": "lightning_tlt.callbacks.rollout_progress",
    "InterruptCheckpoint": "lightning_tlt.callbacks.interrupt_checkpoint",
    "EvalCallback": "lightning_tlt.callbacks.heldout_eval",
    "EvalConfig": "lightning_tlt.callbacks.heldout_eval",
    # integrations (vllm and trl are imported only when these are used)
    "VLLMRolloutEngine": "lightning_tlt.rollout.vllm_engine",
    "make_engine": "lightning_tlt.rollout.factory",
    "rollout_func": "lightning_tlt.integrations.trl",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_tlt' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
