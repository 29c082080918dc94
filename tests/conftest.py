"""Shared fixtures: the kit tokenizer and tiny seeded zoo models (CPU, offline).

The model fixtures are session-scoped to keep the suite fast: treat them as read-only (a test that
trains or edits weights should call `lightning_tlt.models.zoo.build_model` for its own copy).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Triton's CPU interpreter runs the GPU kernels in the tests; it must be chosen before Triton is imported
if not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from lightning_tlt.models.tokenizer import build_tokenizer
from lightning_tlt.models.zoo import build_model

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The tests use tiny models, whose ops are too small to gain from intra-op threads, and CI/dev machines
# are small and shared: oversubscribed OpenMP threads were measured 5-10x slower than one thread here.
torch.set_num_threads(int(os.environ.get("LIGHTNING_TLT_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    """The character-level kit tokenizer (`build_tokenizer`)."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def tiny_qwen2() -> PreTrainedModel:
    """A tiny Qwen2 (hidden 128, 2 layers, 2 heads, 1 KV head, q/k/v biases), seed 0, float32, eval mode."""
    return build_model("qwen2", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_llama() -> PreTrainedModel:
    """A tiny Llama (same shape as `tiny_qwen2`, no biases), seed 0, float32, eval mode."""
    return build_model("llama", "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3() -> PreTrainedModel:
    """A tiny Qwen3 (same shape, q/k RMSNorms), seed 0, float32, eval mode."""
    return build_model("qwen3", "tiny", seed=0)


@pytest.fixture(params=["qwen2", "llama", "qwen3"])
def tiny_arch_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    """Each tiny zoo architecture in turn (fresh copy per test, seed 0)."""
    return build_model(request.param, "tiny", seed=0)


@pytest.fixture
def generator() -> torch.Generator:
    """A CPU `torch.Generator` seeded with 0 (the library never seeds globally)."""
    return torch.Generator().manual_seed(0)


@pytest.fixture(scope="session")
def warm_arithmetic_policy(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """A tiny Qwen2 briefly warm-started on arithmetic (100 steps of 8, a few seconds, own tmp cache).

    It writes the ``#### <answer>`` format but is rarely right; treat it as read-only.
    """
    from lightning_tlt.rl.warmstart import WarmStartConfig, warm_start

    cache = tmp_path_factory.mktemp("warmstart-cache")
    return warm_start(
        WarmStartConfig("arithmetic", "qwen2", "tiny", steps=100, batch_size=8, lr=3e-3, cache_dir=cache, progress=False)
    )


TwoRanks = Callable[..., list[Any]]


def _run_two_ranks(script: str, out: Path, *args: str, cwd: Path | None = None) -> list[Any]:
    """Run ``script`` as Lightning's DDP launcher's rank 0 (it starts rank 1 itself) with ``out`` and ``args``;
    each rank writes ``out/rank<r>.json``: both, parsed. The launcher's environment of an earlier run in this
    process (``LOCAL_RANK``, ``MASTER_PORT``, ...) is left out, or the script would take itself for a rank."""
    env = dict(os.environ, WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, script, str(out), *args], env=env, capture_output=True, text=True,
                          timeout=600, cwd=cwd)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.fixture(scope="session")
def two_ranks() -> TwoRanks:
    """`_run_two_ranks`: a test file that runs itself on two CPU ranks (gloo) and reads what each wrote."""
    return _run_two_ranks
