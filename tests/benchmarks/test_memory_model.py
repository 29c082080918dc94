"""benchmarks/memory_model.py: the parameter counts it models are the real ones, and each part's bytes as hand-computed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_tlt.models.zoo import build_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
try:
    import memory_model
finally:
    sys.path.remove(str(ROOT / "benchmarks"))


def test_the_zoo_policy_has_the_modelled_parameter_count() -> None:
    with torch.device("meta"):  # the 0.5 B policy's shapes, no memory
        policy = AutoModelForCausalLM.from_config(build_config("qwen2", "0.5b"))
    assert sum(p.numel() for p in policy.parameters()) == memory_model.SHAPES["0.5b"].params() == 494_032_768


def test_qwen25_parameter_counts_match_the_published_ones() -> None:
    published = {"1.5b": 1_543_714_304, "7b": 7_615_616_512, "32b": 32_763_876_352}  # Qwen2.5 model cards
    assert {k: memory_model.SHAPES[k].params() for k in published} == published


def test_each_part_as_computed_by_hand() -> None:
    shape = memory_model.SHAPES["0.5b"]
    parts = memory_model.per_rank_bytes(shape, ranks=8, rows=8, max_tokens=4224, micro_batch_tokens=16384,
                                        logit_chunk_tokens=4096)
    p = 494_032_768
    assert parts["train_state"] == 16 * p / 8  # float32 weights, grads, two AdamW moments, sharded
    assert parts["inference_copy"] == 2 * p  # bf16, whole on every rank
    assert shape.kv_bytes_per_token() == 2 * 24 * 2 * 64 * 2  # K and V, 24 layers, 2 KV heads of 64, bf16
    assert parts["kv_cache"] == 8 * 4224 * 12_288
    assert parts["gather_buffer"] == 4 * 151_936 * 896  # the embedding is the largest piece gathered
    # FSDP2's root unit (tied embedding and head, final norm) whole in float32, and three layers
    layer = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
    assert shape.layer_params() == layer
    assert parts["fsdp_buffers"] == 4 * (151_936 * 896 + 896 + 3 * layer)
    assert parts["drafter"] == 18 * (2 * 896 * 896 + layer) + 65536 * 896 * 2  # replicated, and its bf16 buffer
    unsharded = memory_model.per_rank_bytes(shape, ranks=1, rows=8, max_tokens=4224, micro_batch_tokens=16384,
                                            logit_chunk_tokens=4096)
    assert unsharded["fsdp_buffers"] == 0 and unsharded["train_state"] == 16 * p  # --ranks 1: no FSDP
    working = 16384 * (10 * 896 + 3 * 4864) * 2  # one layer's working set, bf16
    logits = 4096 * 151_936 * 4
    assert parts["activations"] == 16384 * 24 * 896 * 2 + working + logits  # checkpointed: a hidden state a layer
    plain = memory_model.per_rank_bytes(shape, ranks=8, rows=8, max_tokens=4224, micro_batch_tokens=16384,
                                        logit_chunk_tokens=4096, gradient_checkpointing=False)
    assert plain["activations"] == 24 * working + logits  # every layer's working set kept
    with pytest.raises(ValueError, match="must divide ranks=8"):
        memory_model.per_rank_bytes(shape, ranks=8, rows=8, max_tokens=1, micro_batch_tokens=1, logit_chunk_tokens=1,
                                    rollout_tp=3)
    with pytest.raises(ValueError, match="ranks=0"):
        memory_model.per_rank_bytes(shape, ranks=0, rows=8, max_tokens=1, micro_batch_tokens=1, logit_chunk_tokens=1)


def test_the_script_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "m.json"
    results = memory_model.main(["--ranks", "8", "--out", str(out)])
    assert json.loads(out.read_text())["per_rank"] == results["per_rank"]
    assert results["per_rank"]["7b"]["fits"] and not results["per_rank"]["32b"]["fits"]  # on 8 H200s, 64 rows each
