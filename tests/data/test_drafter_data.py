"""Drafter warm-start data from a task, and ``lightning-tlt train-drafter`` end to end (tiny, CPU)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch

from lightning_tlt.cli import main as cli_main
from lightning_tlt.data.drafter_data import sft_sequences
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.models.tokenizer import encode_prompt
from lightning_tlt.models.zoo import build_model
from lightning_tlt.tasks import get_task


def test_sft_sequences_are_prompt_then_worked_solution(tokenizer) -> None:  # noqa: ANN001
    sequences, prompt_lengths = sft_sequences("arithmetic", 3, tokenizer=tokenizer, seed=0)
    problems = get_task("arithmetic").problems(3, difficulty=1, seed=0)
    for ids, n, problem in zip(sequences, prompt_lengths, problems):
        assert ids[:n] == encode_prompt(tokenizer, problem.prompt)
        assert tokenizer.decode(ids[n:-1]) == problem.solution and ids[-1] == tokenizer.eos_token_id
    with pytest.raises(ValueError, match="n must be >= 1"):
        sft_sequences("arithmetic", 0)


@pytest.mark.parametrize("source", ["rollouts", "sft"])
def test_train_drafter_command_writes_what_vllm_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str
) -> None:
    out = tmp_path / "drafter"
    argv = ["train-drafter", "--out-dir", str(out), "--source", source, "--size", "tiny", "--prompts", "6",
            "--generations", "2", "--max-new-tokens", "12", "--steps", "8", "--batch-size", "2", "--max-len", "24",
            "--device", "cpu", "--seed", "0"]  # fmt: skip
    assert cli_main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 8 and summary["sequences"] == (12 if source == "rollouts" else 6)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 1
    policy = build_model("qwen2", "tiny", seed=0)
    loaded = EagleDrafter.from_pretrained(out, policy)
    cold = EagleDrafter.from_target(policy, generator=torch.Generator().manual_seed(0))
    assert not torch.equal(loaded.fc.weight, cold.fc.weight)  # trained, not the seed's init


def test_train_drafter_writes_weights_others_can_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "drafter"
    previous = os.umask(0o022)
    try:  # underscores, as fit's options (hyphens are accepted too)
        assert cli_main(["train-drafter", "--out_dir", str(out), "--source", "sft", "--prompts", "4", "--steps", "1",
                         "--batch_size", "2", "--max_len", "24", "--device", "cpu"]) == 0
    finally:
        os.umask(previous)
    # safetensors alone writes 0600: a vLLM server running as another user could not read the drafter
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644}
