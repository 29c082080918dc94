"""The `lightning-tlt` command: LightningCLI fit/validate from YAML, every shipped config parses, helpers dispatch."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import yaml

from lightning_tlt.cli import SUBCOMMANDS, main

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def tiny_config(tmp_path: Path, **model_config: object) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "max_steps": 2, "accelerator": "cpu", "enable_checkpointing": False, "enable_model_summary": False,
            "limit_val_batches": 1, "default_root_dir": str(tmp_path),
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                       "init_args": {"save_dir": str(tmp_path), "name": "cli"}},
            "callbacks": [{"class_path": "lightning_tlt.callbacks.rollout_metrics.RolloutMetricsCallback"}],
        },
        "model": {
            "class_path": "lightning_tlt.rl.grpo.GRPOModule",
            "init_args": {
                "policy": {"arch": "qwen2", "size": "tiny", "seed": 0},
                "config": {"num_generations": 4, "max_completion_length": 10, "learning_rate": 1e-3,
                           **model_config},
            },
        },
        "data": {"dataset": "arithmetic", "prompts_per_step": 2, "task_size": 16, "eval_size": 4,
                 "speculative": {"method": "suffix"}},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_fit_and_validate_from_yaml(tmp_path: Path) -> None:
    path = tiny_config(tmp_path)
    assert main(["fit", "--config", str(path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("cli/version_0/metrics.csv")))))
    trained = [r for r in rows if r.get("loss")]
    assert len(trained) == 2 and all(r["reward"] != "" and r["completions/mean_length"] != "" for r in trained)
    assert main(["validate", "--config", str(path)]) == 0
    rows = list(csv.DictReader(open(next(tmp_path.glob("cli/version_1/metrics.csv")))))
    assert any(r.get("eval_reward", "") != "" for r in rows)
    assert any(r.get("eval_completions/mean_length", "") != "" for r in rows)


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_shipped_config_parses(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["class_path"].startswith("lightning_tlt.rl.")
    assert printed["data"]["dataset"] in ("arithmetic", "countdown")


def test_bad_yaml_configuration_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_config(tmp_path, loss_type="ppo")
    with pytest.raises((SystemExit, ValueError)) as err:
        main(["fit", "--config", str(path)])
    text = str(err.value) + capsys.readouterr().err
    # refused while parsing the YAML (the Literal type) or by GRPOConfig's validation: either names both
    assert "loss_type" in text and "ppo" in text and "dapo" in text


def test_helper_subcommands_dispatch_before_lightningcli(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(SUBCOMMANDS) == {"warmstart", "export-drafter", "train-drafter"}
    with pytest.raises(SystemExit) as exit_info:
        main(["warmstart", "--help"])
    assert exit_info.value.code == 0
    assert "lightning-tlt warmstart" in capsys.readouterr().out


def test_only_fit_and_validate(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["test", "--help"])
    assert "invalid choice" in capsys.readouterr().err
