"""A sharded policy (FSDP2 ``fully_shard``) rolled out from its gathered copy: two CPU processes over gloo.

Against ``torch.distributed`` directly (no Lightning): each rank shards the same policy with
`lightning_tlt.rl.fsdp.shard_module` and keeps an unsharded twin. The gathered bf16 copy must equal
the twin's bf16 copy bit for bit, the engine over the sharded policy must roll out what the engine
over the twin does (greedy, token for token; sampled, with the same keys), after a training step too;
the gather holds one piece at a time, never the float32 policy whole; the vLLM push sees the same
weights. The test runs this file as a script, once per rank; each rank writes JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(script: str, out: Path, *args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE=str(WORLD))  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, script, str(out), *args], env=dict(env, RANK=str(r)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for r in range(WORLD)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]


def test_the_gathered_copy_rolls_out_as_the_unsharded_policy(tmp_path: Path) -> None:
    run_ranks(__file__, tmp_path)  # untied and tied embeddings, one process group
    for tied in (False, True):
        ranks = [json.loads((tmp_path / f"rank{r}_tied{int(tied)}.json").read_text()) for r in range(WORLD)]
        check(ranks, tied)


def check(ranks: list[dict], tied: bool) -> None:
    for r in ranks:
        assert r["sharded"] and r["local_share"] == pytest.approx(1 / WORLD, abs=0.01)
        assert r["copy_equal"] == [True, True]  # bit for bit, before and after a training step
        assert r["tied_in_copy"] == tied
        assert r["greedy_equal"] == [True, True] and r["sampled_equal"] == [True, True]
        assert r["float32_equal"]  # the copy in the policy's own dtype (a 32-true run) too
        assert r["moved"]  # the step changed the rollouts: the copy follows training
        # one piece at a time: the largest is one parameter in float32, far below the whole policy
        assert r["buffer_bytes"] == r["largest_param_bytes"] < r["policy_bytes"] / 4
        assert r["gather_bytes"] == r["policy_bytes"] // 2  # the bf16 copy, written whole
        assert r["stats_logged"] == ["rollout/gather_buffer_mib", "rollout/gather_mib", "rollout/gather_time_s"]
        assert r["vllm_weights_equal"]
    assert ranks[0]["greedy"] == ranks[1]["greedy"]


def main(out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for tied in (False, True):
        one_policy(out, tied)
    dist.destroy_process_group()


def one_policy(out: str, tied: bool) -> None:
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from lightning_tlt.core.types import SamplingConfig
    from lightning_tlt.data.rollout_support import engine_metrics
    from lightning_tlt.models.zoo import build_config
    from lightning_tlt.rl.fsdp import shard_module
    from lightning_tlt.rollout.engine import RolloutEngine
    from lightning_tlt.rollout.inference_copy import InferenceCopy
    from lightning_tlt.rollout.vllm_support import named_weights

    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    config = build_config("qwen2", "tiny")
    config.tie_word_embeddings = tied
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(config)
    twin = copy.deepcopy(policy)
    policy_bytes = sum(p.numel() * p.element_size() for p in policy.parameters())
    largest = max(p.numel() * p.element_size() for p in policy.parameters())
    shard_module(policy, mesh)
    local = sum(p.to_local().numel() * p.element_size() for p in policy.parameters())

    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=12, stop_token_ids=[])
    sampled = SamplingConfig(temperature=1.0, max_new_tokens=12, stop_token_ids=[])
    engine = RolloutEngine(policy, max_seq_len=32, max_batch_size=8, dtype="bfloat16")
    reference = RolloutEngine(twin, max_seq_len=32, max_batch_size=8, dtype="bfloat16")
    full32 = RolloutEngine(policy, max_seq_len=32, max_batch_size=8)  # no dtype: a float32 copy
    reference32 = RolloutEngine(twin, max_seq_len=32, max_batch_size=8)  # reads the twin in place

    def same_copy() -> bool:
        assert engine.inference_copy is not None
        twin_copy = InferenceCopy(twin, torch.bfloat16)
        twin_copy.sync()
        mine = dict(engine.inference_copy.module.named_parameters())
        return all(torch.equal(mine[n], p) for n, p in twin_copy.module.named_parameters())

    def compare() -> tuple[bool, bool, list[list[int]]]:
        a = engine.generate(prompts, greedy, num_samples=2)
        b = reference.generate(prompts, greedy, num_samples=2)
        c = engine.generate(prompts, sampled, num_samples=2, generator=torch.Generator().manual_seed(3))
        d = reference.generate(prompts, sampled, num_samples=2, generator=torch.Generator().manual_seed(3))
        return a.completion_ids == b.completion_ids, c.completion_ids == d.completion_ids, a.completion_ids

    greedy_eq, sampled_eq, before = compare()
    copies = [same_copy()]
    stats = engine_metrics(engine.last_stats)
    float32_equal = (
        full32.generate(prompts, greedy, num_samples=2).completion_ids
        == reference32.generate(prompts, greedy, num_samples=2).completion_ids
    )
    vllm_equal = all(
        torch.equal(w, dict(twin.named_parameters())[n]) for n, w in named_weights(policy)
    ) and [n for n, _ in named_weights(policy)] == [n for n, _ in twin.named_parameters()]

    # one training step on both, the same batch on every rank: the averaged gradient is this rank's, exactly
    batch = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(7))
    for model in (policy, twin):
        opt = torch.optim.SGD(model.parameters(), lr=50.0)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
    greedy_after, sampled_after, after = compare()
    copies.append(same_copy())
    assert engine.inference_copy is not None
    copy_module = engine.inference_copy.module
    result = {
        "sharded": engine.inference_copy.sharded,
        "local_share": local / policy_bytes,
        "copy_equal": copies,
        "tied_in_copy": copy_module.lm_head.weight is copy_module.model.embed_tokens.weight,
        "greedy_equal": [greedy_eq, greedy_after],
        "sampled_equal": [sampled_eq, sampled_after],
        "float32_equal": float32_equal,
        "moved": before != after,
        "greedy": after,
        "buffer_bytes": int(engine.inference_copy.stats["gather/buffer_bytes"]),
        "gather_bytes": int(engine.inference_copy.stats["gather/bytes"]),
        "largest_param_bytes": largest,
        "policy_bytes": policy_bytes,
        "stats_logged": sorted(k for k in stats if k.startswith("rollout/gather")),
        "vllm_weights_equal": vllm_equal,
    }
    Path(out, f"rank{rank}_tied{int(tied)}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
