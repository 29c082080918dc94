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
    "SamplingConfig": "lightning_tlt.rollout.types",
    "SpeculativeConfig": "lightning_tlt.rollout.types",
    "RolloutOutput": "lightning_tlt.rollout.types",
    "StepEvent": "lightning_tlt.rollout.types",
    "RolloutEngine": "lightning_tlt.rollout.engine",
    "CUDAGraphProfileCache": "lightning_tlt.rollout.cuda_graphs",
    # drafters
    "Drafter": "lightning_tlt.drafters.base",
    "EagleDrafter": "lightning_tlt.drafters.eagle",
    "SuffixDrafter": "lightning_tlt.drafters.suffix",
    # models
    "build_tokenizer": "lightning_tlt.models.tokenizer",
    "build_model": "lightning_tlt.models.zoo",
    # data
    "RolloutBatch": "lightning_tlt.data.batch",
    "RolloutDataModule": "lightning_tlt.data.datamodule",
    # rl
    "SFTModule": "lightning_tlt.rl.sft",
    "GRPOModule": "lightning_tlt.rl.grpo",
    "PPOModule": "lightning_tlt.rl.ppo",
    # callbacks
    "DrafterCoTrainCallback": "lightning_tlt.callbacks.drafter_cotrain",
    "RolloutMetricsCallback": "lightning_tlt.callbacks.rollout_metrics",
    "RolloutProgressCallback": "lightning_tlt.callbacks.rollout_progress",
    # integrations (vllm and trl are imported only when these are used)
    "VLLMRolloutEngine": "lightning_tlt.integrations.vllm",
    "make_engine": "lightning_tlt.integrations.vllm",
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
