"""SFT warm start: the completion-only loss, the collator, a real Trainer run and the on-disk cache."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from lightning_tlt.models.tokenizer import encode_prompt
from lightning_tlt.models.zoo import build_model
from lightning_tlt.rl.sft import (
    IGNORE_INDEX,
    LengthGroupedBatchSampler,
    SFTCollator,
    SFTConfig,
    SFTModule,
    lr_factor,
    sft_loss,
)
from lightning_tlt.rl.warmstart import (
    WarmStartConfig,
    default_cache_dir,
    evaluate_accuracy,
    generate_completions,
    warm_start,
    warm_start_dir,
    warm_start_metadata,
)
from lightning_tlt.tasks import get_task


def test_sft_loss_by_hand() -> None:
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 3.0], [1.0, 1.0, 1.0]]])  # (1, 4, 3)
    labels = torch.tensor(
        [[IGNORE_INDEX, IGNORE_INDEX, 1, 2]]
    )  # position 1 predicts 1, position 2 predicts 2
    loss, stats = sft_loss(logits, labels)
    lse1 = math.log(1 + math.e + 1)
    lse2 = math.log(1 + 1 + math.exp(3))
    expected = ((lse1 - 1.0) + (lse2 - 3.0)) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert stats["num_tokens"].item() == 2 and stats["mean_token_accuracy"].item() == 1.0
    assert not stats["mean_token_accuracy"].requires_grad
    with pytest.raises(ValueError, match="no completion token"):
        sft_loss(logits, torch.full((1, 4), IGNORE_INDEX))


def test_collator_masks_prompt_and_padding(tokenizer: PreTrainedTokenizerFast) -> None:
    rows = [
        {"prompt": "Compute 1+2\n", "completion": "1+2=3\n#### 3"},
        {
            "prompt": [{"role": "user", "content": "Compute 1+2"}],
            "completion": [{"role": "assistant", "content": "#### 3"}],
        },
    ]
    batch = SFTCollator(tokenizer, max_length=64)(rows)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    plain_prompt = 1 + len("Compute 1+2\n")
    plain_total = plain_prompt + len("1+2=3\n#### 3") + 1
    chat_prompt = len(encode_prompt(tokenizer, rows[1]["prompt"]))
    assert chat_prompt == 1 + 1 + len("Compute 1+2") + 1 + 1  # <bos><|user|>...<eos><|assistant|>
    chat_total = chat_prompt + len("#### 3") + 1
    assert ids.shape == labels.shape == mask.shape == (2, plain_total)
    assert mask.sum(1).tolist() == [plain_total, chat_total]
    assert (labels[0, :plain_prompt] == IGNORE_INDEX).all() and (
        labels[0, plain_prompt:] != IGNORE_INDEX
    ).all()
    assert tokenizer.decode(labels[0, plain_prompt:]) == "1+2=3\n#### 3<eos>"
    assert tokenizer.decode(labels[1, chat_prompt:chat_total]) == "#### 3<eos>"
    assert (labels[1, chat_total:] == IGNORE_INDEX).all() and (
        ids[1, chat_total:] == tokenizer.pad_token_id
    ).all()
    assert tokenizer.decode(ids[1, :chat_prompt]) == "<bos><|user|>Compute 1+2<eos><|assistant|>"
    # truncation keeps the prompt and cuts the completion
    short = SFTCollator(tokenizer, max_length=plain_prompt + 3)(rows[:1])
    assert (
        short["input_ids"].shape == (1, plain_prompt + 3)
        and tokenizer.decode(short["labels"][0, -3:]) == "1+2"
    )


def test_length_grouped_batches_cover_every_index_once() -> None:
    lengths = [(i * 37) % 101 for i in range(250)]
    sampler = LengthGroupedBatchSampler(lengths, 16, seed=3, window_batches=4)
    first = list(sampler)
    assert len(first) == len(sampler) == 16
    assert sorted(i for b in first for i in b) == list(range(250))

    # batches are length-homogeneous: far less padding than a random split
    def waste(batches: list[list[int]]) -> int:
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in batches)

    in_order = [list(range(i, min(i + 16, 250))) for i in range(0, 250, 16)]
    assert waste(first) < 0.4 * waste(in_order)
    assert first == list(LengthGroupedBatchSampler(lengths, 16, seed=3, window_batches=4))
    assert first != list(sampler)  # the next epoch reshuffles


def test_length_grouped_batches_within_a_token_budget() -> None:
    lengths = [10] * 40 + [100] * 10 + [400] * 3
    sampler = LengthGroupedBatchSampler(lengths, 16, seed=0, max_tokens=800)
    batches = list(LengthGroupedBatchSampler(lengths, 16, seed=0, max_tokens=800))
    assert len(sampler) == len(batches)
    assert sorted(i for b in batches for i in b) == list(range(53))
    assert all(len(b) * max(lengths[i] for i in b) <= 800 for b in batches)
    assert sorted(len(b) for b in batches if lengths[b[0]] == 400) == [1, 2]  # 2 x 400 fit, 3 do not
    assert max(len(b) for b in batches) == 16  # short rows still fill whole batches
    with pytest.raises(ValueError, match="max_tokens must be >= 1 or None, got 0"):
        LengthGroupedBatchSampler(lengths, 16, max_tokens=0)


def test_lr_schedule_and_config_validation() -> None:
    cfg = SFTConfig(learning_rate=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert lr_factor(0, 100, cfg) == pytest.approx(0.1)
    assert lr_factor(9, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(10, 100, cfg) == pytest.approx(1.0)
    assert lr_factor(99, 100, cfg) == pytest.approx(0.1)
    assert lr_factor(50, 100, SFTConfig(lr_scheduler_type="constant")) == 1.0
    with pytest.raises(ValueError, match="learning_rate must be > 0, got -1"):
        SFTConfig(learning_rate=-1)
    with pytest.raises(ValueError, match="lr_scheduler_type must be 'cosine' or 'constant', got 'linear'"):
        SFTConfig(lr_scheduler_type="linear")
    with pytest.raises(ValueError, match=r"adam_beta2 must be in \[0, 1\), got 1.0"):
        SFTConfig(adam_beta2=1.0)


def test_sft_module_fits_with_a_real_trainer(tokenizer: PreTrainedTokenizerFast) -> None:
    model = build_model("llama", "tiny", seed=1)  # eval mode: the module switches it to train
    data = get_task("countdown").make_sft_dataset(48, difficulty=1, seed=0).to_list()
    loader = DataLoader(data, batch_size=8, collate_fn=SFTCollator(tokenizer, max_length=128))
    module = SFTModule(model, SFTConfig(learning_rate=3e-3))
    before = model.lm_head.weight.detach().clone()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        module,
        train_dataloaders=loader,
        val_dataloaders=DataLoader(data[:8], batch_size=8, collate_fn=SFTCollator(tokenizer)),
    )
    assert trainer.global_step == 6 and len(module.loss_history) == 6
    assert model.training
    assert module.loss_history[0] == pytest.approx(
        math.log(128), abs=0.3
    )  # random init: ~uniform over the vocab
    assert module.loss_history[-1] < module.loss_history[0] - 0.5
    assert not torch.equal(before, model.lm_head.weight)
    assert trainer.callback_metrics["val/loss"].item() < module.loss_history[0]
    assert 0.0 <= trainer.callback_metrics["train/mean_token_accuracy"].item() <= 1.0


def test_greedy_batched_generation_matches_unbatched(
    tiny_qwen2: PreTrainedModel, tokenizer: PreTrainedTokenizerFast
) -> None:
    prompts = ["Compute 1+2*3\n", "Use 3 5 2 to make 16\n", [{"role": "user", "content": "Compute 9-4"}]]
    batched = generate_completions(tiny_qwen2, tokenizer, prompts, max_new_tokens=12)
    singles = [generate_completions(tiny_qwen2, tokenizer, [p], max_new_tokens=12)[0] for p in prompts]
    assert batched == singles
    assert all(len(text) <= 12 for text in batched)
    # an untrained model never writes "#### <answer>": accuracy is exactly 0 (and the model is left in eval mode)
    assert evaluate_accuracy(tiny_qwen2, tokenizer, "countdown", n=4, difficulty=1, max_new_tokens=8) == 0.0
    assert not tiny_qwen2.training
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        evaluate_accuracy(tiny_qwen2, tokenizer, "arithmetic", n=0)


def test_short_warm_start_lowers_loss_and_is_cached(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    kwargs = dict(difficulty=1, seed=0, steps=40, batch_size=8, lr=3e-3, cache_dir=tmp_path, progress=False)
    caplog.set_level(logging.INFO)
    start = time.perf_counter()
    model, tokenizer = warm_start(WarmStartConfig("arithmetic", "qwen2", "tiny", **kwargs))
    first_seconds = time.perf_counter() - start
    # printed through Lightning's rank-zero logger: visible under `lightning-tlt fit` and in scripts
    assert "warm start: training qwen2/tiny on arithmetic (difficulty 1) for 40 SFT steps on cpu" in caplog.text
    assert "loaded from the cache" not in caplog.text
    assert any(r.name.startswith("lightning.pytorch") for r in caplog.records if "warm start:" in r.getMessage())
    directory = warm_start_dir(
        WarmStartConfig("arithmetic", "qwen2", "tiny", **{k: v for k, v in kwargs.items() if k != "progress"})
    )
    assert directory.parent == tmp_path and directory.name.startswith("arithmetic-qwen2-tiny-d1-s0-40steps-")
    meta = warm_start_metadata(directory)
    assert meta["first_loss"] == pytest.approx(math.log(128), abs=0.3)
    assert meta["final_loss"] < meta["first_loss"] - 1.5, meta  # 40 small steps already learn the format
    assert meta["parameters"] == 328_832 and meta["settings"]["steps"] == 40

    caplog.clear()
    start = time.perf_counter()
    again, tokenizer2 = warm_start(WarmStartConfig("arithmetic", "qwen2", "tiny", **kwargs))
    second_seconds = time.perf_counter() - start
    assert f"warm start: qwen2/tiny on arithmetic (difficulty 1) loaded from the cache {directory}" in caplog.text
    assert "warm start: training" not in caplog.text
    assert second_seconds < first_seconds
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert tokenizer2.get_vocab() == tokenizer.get_vocab()


def test_warm_start_shows_a_bar_over_its_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    warm_start(WarmStartConfig("arithmetic", "qwen2", "tiny", steps=3, batch_size=4, cache_dir=tmp_path))
    err = capsys.readouterr().err
    assert "warm start SFT (arithmetic): 100%" in err and "3/3" in err and "loss=" in err
    assert "Epoch 0" not in err  # not Lightning's epoch bar


def test_warm_start_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_TLT_CACHE", str(tmp_path / "env-cache"))
    assert default_cache_dir() == tmp_path / "env-cache"
    assert warm_start_dir().parent == tmp_path / "env-cache"
    monkeypatch.delenv("LIGHTNING_TLT_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "lightning_tlt"
    assert warm_start_dir(WarmStartConfig(seed=1)) != warm_start_dir(WarmStartConfig(seed=2)) != warm_start_dir(WarmStartConfig(seed=2, lr=1e-3))
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        warm_start(WarmStartConfig(steps=0, cache_dir=tmp_path))
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda', got 'tpu'"):
        warm_start(WarmStartConfig(device="tpu", cache_dir=tmp_path))
    with pytest.raises(ValueError, match="size must be one of"):
        warm_start(WarmStartConfig(size="7b", cache_dir=tmp_path))
    with pytest.raises(ValueError, match="max_length must be >= 2 or None, got 1"):
        warm_start(WarmStartConfig(max_length=1, cache_dir=tmp_path))
    with pytest.raises(ValueError, match="batch_tokens must be >= 1 or None, got 0"):
        warm_start(WarmStartConfig(batch_tokens=0, cache_dir=tmp_path))
    with pytest.raises(ValueError, match="max_time_s must be > 0 or None, got 0"):
        warm_start(WarmStartConfig(max_time_s=0, cache_dir=tmp_path))
    # the bounds enter the cache key only when set (caches made before them stay valid)
    assert warm_start_dir(WarmStartConfig(max_length=None, max_time_s=None)) == warm_start_dir()
    assert len({warm_start_dir(), warm_start_dir(WarmStartConfig(max_length=256)), warm_start_dir(WarmStartConfig(max_time_s=60.0))}) == 3
    # a YAML config's integers name the same run as the command line's floats (one SFT, one cache)
    assert warm_start_dir(WarmStartConfig(max_time_s=300, lr=1)) == warm_start_dir(WarmStartConfig(max_time_s=300.0, lr=1.0))


def test_warm_start_config_names_the_same_cache_as_before() -> None:
    """Directory names computed before `WarmStartConfig` replaced the keyword arguments (issue 36):
    the same settings find the same cached run, from the API and from a config's ``policy.warm_start``."""
    from dataclasses import replace

    import yaml

    from lightning_tlt.rl.common import PolicySpec

    assert warm_start_dir(WarmStartConfig(cache_dir="/c")) == Path("/c/arithmetic-qwen2-tiny-d1-s0-1000steps-f18ad45b9f")
    gpu = WarmStartConfig(
        "countdown_search", size="100m", difficulty=3, steps=600, batch_size=32, batch_tokens=32768, lr=5e-4,
        max_length=4160, max_time_s=200, cache_dir="/c", device="cuda", progress=False,
    )
    assert warm_start_dir(gpu).name == "countdown_search-qwen2-100m-d3-s0-600steps-377f288cbd"
    config = yaml.safe_load((Path(__file__).parents[2] / "configs" / "grpo_gpu_100m.yaml").read_text())
    spec = PolicySpec(**config["model"]["init_args"]["policy"])
    assert isinstance(spec.warm_start, WarmStartConfig)
    assert spec.warm_start == replace(gpu, arch="qwen2", seed=0, cache_dir=None)
    assert warm_start_dir(replace(spec.warm_start, cache_dir="/c")) == warm_start_dir(gpu)
    # a task name is the defaults' warm start; arch, size and seed are the policy's
    assert PolicySpec(size="small", seed=3, warm_start="countdown").warm_start == WarmStartConfig(
        "countdown", "qwen2", "small", seed=3
    )
    with pytest.raises(ValueError, match=r"warm_start.size='tiny' differs from the policy's size='100m'"):
        PolicySpec(size="100m", warm_start=WarmStartConfig(size="tiny"))
    with pytest.raises(ValueError, match=r"arch must be one of \['qwen2', 'llama', 'qwen3'\], got 'gpt2'"):
        WarmStartConfig(arch="gpt2")
    with pytest.raises(ValueError, match="cpu_threads must be >= 1 or None, got 0"):
        WarmStartConfig(cpu_threads=0)


def test_warm_start_bounded_in_time_and_length(tmp_path: Path) -> None:
    kwargs = dict(
        steps=500, batch_size=4, max_length=40, batch_tokens=80, max_time_s=1e-3, cache_dir=tmp_path, progress=False
    )
    warm_start(WarmStartConfig("countdown_search", "qwen2", "tiny", **kwargs))
    directory = warm_start_dir(
        WarmStartConfig("countdown_search", "qwen2", "tiny", **{k: v for k, v in kwargs.items() if k != "progress"})
    )
    meta = warm_start_metadata(directory)
    assert meta["steps_done"] == 1 < meta["settings"]["steps"]  # the time bound ends training after one step
    assert (meta["settings"]["max_length"], meta["settings"]["batch_tokens"], meta["settings"]["max_time_s"]) == (
        40, 80, 1e-3,
    )


def test_warmstart_cli_trains_then_hits_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_tlt.rl.warmstart import main

    argv = [
        "--task",
        "countdown",
        "--steps",
        "12",
        "--batch-size",
        "4",
        "--eval-n",
        "2",
        "--cache-dir",
        str(tmp_path),
    ]
    argv += ["--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "qwen2/tiny: 328,832 parameters" in out and "(12 steps)" in out
    assert "on 2 held-out countdown prompts (difficulty 1)" in out
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert entry.name.startswith("countdown-qwen2-tiny-d1-s0-12steps-")
    trained_at = (entry / "model.safetensors").stat().st_mtime_ns
    assert main(argv) == 0
    assert (entry / "model.safetensors").stat().st_mtime_ns == trained_at  # loaded, not retrained
    assert len([p for p in tmp_path.iterdir()]) == 1


def test_warm_arithmetic_policy_fixture_writes_the_format(
    warm_arithmetic_policy: tuple[PreTrainedModel, PreTrainedTokenizerFast],
) -> None:
    model, tokenizer = warm_arithmetic_policy
    prompts = [p.prompt for p in get_task("arithmetic").problems(8, difficulty=1, seed=0, split="test")]
    completions = generate_completions(model, tokenizer, prompts, max_new_tokens=48)
    fmt = get_task("arithmetic").reward_funcs[1](prompts, completions)
    assert sum(fmt) >= 6, completions  # 100 steps teach "... #### <integer>" (measured: 32 of 32)


def test_a_diverged_warm_start_is_refused_and_not_cached(tmp_path) -> None:
    """A warm start whose loss or weights turn non-finite raises (naming the lr) and caches nothing:
    on the H200 a 100m warm start at the tiny sizes' lr reached NaN and every later run used it."""
    from lightning_tlt.rl.warmstart import warm_start

    with pytest.raises(RuntimeError, match=r"warm start diverged: arithmetic qwen2/tiny at lr=1e\+30") as err:
        warm_start(WarmStartConfig("arithmetic", "qwen2", "tiny", steps=60, batch_size=4, lr=1e30, cache_dir=tmp_path,
                                   progress=False))
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    done = int(str(err.value).split(" after ")[1].split(" of ")[0])
    assert done < 20  # it stopped once five losses in a row were non-finite, not after all 60 steps
