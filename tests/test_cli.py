"""The `lightning-tlt` command: LightningCLI fit/validate from YAML, every shipped config parses, helpers dispatch."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from lightning_tlt import cli
from lightning_tlt.cli import SUBCOMMANDS, main
from lightning_tlt.trainer_cli import CPU_CONFIGS

ROOT = Path(__file__).parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


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
    assert printed["data"]["dataset"] in ("arithmetic", "countdown", "countdown_search")


@pytest.mark.parametrize("config", [c for c in CONFIGS if "cpu" in c.name], ids=lambda c: c.name)
def test_cpu_configs_are_deterministic(config: Path) -> None:
    """Every CPU config's speculation and drafter pacing decide from counts, never from the clock (issue 35)."""
    raw = yaml.safe_load(config.read_text())
    spec = raw["data"].get("speculative")
    if spec is not None and spec.get("method", "none") != "none":
        assert spec.get("deterministic") is True, config.name
    for cb in raw["trainer"].get("callbacks", []):
        if cb["class_path"].endswith("DrafterCoTrainCallback"):
            assert cb["init_args"]["config"].get("deterministic") is True, config.name


def test_bad_yaml_configuration_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny_config(tmp_path, loss_type="ppo")
    assert main(["fit", "--config", str(path)]) == 2
    # refused while parsing the YAML (the Literal type): one line naming the key, the value and the choices
    assert capsys.readouterr().err.strip() == (
        "lightning-tlt fit: error: model.init_args.config.loss_type: expected one of 'grpo', 'bnpo', 'dr_grpo', "
        "'dapo', got ppo")


def test_helper_subcommands_dispatch_before_lightningcli(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("LIGHTNING_TLT_CACHE", str(tmp_path))
    assert list(SUBCOMMANDS) == ["fit", "validate", "warmstart", "export-drafter", "train-drafter"]
    assert main(["warmstart", "--help"]) == 0
    assert "lightning-tlt warmstart" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["fit", "warmstart", "export-drafter", "train-drafter"])
def test_help_is_cached_fast_and_shows_defaults(tmp_path: Path, command: str) -> None:
    env = {**os.environ, "LIGHTNING_TLT_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT), "COLUMNS": "100"}
    argv = [sys.executable, "-m", "lightning_tlt.cli", command, "--help"]
    first = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    start = time.perf_counter()
    again = subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout
    seconds = time.perf_counter() - start
    assert again == first and f"lightning-tlt {'[options] ' if command == 'fit' else ''}{command}" in first
    assert seconds < 2.0, f"{command} --help took {seconds:.2f} s from the cache"
    assert "(default: " in first or "default: " in first  # argparse: "(default: x)"; jsonargparse: "(type: ..., default: x)"
    expected = {"fit": "--trainer.max_steps MAX_STEPS", "warmstart": "--batch_size BATCH_SIZE, --batch-size",
                "export-drafter": "--out_dir OUT_DIR, --out-dir OUT_DIR", "train-drafter": "--out_dir OUT_DIR, --out-dir"}
    assert expected[command] in first  # one option style: underscores, as LightningCLI's (hyphens accepted)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["warmstart", "--task", "countdwn"], "lightning-tlt warmstart: error: --task/--difficulty: unknown task "
         "'countdwn'; registered tasks: ['arithmetic', 'countdown', 'countdown_search']"),
        (["warmstart", "--batch", "3"], "lightning-tlt warmstart: error: --batch: unknown option (options are not "
         "abbreviated; see --help)"),
        (["export-drafter", "--checkpoint-path", "none.ckpt", "--out_dir", "d"],
         "lightning-tlt export-drafter: error: no checkpoint at 'none.ckpt'"),
        (["train-drafter", "--out_dir", "d", "--difficulty", "9"], "lightning-tlt train-drafter: error: "
         "--task/--difficulty: arithmetic: difficulty must be an int in [1, 5], got 9"),
    ],
)
def test_helper_subcommand_errors_are_one_line(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exit_info:  # argparse's own checks exit; the commands' checks return
        code = int(exit_info.code or 0)
    assert code == 2
    assert capsys.readouterr().err.strip() == line  # no usage block: --help has it


def test_help_is_one_plain_usage_block_and_imports_nothing_heavy() -> None:
    # a fresh interpreter: `lightning-tlt --help` must not pay for importing Lightning or torch
    code = (
        "import sys; from lightning_tlt.cli import main; rc = main(['--help']); "
        "print('HEAVY', sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules)); "
        "raise SystemExit(rc)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.count("usage:") == 1 and "``" not in out and "LightningCLI's args" not in out
    assert "HEAVY []" in out
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in out


def test_unknown_command_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["test", "--help"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "lightning-tlt: error: unknown command 'test'"


def test_a_subcommand_is_a_registered_function(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "SUBCOMMANDS", dict(SUBCOMMANDS))
    seen: list[list[str]] = []

    @cli.subcommand("echo", "repeat the arguments")
    def _echo(argv: list[str]) -> int:
        seen.append(argv)
        return 7

    assert main(["echo", "a", "--b"]) == 7 and seen == [["a", "--b"]]
    assert "  echo            repeat the arguments" in cli.usage()
    with pytest.raises(ValueError, match="'echo' is registered twice"):
        cli.subcommand("echo", "again")(_echo)


def test_no_lightningcli_args_warning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny_config(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-tlt", "fit", "--config", str(path), "--print_config"])
    with warnings.catch_warnings(record=True) as caught, pytest.raises(SystemExit):
        warnings.simplefilter("always")
        main()
    assert not [w for w in caught if "args parameter" in str(w.message)]


def test_gpu_config_without_a_gpu_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    config = str(Path(__file__).parent.parent / "configs" / "grpo_gpu_100m.yaml")
    assert main(["fit", "--config", config]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"lightning-tlt fit: error: trainer.accelerator: no GPU found (torch.cuda.is_available() is False), but "
        f"{config} asks for one "
        "(trainer.accelerator=gpu, warm_start.device=cuda); on a CPU run configs/demo_cpu.yaml or "
        "configs/demo_cpu_eagle.yaml or configs/ppo_cpu.yaml"
    )
    for cpu_config in CPU_CONFIGS:  # the configs it names exist and run on the CPU
        assert yaml.safe_load((Path(__file__).parent.parent / cpu_config).read_text())["trainer"]["accelerator"] == "cpu"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--data.dataset", "arithmetik"], "data.dataset: unknown task 'arithmetik'; registered tasks: ['arithmetic', "
         "'countdown', 'countdown_search'] (or give a .json/.jsonl/.parquet/.csv file, a datasets.save_to_disk "
         "directory or an owner/name dataset in the local HF cache)"),
        (["--data.difficulty", "9"], "data.difficulty: arithmetic: difficulty must be an int in [1, 5], got 9"),
        (["--model.init_args.policy.size", "huge"],
         "model.init_args.policy.size: size must be one of ['tiny', 'small', '100m', '400m', '0.5b'], got 'huge'"),
        (["--model.init_args.config.max_completion_length", "5000"],
         "model.init_args.config.max_completion_length: max_completion_length=5000 leaves no room for a prompt in the policy's 4096 "
         "positions (config.max_position_embeddings); max_completion_length must be < 4096"),
    ],
)
def test_bad_names_and_sizes_are_refused_before_the_warm_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, override: list[str],
    message: str,
) -> None:
    def no_warm_start(*args: object, **kwargs: object) -> None:
        raise AssertionError("the warm start ran before the config was checked")

    monkeypatch.setattr("lightning_tlt.rl.warmstart.warm_start", no_warm_start)
    path = tiny_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["model"]["init_args"]["policy"]["warm_start"] = "arithmetic"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path), *override]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"lightning-tlt fit: error: {message}"


def test_a_damaged_or_missing_ckpt_path_is_one_line_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = yaml.safe_load(tiny_config(tmp_path).read_text())
    config["trainer"].update(enable_checkpointing=True, max_steps=1)
    path = tmp_path / "ckpt.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path)]) == 0
    (ckpt,) = tmp_path.glob("cli/version_0/checkpoints/*.ckpt")
    saved = torch.load(ckpt, weights_only=False)
    assert len(saved["lightning_tlt_checksums"]["tensors"]) > 20  # policy, AdamW moments, loops, callbacks
    name = "policy.model.embed_tokens.weight"
    data = bytearray(ckpt.read_bytes())
    start = bytes(data).index(saved["state_dict"][name].numpy().tobytes())
    data[start + 1000 : start + 1003] = bytes(b ^ 0xFF for b in data[start + 1000 : start + 1003])
    corrupt = tmp_path / "corrupt.ckpt"
    corrupt.write_bytes(bytes(data))
    (tmp_path / "truncated.ckpt").write_bytes(ckpt.read_bytes()[:5000])
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    expected = {
        corrupt: f"ckpt_path: {corrupt}: checkpoint is corrupt: tensor 'state_dict/{name}' fails its checksum",
        tmp_path / "truncated.ckpt": f"ckpt_path: {tmp_path / 'truncated.ckpt'}: not a readable checkpoint (",
        tmp_path / "missing.ckpt": f"ckpt_path: no checkpoint at '{tmp_path / 'missing.ckpt'}'",
    }
    for bad, said in expected.items():
        assert main(["fit", "--config", str(path), "--ckpt_path", str(bad)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"lightning-tlt fit: error: {said}"), line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written, no run started


def test_trainer_fit_refuses_a_corrupt_checkpoint_before_loading_a_weight(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    from lightning_tlt.core.checksums import CheckpointCorruptError
    from lightning_tlt.data.datamodule import RolloutDataModule
    from lightning_tlt.models.zoo import build_model
    from lightning_tlt.rl.grpo import GRPOModule

    def build() -> tuple[GRPOModule, RolloutDataModule, pl.Trainer]:
        module = GRPOModule(build_model("qwen2", "tiny", seed=0), {"num_generations": 2, "max_completion_length": 4})
        data = RolloutDataModule("arithmetic", prompts_per_step=2, task_size=8, eval_size=2)
        trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=tmp_path)
        return module, data, trainer

    module, data, trainer = build()
    trainer.fit(module, data)
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    raw = bytearray(ckpt.read_bytes())
    weight = saved["state_dict"]["policy.lm_head.weight"]
    start = bytes(raw).index(weight.numpy().tobytes())
    raw[start + 40] ^= 0x40
    ckpt.write_bytes(bytes(raw))
    module, data, trainer = build()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(CheckpointCorruptError, match=rf"^{ckpt}: checkpoint is corrupt: tensor "
                                                     r"'state_dict/policy.lm_head.weight' fails its checksum"):
        trainer.fit(module, data, ckpt_path=ckpt)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # not one weight loaded


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_every_shipped_config_keeps_last_ckpt_and_checkpoints_on_interrupt(config: Path) -> None:
    callbacks = {c["class_path"]: c.get("init_args", {}) for c in yaml.safe_load(config.read_text())["trainer"]["callbacks"]}
    assert "lightning_tlt.callbacks.interrupt_checkpoint.InterruptCheckpoint" in callbacks
    cadence = callbacks["lightning.pytorch.callbacks.ModelCheckpoint"]
    assert cadence["save_last"] is True and 1 <= cadence["every_n_train_steps"] <= 10
