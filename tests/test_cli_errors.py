"""`lightning-tlt fit` errors: one line each, keyed, exit 2; the traceback behind --debug (lightning_tlt.config_errors)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_cli import tiny_config

from lightning_tlt.cli import main
from lightning_tlt.config_errors import ConfigError, negative_numbers_as_values, summarize

ROOT = Path(__file__).parent.parent


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    def no_warm_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("the warm start ran before the config was checked")

    monkeypatch.setattr("lightning_tlt.rl.warmstart.warm_start", no_warm_start)
    path = tiny_config(tmp_path)
    data = yaml.safe_load(path.read_text())
    data["model"]["init_args"]["policy"]["warm_start"] = "arithmetic"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (["--trainer.max_step", "8"], "--trainer.max_step: unknown option (did you mean --trainer.max_steps?)"),
        (["--model.init_args.config.learning_rate", "-1e-4"],
         "model.init_args.config.learning_rate: learning_rate must be > 0, got -0.0001"),
        (["--model.init_args.config.learning_rate", "abc"], "model.init_args.config.learning_rate: expected float, got abc"),
        (["--model.init_args.config.num_generations", "1"],
         "model.init_args.config.num_generations: num_generations must be >= 2 (GRPO's advantages compare "
         "completions of one prompt), got 1"),
        (["--trainer.max_steps", "3.5"], "trainer.max_steps: expected int, got 3.5"),
        (["--data.task_size", "0"], "data.task_size: task_size and eval_size must be >= 1, got 0, 4"),
        (["--data.speculative.method", "eagel"],
         "data.speculative.method: expected one of 'eagle', 'suffix', 'none', got eagel"),
        (["--data.speculative.threshold", "-3"], "data.speculative.threshold: threshold must be >= 1, got -3"),
        (["--trainer.max_steps"], "--trainer.max_steps: expected a value after it"),
        (["--model.init_args.config.epsilonn", "0.1"],
         "model.init_args.config.epsilonn: unknown option (did you mean epsilon?)"),
    ],
)
def test_each_config_error_is_one_keyed_line(
    config: Path, capsys: pytest.CaptureFixture[str], override: list[str], line: str
) -> None:
    assert main(["fit", "--config", str(config), *override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"lightning-tlt fit: error: {line}"]


def test_debug_shows_the_traceback(config: Path) -> None:
    with pytest.raises(ConfigError, match="learning_rate must be > 0"):
        main(["fit", "--config", str(config), "--model.init_args.config.learning_rate=-1", "--debug"])


def test_a_negative_number_is_a_value() -> None:
    assert negative_numbers_as_values(["--a", "-1e-4", "--b", "-3", "--c", "--d", "-.5", "-x"]) == [
        "--a=-1e-4", "--b=-3", "--c", "--d=-.5", "-x"]
    assert negative_numbers_as_values(["--a=1", "-2"]) == ["--a=1", "-2"]


def test_yaml_errors_name_the_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  max_steps: 3\n   accelerator: cpu\n")
    assert main(["fit", "--config", str(path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"lightning-tlt fit: error: --config: {path}:3:15: invalid YAML: mapping values are not allowed here")
    assert main(["fit", "--config", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--config: no such file: '{tmp_path / 'none.yaml'}'")


def test_a_gpu_asked_for_on_the_command_line_is_named_there(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["fit", "--config", str(config), "--trainer.accelerator", "gpu"]) == 2
    assert capsys.readouterr().err.strip() == (
        "lightning-tlt fit: error: trainer.accelerator: no GPU found (torch.cuda.is_available() is False), but the "
        "command line asks for one (--trainer.accelerator gpu); leave it out or give --trainer.accelerator cpu")


def test_own_data_mistakes_name_the_key(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fit", "--config", str(config), "--data.dataset", "missing.jsonl"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "lightning-tlt fit: error: data.dataset: no such file or directory: 'missing.jsonl'")
    assert main(["fit", "--config", str(config), "--data.reward_funcs", "[nowhere.rewards:f]"]) == 2
    assert capsys.readouterr().err.strip().startswith(
        "lightning-tlt fit: error: data.reward_funcs: reward function 'nowhere.rewards:f': no module named")


def test_summarize_a_nested_type_error() -> None:
    text = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'lightning_tlt.rl.common.RLModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'lightning_tlt.rl.ppo.PPOModule':
        Parser key "config":
          Does not validate against any of the Union subtypes
          Subtypes: [<class 'lightning_tlt.rl.config.PPOConfig'>, <class 'NoneType'>]
          Errors:
            - Problem with given class_path 'lightning_tlt.PPOConfig':
                Parser key "learning_rate":
                  Expected a <class 'float'>. Got value: abc
            - Expected a <class 'NoneType'>
          Given value type: <class 'jsonargparse._util.NestedArg'>
    - Expected a <class 'NoneType'>
  Given value: NestedArg(key='config.learning_rate', val='abc')"""
    err = summarize(text)
    assert (err.key, err.message) == ("model.init_args.config.learning_rate", "expected float, got abc")


def test_the_real_command_prints_one_line_and_no_usage(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-m", "lightning_tlt.cli", "fit", "--config", str(ROOT / "configs/ppo_cpu.yaml"),
         "--model.init_args.config.learning_rate", "-1e-4"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr and "usage:" not in out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "lightning-tlt fit: error: model.init_args.config.learning_rate: learning_rate must be > 0, got -0.0001")
