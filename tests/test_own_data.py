"""A user's own data, rewards and model through `lightning-tlt fit`: the shipped example, and an HF directory."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from lightning_tlt.cli import main
from lightning_tlt.data.datamodule import RolloutDataModule
from lightning_tlt.models.tokenizer import encode_prompt

ROOT = Path(__file__).parent.parent
EXAMPLE = ROOT / "examples" / "own_data"


def rows_of(log_dir: Path) -> list[dict[str, str]]:
    (path,) = sorted(log_dir.glob("version_*/metrics.csv"))[-1:]
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.mark.slow  # about 30 s with its warm start cached, 2 min without (2-core CPU)
def test_the_own_data_example_trains_and_validates_on_its_files(tmp_path: Path) -> None:
    # the shipped config as a user runs it (from the repository root), shortened; its warm start is cached
    out = subprocess.run(
        [sys.executable, "-m", "lightning_tlt.cli", "fit", "--config", str(EXAMPLE / "config.yaml"),
         "--trainer.max_steps", "8", "--trainer.val_check_interval", "4", "--trainer.logger.init_args.save_dir",
         str(tmp_path), "--trainer.default_root_dir", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = rows_of(tmp_path / "own_data")
    train = [r for r in rows if r.get("rewards/exact_answer/mean")]
    evals = [r for r in rows if r.get("eval_rewards/exact_answer/mean")]
    assert len(train) == 8 and len(evals) == 2  # validated at steps 4 and 8, on eval.jsonl
    # the reward functions named by path scored the file's `answer` column: the warm-started policy writes
    # the answer line nearly always and the right answer often (measured: held-out 0.73)
    assert float(evals[-1]["eval_rewards/answer_line/mean"]) >= 0.8
    assert float(evals[-1]["eval_rewards/exact_answer/mean"]) >= 0.3
    assert "validation at step 8 | reward" in out.stdout and "done: 8 RL steps" in out.stdout


def test_own_model_from_an_hf_directory_with_its_tokenizer_and_chat_template(
    tmp_path: Path, warm_arithmetic_policy: tuple[PreTrainedModel, PreTrainedTokenizerFast],
) -> None:
    model, tokenizer = warm_arithmetic_policy
    template = tokenizer.chat_template.replace("<|assistant|>", "<|assistant|>A:")  # this directory's own
    tokenizer = type(tokenizer).from_pretrained(_save(tokenizer, tmp_path / "tok"))
    tokenizer.chat_template = template
    model.save_pretrained(tmp_path / "policy")
    tokenizer.save_pretrained(tmp_path / "policy")
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Compute {a}+{b}\n"}],
                                           "answer": str(a + b)}) + "\n" for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]))
    # the datamodule takes the tokenizer (and its chat template) saved beside the policy
    dm = RolloutDataModule(str(prompts), ["lightning_tlt.tasks:arithmetic_correctness"], prompts_per_step=2)
    dm.prepare(policy=AutoModelForCausalLM.from_pretrained(tmp_path / "policy"))
    assert dm.tokenizer.chat_template == template
    assert dm.prompt_ids()[0] == encode_prompt(tokenizer, [{"role": "user", "content": "Compute 1+2\n"}])
    assert tokenizer.decode(dm.prompt_ids()[0]).endswith("<|assistant|>A:")
    # and `lightning-tlt fit` trains it from a config naming only the directory (plain prompts, as it was warm-started)
    plain = tmp_path / "plain.jsonl"
    plain.write_text("".join(json.dumps({"prompt": f"Compute {a}+{b}\n", "answer": str(a + b)}) + "\n"
                             for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]))
    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": 2, "accelerator": "cpu", "enable_checkpointing": False,
                    "enable_progress_bar": False, "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                                             "init_args": {"save_dir": str(tmp_path), "name": "own"}}},
        "model": {"class_path": "lightning_tlt.rl.grpo.GRPOModule",
                  "init_args": {"policy": {"path": str(tmp_path / "policy")},
                                "config": {"num_generations": 4, "max_completion_length": 64, "learning_rate": 1e-4}}},
        "data": {"dataset": str(plain), "reward_funcs": ["lightning_tlt.tasks:arithmetic_correctness",
                                                           "lightning_tlt.tasks:arithmetic_format"],
                 "prompts_per_step": 2},
    }
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path)]) == 0
    trained = [r for r in rows_of(tmp_path / "own") if r.get("loss")]
    assert len(trained) == 2
    # the warm-started policy (the directory's weights, not a fresh zoo model) writes the `#### n` line
    assert float(trained[0]["rewards/arithmetic_format/mean"]) >= 0.5


def _save(tokenizer: PreTrainedTokenizerFast, path: Path) -> Path:
    tokenizer.save_pretrained(path)
    return path

