"""RolloutDataModule without a Trainer: TRL reward conventions, errors that name the culprit, exact resume."""

from __future__ import annotations

import asyncio
import logging
import math
import re

import pytest
import torch

from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.data.rewards import RewardFunctionError
from lightning_tlt.models.zoo import build_model
from lightning_tlt.tasks import get_task

ROWS = [{"prompt": f"Q{i}: 1+{i}=\n", "answer": str(1 + i), "level": i % 3} for i in range(6)]


@pytest.fixture(scope="module")
def policy() -> torch.nn.Module:
    return build_model("qwen2", "tiny", seed=0)


def length_reward(completions: list[str], **kwargs: object) -> list[float]:
    return [float(len(c)) for c in completions]


def make(policy: torch.nn.Module, funcs: list, **kw: object) -> RolloutDataModule:
    opts = dict(num_generations=3, prompts_per_step=2, sampling=SamplingConfig(max_new_tokens=6), seed=0)
    opts.update(kw)
    dm = RolloutDataModule(kw.pop("dataset", ROWS), funcs, **{k: v for k, v in opts.items() if k != "dataset"})
    dm.prepare(policy=policy)
    return dm


def test_batch_layout_columns_and_async_rewards(policy: torch.nn.Module) -> None:
    seen: dict[str, list] = {}

    def uses_columns(prompts, completions, completion_ids, answer, level, trainer_state, log_metric, log_extra,  # noqa: ANN001
                     **kw):  # noqa: ANN003
        seen.update(prompts=prompts, answer=answer, level=level, ids=completion_ids)
        log_metric("custom/metric", 2.5)  # TRL's hooks for reward functions
        log_extra("first_char", [c[:1] for c in completions])
        return [1.0 if c.startswith(a) else 0.0 for c, a in zip(completions, answer)]

    async def async_len(completions, **kw):  # noqa: ANN001, ANN003
        await asyncio.sleep(0)
        return [0.5 * len(c) for c in completions]

    dm = make(policy, [uses_columns, async_len], reward_weights=[2.0, 1.0], shuffle=False)
    batch = dm.rollout([0, 1])
    assert len(batch) == 6 and batch.num_generations == 3
    assert seen["prompts"] == [ROWS[0]["prompt"]] * 3 + [ROWS[1]["prompt"]] * 3  # TRL order: G per prompt
    assert seen["answer"] == ["1"] * 3 + ["2"] * 3 and seen["level"] == [0] * 3 + [1] * 3
    assert [len(c) for c in seen["ids"]] == batch.completion_mask.sum(1).tolist()
    lengths = torch.tensor([float(len(c)) for c in batch.completions])
    torch.testing.assert_close(batch.rewards_per_func[:, 1], 0.5 * lengths)
    torch.testing.assert_close(batch.rewards, 2 * batch.rewards_per_func[:, 0] + batch.rewards_per_func[:, 1])
    # prompts left-padded, completions right-padded: every completion starts in the same column
    assert (batch.prompt_mask[:, -1] == 1).all() and (batch.completion_mask[:, 0] == 1).all()
    assert batch.metrics["rewards/async_len/mean"] == pytest.approx(0.5 * lengths.mean().item())
    assert batch.metrics["completions/mean_length"] == pytest.approx(batch.completion_mask.sum(1).float().mean().item())
    assert batch.metrics["num_tokens"] == float(batch.prompt_mask.sum() + batch.completion_mask.sum())
    assert batch.metrics["custom/metric"] == 2.5
    assert batch.extra_columns["first_char"] == [c[:1] for c in batch.completions]
    # advantages are group-relative: zero mean within each group of 3
    torch.testing.assert_close(batch.advantages.view(2, 3).sum(1), torch.zeros(2), atol=1e-5, rtol=0)


def test_none_rewards_are_missing_not_zero(policy: torch.nn.Module) -> None:
    def sometimes_none(completions, **kw):  # noqa: ANN001, ANN003
        return [None if i % 3 == 0 else 1.0 + i for i in range(len(completions))]

    batch = make(policy, [sometimes_none], scale_rewards="none").rollout([0, 1])
    assert math.isnan(batch.rewards[0].item()) and math.isnan(batch.rewards[3].item())
    assert batch.advantages[0].item() == 0.0 and batch.advantages[3].item() == 0.0
    # baseline of group 0 is mean(2, 3) = 2.5, not mean(0, 2, 3)
    assert batch.advantages[1].item() == pytest.approx(-0.5)
    assert batch.metrics["reward"] == pytest.approx((2 + 3 + 5 + 6) / 4)


def test_raising_reward_names_the_prompt_and_completion(policy: torch.nn.Module) -> None:
    def picky(prompts, completions, **kw):  # noqa: ANN001, ANN003
        return [1 / 0 if p.startswith("Q1") else 1.0 for p in prompts]

    dm = make(policy, [picky], shuffle=False)
    with pytest.raises(RewardFunctionError, match=r"reward function 'picky' raised ZeroDivisionError: .* on prompt 'Q1: 1\+1=\\n' with completion"):
        dm.rollout([0, 1])

    dm = make(policy, [picky, length_reward], shuffle=False, on_reward_error="skip")
    batch = dm.rollout([0, 1])
    col = batch.rewards_per_func[:, 0]
    assert not torch.isnan(col[:3]).any() and torch.isnan(col[3:]).all()  # skipped, never scored 0
    assert batch.metrics["rewards/picky/errors"] == 3.0
    torch.testing.assert_close(batch.rewards[3:], batch.rewards_per_func[3:, 1])


def test_wrong_reward_count_is_one_error_for_the_batch(policy: torch.nn.Module, caplog) -> None:  # noqa: ANN001
    calls: list[int] = []

    def short(completions, **kw):  # noqa: ANN001, ANN003
        calls.append(len(completions))
        return [1.0] * (len(completions) - 1)

    with pytest.raises(RewardFunctionError, match=r"^reward function 'short' returned 5 rewards for 6 completions"):
        make(policy, [short]).rollout([0, 1])
    assert calls == [6]  # not re-run row by row: the count is the batch's error, not a row's

    calls.clear()
    with caplog.at_level(logging.WARNING, logger="lightning_tlt.data.rewards"):
        batch = make(policy, [short, length_reward], on_reward_error="skip").rollout([0, 1])
    assert calls == [6]
    assert [r.getMessage() for r in caplog.records] == [
        "reward function 'short' returned 5 rewards for 6 completions (it must return one per completion, "
        "in order); skipped (all its rewards NaN)"
    ]
    assert torch.isnan(batch.rewards_per_func[:, 0]).all() and batch.metrics["rewards/short/errors"] == 6.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_rewards_follow_the_error_policy(policy: torch.nn.Module, bad: float) -> None:
    def shaky(prompts, completions, **kw):  # noqa: ANN001, ANN003
        return [bad if p.startswith("Q1") else 1.0 for p in prompts]

    with pytest.raises(RewardFunctionError, match=rf"^reward function 'shaky' returned {bad!r} on prompt "
                                                  r"'Q1: 1\+1=\\n' with completion '.*' \(and 2 more completions\)$"):
        make(policy, [shaky], shuffle=False).rollout([0, 1])

    batch = make(policy, [shaky, length_reward], shuffle=False, on_reward_error="skip").rollout([0, 1])
    col = batch.rewards_per_func[:, 0]
    assert (col[:3] == 1.0).all() and torch.isnan(col[3:]).all()  # left out, never a NaN/inf reward
    assert batch.metrics["rewards/shaky/nonfinite"] == 3.0 and "rewards/shaky/errors" not in batch.metrics
    assert math.isfinite(batch.metrics["reward"]) and torch.isfinite(batch.advantages).all()
    torch.testing.assert_close(batch.rewards[3:], batch.rewards_per_func[3:, 1])


@pytest.mark.parametrize("big", [1e39, -1e39, 10**400])
def test_a_reward_that_overflows_float32_is_nonfinite(policy: torch.nn.Module, big: float) -> None:
    def huge(prompts, completions, **kw):  # noqa: ANN001, ANN003
        return [big if p.startswith("Q1") else 1.0 for p in prompts]

    with pytest.raises(RewardFunctionError, match=rf"^reward function 'huge' returned {re.escape(repr(big))}, which is inf in "
                                                  r"float32 \(the training dtype\) on prompt 'Q1: 1\+1=\\n'"):
        make(policy, [huge], shuffle=False).rollout([0, 1])
    batch = make(policy, [huge, length_reward], shuffle=False, on_reward_error="skip").rollout([0, 1])
    assert batch.metrics["rewards/huge/nonfinite"] == 3.0 and torch.isnan(batch.rewards_per_func[3:, 0]).all()
    assert math.isfinite(batch.metrics["reward"]) and math.isfinite(batch.metrics["reward_std"])
    assert batch.advantages[3:].abs().sum() > 0  # the group is scored by length_reward, not zeroed


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_a_group_whose_std_overflows_is_reported_not_zeroed(
    policy: torch.nn.Module, scale: str, caplog: pytest.LogCaptureFixture
) -> None:
    def extreme(prompts, completions, **kw):  # noqa: ANN001, ANN003
        return [(3e38 if i % 3 == 0 else -3e38) if p.startswith("Q1") else float(i) for i, p in enumerate(prompts)]

    with pytest.raises(RewardFunctionError, match=r"^the rewards of prompt 'Q1: 1\+1=\\n' \(\[3e\+38, -3e\+38, "
                                                  r"-3e\+38\]\) overflow float32 when combined or scaled"):
        make(policy, [extreme], shuffle=False, scale_rewards=scale).rollout([0, 1])
    with caplog.at_level(logging.WARNING, logger="lightning_tlt.data.rewards"):
        batch = make(policy, [extreme], shuffle=False, scale_rewards=scale, on_reward_error="skip").rollout([0, 1])
    assert batch.metrics["rewards/overflow_groups"] == 1.0
    assert "skipped (those groups' rewards NaN, advantages 0)" in caplog.text
    assert torch.isnan(batch.rewards[3:]).all() and math.isfinite(batch.metrics["reward"])
    torch.testing.assert_close(batch.advantages[:3], torch.tensor([-1.0, 0.0, 1.0]), atol=1e-3, rtol=0)
    # two rewards that are each finite but sum to inf over functions: the same report
    with pytest.raises(RewardFunctionError, match="overflow float32 when combined or scaled"):
        make(policy, [lambda completions, **kw: [2e38] * len(completions)] * 2).rollout([0, 1])


@pytest.mark.parametrize(("returned", "said"), [
    ("11111111", "returned a str ('11111111'), not a list of rewards"),
    (b"\x01" * 6, "returned a bytes"),
    ({"a": 1.0}, "returned a dict"),
    (1.0, "returned float 1.0, not a list of rewards"),
    (["1.0"] * 6, "returned '1.0' (str) for completion 0; a reward is a float or None, not a string, bytes or a"),
    ([[1.0, 2.0]] * 6, "returned '[1.0, 2.0]' (list) for completion 0"),
])
def test_strings_bytes_and_containers_are_refused_with_the_functions_name(
    policy: torch.nn.Module, returned: object, said: str
) -> None:
    def sloppy(completions, **kw):  # noqa: ANN001, ANN003
        return returned

    with pytest.raises(RewardFunctionError) as err:
        make(policy, [sloppy]).rollout([0, 1])
    assert str(err.value).startswith(f"reward function 'sloppy' {said}"), str(err.value)
    batch = make(policy, [sloppy, length_reward], on_reward_error="skip").rollout([0, 1])
    assert torch.isnan(batch.rewards_per_func[:, 0]).all() and batch.metrics["rewards/sloppy/errors"] == 6.0


def test_numpy_and_tensor_rewards_are_numbers(policy: torch.nn.Module) -> None:
    import numpy as np

    def arrays(completions, **kw):  # noqa: ANN001, ANN003
        return np.arange(len(completions), dtype=np.float32)

    def tensors(completions, **kw):  # noqa: ANN001, ANN003
        return torch.arange(len(completions), dtype=torch.float64) * 2

    batch = make(policy, [arrays, tensors], shuffle=False).rollout([0, 1])
    torch.testing.assert_close(batch.rewards, torch.arange(6, dtype=torch.float32) * 3)


def test_bad_configuration_errors(policy: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match=r"has no 'prompt' column .* its columns are \['question', 'answer'\]"):
        make(policy, [length_reward], dataset=[{"question": "x", "answer": "1"}])
    with pytest.raises(ValueError, match="reward_weights needs one weight per reward function"):
        make(policy, [length_reward], reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match="on_reward_error must be 'raise' or 'skip', got 'ignore'"):
        RolloutDataModule(ROWS, [length_reward], on_reward_error="ignore")
    with pytest.raises(ValueError, match="prompts_per_step must be >= 1, got 0"):
        RolloutDataModule(ROWS, [length_reward], prompts_per_step=0)
    with pytest.raises(ValueError, match="fewer than prompts_per_step=8"):
        make(policy, [length_reward], prompts_per_step=8)


def test_engine_choice(policy: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="engine must be 'native' or 'vllm', got 'sglang'"):
        RolloutDataModule(ROWS, [length_reward], engine="sglang")  # type: ignore[arg-type]
    from lightning_tlt.rollout.engine import RolloutEngine

    native = make(policy, [length_reward])
    assert isinstance(native.engine, RolloutEngine) and native.engine.model is policy
    try:
        import vllm  # noqa: F401
    except ImportError:  # the main test venv: the vLLM engine is chosen, and says how to install vLLM
        with pytest.raises(ImportError, match=r"lightning-tlt\[vllm\]"):
            _ = make(policy, [length_reward], engine="vllm").engine
    else:  # the vLLM venv runs the real thing in tests/integrations/test_vllm.py
        pytest.skip("vLLM is installed: covered by tests/integrations/test_vllm.py")


def test_state_dict_resumes_the_same_next_batch(policy: torch.nn.Module) -> None:
    dm = make(policy, [length_reward])
    it = iter(dm.train_dataloader())
    next(it)
    state = dm.state_dict()
    expected = next(it)
    fresh = make(policy, [length_reward])
    fresh.load_state_dict(state)
    got = next(iter(fresh.train_dataloader()))
    assert got.prompts == expected.prompts
    torch.testing.assert_close(got.completion_ids, expected.completion_ids)
    torch.testing.assert_close(got.sampling_logprobs, expected.sampling_logprobs)


def test_epochs_cover_every_prompt_and_reshuffle(policy: torch.nn.Module) -> None:
    dm = make(policy, [length_reward], num_generations=1, sampling=SamplingConfig(max_new_tokens=1))
    assert dm.steps_per_epoch == 3
    epochs = []
    for _ in range(2):
        batches = list(dm.train_dataloader())
        epochs.append([p for b in batches for p in b.prompts])
    assert sorted(epochs[0]) == sorted(r["prompt"] for r in ROWS) == sorted(epochs[1])
    assert epochs[0] != epochs[1]
    assert dm.state_dict()["epoch"] == 2


def test_conversational_prompts_give_assistant_messages(policy: torch.nn.Module) -> None:
    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}]} for i in range(2)]

    def text_len(completions, **kw):  # noqa: ANN001, ANN003
        return [float(len(c[0]["content"])) for c in completions]

    batch = make(policy, [text_len], dataset=rows).rollout([0, 1])
    assert all(c[0]["role"] == "assistant" for c in batch.completions)
    assert batch.prompts[0] == rows[0]["prompt"] or batch.prompts[0] == rows[1]["prompt"]


def test_engine_metrics_names() -> None:
    from lightning_tlt.data.datamodule import engine_metrics

    stats = {"tokens_per_s": 100.0, "wall_time_s": 2.0, "steps": 26.0, "steps_decode": 9.0, "steps_speculative": 16.0,
             "spec/acceptance_length": 1.42, "spec/acceptance_rate_pos0": 0.4, "spec/speculative_step_share": 0.64,
             "spec/gate_switches": 1.0, "tokens_per_s/decode": 33.9, "compile/compile_s": 3.5,
             "compile/capture_s": 4.5, "compile/captures": 8.0}
    m = engine_metrics(stats)
    assert m["rollout/tokens_per_s"] == 100.0 and m["rollout/time_s"] == 2.0 and m["rollout/capture_s"] == 4.5
    assert m["rollout/compile_s"] == 3.5 and m["rollout/graph_captures"] == 8.0
    quiet = engine_metrics({**stats, "compile/compile_s": 0.0, "compile/capture_s": 0.0, "compile/captures": 0.0})
    assert not any(k in quiet for k in ("rollout/compile_s", "rollout/capture_s", "rollout/graph_captures"))
    assert m["spec/fraction"] == 0.64 and m["spec/accept_len"] == 1.42 and m["spec/gate_switches"] == 1.0
    assert m["rollout/tokens_per_s_decode"] == 33.9
    assert not any("_pos" in k for k in m)
    assert engine_metrics({"steps_decode": 3.0, "steps_speculative": 1.0})["spec/fraction"] == 0.25


def test_suffix_speculation_reports_acceptance(policy: torch.nn.Module) -> None:
    from lightning_tlt.core.types import SpeculativeConfig

    dm = make(policy, [length_reward], speculative=SpeculativeConfig(method="suffix", threshold=8),
              sampling=SamplingConfig(max_new_tokens=24))
    batch = dm.rollout([0, 1])
    assert 0.0 <= batch.metrics["spec/fraction"] <= 1.0
    if batch.metrics["spec/fraction"] > 0:
        assert batch.metrics["spec/accept_len"] >= 1.0


def test_training_forward_reproduces_the_engines_logprobs(policy: torch.nn.Module) -> None:
    """The module's per-token log-probs of a batch equal the engine's sampling log-probs (on-policy ratio 1)."""
    from lightning_tlt.rl.common import completion_forward

    dm = make(policy, [length_reward], sampling=SamplingConfig(temperature=0.7, max_new_tokens=8))
    batch = dm.rollout([0, 1])
    with torch.no_grad():
        fwd = completion_forward(policy, batch, temperature=0.7)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(fwd.logps[mask], batch.sampling_logprobs[mask], atol=2e-4, rtol=1e-4)


def test_fit_without_eval_prompts_and_validate_needs_them(tmp_path) -> None:  # noqa: ANN001
    import lightning.pytorch as pl

    from lightning_tlt.rl.config import GRPOConfig
    from lightning_tlt.rl.grpo import GRPOModule

    def run(fn: str) -> None:
        module = GRPOModule(build_model("qwen2", "tiny", seed=0), GRPOConfig(num_generations=2, max_completion_length=4))
        data = RolloutDataModule(ROWS, [length_reward], prompts_per_step=2)
        trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path)
        getattr(trainer, fn)(module, datamodule=data)
        assert trainer.global_step == (1 if fn == "fit" else 0)

    run("fit")  # a plain dataset has no eval split: fit runs without validation (sanity check included)
    with pytest.raises(ValueError, match="validate needs eval_dataset"):
        run("validate")


def test_a_dataset_too_small_for_the_ranks_is_refused(policy: torch.nn.Module) -> None:
    import lightning.pytorch as pl

    from lightning_tlt.data.datamodule import check_dataset_size

    check_dataset_size(8, 4, 2)  # exactly one RL step across two ranks
    with pytest.raises(ValueError, match=r"^the dataset has 6 prompts, fewer than prompts_per_step=4 x world size 2 "
                                         r"= 8 that one RL step takes \(every rank takes its own prompts\)"):
        check_dataset_size(6, 4, 2)
    # the datamodule's setup reads the world size of its (real, not started) DDP Trainer: no "No training batches"
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, logger=False, enable_progress_bar=False)
    dm = RolloutDataModule(ROWS, [length_reward], prompts_per_step=4, sampling=SamplingConfig(max_new_tokens=4))
    dm.trainer = trainer
    assert trainer.world_size == 2
    with pytest.raises(ValueError, match="the dataset has 6 prompts, fewer than prompts_per_step=4 x world size 2 = 8"):
        dm.prepare(policy=policy)


def test_a_context_longer_than_the_policys_positions_is_refused(policy: torch.nn.Module) -> None:
    positions = policy.config.max_position_embeddings  # 4096
    longest = max(len(p) for p in make(policy, [length_reward]).prompt_ids())
    make(policy, [length_reward], sampling=SamplingConfig(max_new_tokens=positions - longest))  # fits exactly
    too_long = positions - longest + 1
    with pytest.raises(ValueError, match=rf"^the longest prompt \({longest} tokens\) \+ max_completion_length="
                                         rf"{too_long} = {positions + 1} tokens is more than the policy's {positions} "
                                         r"positions \(config.max_position_embeddings\)"):
        make(policy, [length_reward], sampling=SamplingConfig(max_new_tokens=too_long))
    with pytest.raises(ValueError, match=r"^max_seq_len=5000 = 5000 tokens is more than the policy's 4096 positions"):
        make(policy, [length_reward], max_seq_len=5000)


def test_unknown_task_names_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"unknown task 'arithmetik'; registered tasks: \['arithmetic', 'countdown', 'countdown_search'\]"):
        RolloutDataModule("arithmetik")
    top = get_task("countdown").max_difficulty
    with pytest.raises(ValueError, match=rf"countdown: difficulty must be an int in \[1, {top}\], got 0"):
        RolloutDataModule(ROWS, [length_reward], eval_dataset="countdown", difficulty=0)


def test_rollouts_of_a_policy_with_nonfinite_weights_are_refused() -> None:
    # a NaN weight makes every logit NaN: the engine still samples (garbage, to the length cap), and
    # the sampling log-probabilities are NaN; the datamodule stops before those rows reach training
    poisoned = build_model("qwen2", "tiny", seed=0)
    with torch.no_grad():
        poisoned.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    with pytest.raises(FloatingPointError, match=r"^RL step 0: 6 of 6 completions \(first: #0\) were sampled from "
                                                 r"logits that are not finite: the policy's weights are not finite"):
        make(poisoned, [length_reward]).rollout([0, 1])
