"""A user's own prompts (files, saved datasets, the local hub cache) and reward functions by import path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict

from lightning_tlt.core.types import SamplingConfig
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.data.sources import DataSourceError, describe_source, load_prompts, load_reward_func
from lightning_tlt.models.zoo import build_model

ROWS = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in [(1, 2), (3, 4), (5, 6), (7, 1)]]
CHAT = [{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in ROWS]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet", ".csv"])
def test_each_file_format_reads_the_same_rows(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"prompts{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, ROWS)
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    elif suffix == ".parquet":
        Dataset.from_list(ROWS).to_parquet(str(path))
    else:
        Dataset.from_list(ROWS).to_csv(str(path), index=False)
    assert describe_source(str(path)) == "file"
    data = load_prompts(str(path))
    assert data["prompt"] == [r["prompt"] for r in ROWS]
    assert [str(a) for a in data["answer"]] == ["3", "7", "11", "8"]  # CSV reads numbers as numbers


def test_conversational_jsonl_keeps_its_messages(tmp_path: Path) -> None:
    data = load_prompts(str(write_jsonl(tmp_path / "chat.jsonl", CHAT)))
    assert data[0]["prompt"] == [{"role": "user", "content": "What is 1 + 2?"}]


def test_saved_datasets_and_their_splits(tmp_path: Path) -> None:
    Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "one"))
    assert len(load_prompts(str(tmp_path / "one"))) == 4
    DatasetDict(train=Dataset.from_list(ROWS[:3]), test=Dataset.from_list(ROWS[3:])).save_to_disk(
        str(tmp_path / "two"))
    assert load_prompts(str(tmp_path / "two"), split="test")["prompt"] == ["What is 7 + 1?"]
    with pytest.raises(DataSourceError, match=r"has no split 'validation'; its splits are \['test', 'train'\]"):
        load_prompts(str(tmp_path / "two"), split="validation")


def test_a_hub_dataset_is_read_from_the_local_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the hub cache's own layout: refs/main names a snapshot; nothing is downloaded
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = tmp_path / "hub" / "datasets--someone--sums"
    snapshot = repo / "snapshots" / ("a" * 40) / "data"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)
    write_jsonl(snapshot / "train.jsonl", ROWS[:3])
    write_jsonl(snapshot / "test.jsonl", ROWS[3:])
    assert describe_source("someone/sums") == "hub"
    assert len(load_prompts("someone/sums")) == 3
    assert load_prompts("someone/sums", split="test")["answer"] == ["8"]
    with pytest.raises(DataSourceError, match="hub dataset 'someone/other' is not in the local HF cache"):
        load_prompts("someone/other")


@pytest.mark.parametrize(
    ("make", "source", "message"),
    [
        (None, "missing.jsonl", r"no such file or directory: 'missing.jsonl' \(relative to "),
        (None, "arithmetik", r"unknown task 'arithmetik'; registered tasks: \['arithmetic', 'countdown'"),
        ("bad.jsonl", "bad.jsonl", r"bad.jsonl:2:1: invalid JSON: Expecting value"),
        ("bad.txt", "bad.txt", r"'bad.txt' is a .txt file; data files may be .json, .jsonl, .parquet, .csv"),
        ("noprompt.jsonl", "noprompt.jsonl", r"has no 'prompt' column .* its columns are \['question', 'answer'\]"),
        ("list.jsonl", "list.jsonl", r"list.jsonl:1: each row must be an object, got \[1, 2\]"),
    ],
)
def test_bad_sources_name_the_file_and_what_is_allowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: str | None, source: str, message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    contents = {"bad.jsonl": '{"prompt": "a"}\nnot json\n', "bad.txt": "x", "list.jsonl": "[1, 2]\n",
                "noprompt.jsonl": '{"question": "a", "answer": "b"}\n'}
    if make is not None:
        (tmp_path / make).write_text(contents[make])
    with pytest.raises(DataSourceError, match=message):
        load_prompts(source)


def test_reward_functions_by_import_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def exact(completions, answer, **kw):\n"
                                             "    return [float(c.strip() == a) for c, a in zip(completions, answer)]\n")
    by_module = load_reward_func("my_rewards:exact")  # found in the working directory
    by_file = load_reward_func(str(tmp_path / "my_rewards.py") + ":exact")
    dotted = load_reward_func("lightning_tlt.tasks.arithmetic_correctness")
    assert by_module(completions=["3", "4"], answer=["3", "3"]) == [1.0, 0.0]
    assert by_file(completions=[" 7"], answer=["7"]) == [1.0]
    assert dotted.__name__ == "arithmetic_correctness"
    with pytest.raises(DataSourceError, match=r"my_rewards has no 'exactly'; it has \['exact'\]"):
        load_reward_func("my_rewards:exactly")
    with pytest.raises(DataSourceError, match=r"no module named 'nowhere.rewards' .*package.module:function"):
        load_reward_func("nowhere.rewards:f")
    with pytest.raises(DataSourceError, match=r"'exact' is not an import path"):
        load_reward_func("exact")


def test_a_file_trains_with_its_columns_reaching_the_rewards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", ROWS)
    write_jsonl(tmp_path / "eval.jsonl", CHAT[:2])
    (tmp_path / "rw.py").write_text(
        "SEEN = []\n"
        "def answer_seen(prompts, completions, answer, **kwargs):\n"
        "    SEEN.append(list(answer))\n"
        "    return [0.5] * len(completions)\n")
    torch.manual_seed(0)
    dm = RolloutDataModule("train.jsonl", ["rw.py:answer_seen"], eval_dataset="eval.jsonl", num_generations=2,
                           prompts_per_step=2, sampling=SamplingConfig(max_new_tokens=4), shuffle=False)
    dm.prepare(policy=build_model("qwen2", "tiny", seed=0))
    batch = dm.rollout([0, 1])
    seen = dm.reward_funcs[0].__globals__["SEEN"]
    assert seen == [["3", "3", "7", "7"]]  # each prompt's answer, once per completion (G = 2)
    assert batch.reward_func_names == ["answer_seen"] and torch.all(batch.rewards == 0.5)
    assert len(dm.eval_data) == 2 and isinstance(dm.eval_data[0]["prompt"], list)


def test_eval_split_of_a_saved_dataset(tmp_path: Path) -> None:
    DatasetDict(train=Dataset.from_list(ROWS), test=Dataset.from_list(ROWS[:1])).save_to_disk(str(tmp_path / "d"))
    dm = RolloutDataModule(str(tmp_path / "d"), [lambda completions, **kw: [0.0] * len(completions)],
                           eval_split="test", prompts_per_step=2)
    dm.prepare()
    assert len(dm.train_data) == 4 and dm.eval_data["prompt"] == ["What is 1 + 2?"]
    with pytest.raises(ValueError, match="eval_split='test' is for a file, directory or hub dataset"):
        RolloutDataModule("arithmetic", eval_split="test")
