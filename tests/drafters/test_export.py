"""`export_drafter` / ``lightning-tlt export-drafter``: refusals in one line, --overwrite, NaN weights, permissions."""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import pytest
import torch
import yaml
from transformers import PreTrainedModel

from lightning_tlt.cli import main
from lightning_tlt.drafters.eagle import EagleDrafter
from lightning_tlt.drafters.export import DRAFTER_CONFIGS, export_drafter

ROOT = Path(__file__).parent.parent.parent


def write_checkpoint(path: Path, target: PreTrainedModel, *, nan: bool = False, with_drafter: bool = True) -> Path:
    """A checkpoint dict as Lightning writes it, the co-training callback's state in the layout it saves."""
    drafter = EagleDrafter.from_target(target, generator=torch.Generator().manual_seed(0))
    weights = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    published = {k: v.clone() for k, v in weights.items()}
    if nan:
        published["fc.weight"][0, :3] = math.nan
        published["layers.0.mlp.down_proj.weight"][1, 1] = math.inf
    callbacks: dict[str, object] = {"RolloutMetricsCallback": {"printed": 3}}
    if with_drafter:
        callbacks["DrafterCoTrainCallback{'stall_threshold': 16}"] = {
            "drafter": weights, "published": published, "drafter_config": drafter.config.to_dict(),
            "feature_layers": drafter.feature_layers,
        }
    torch.save({"state_dict": {}, "callbacks": callbacks}, path)
    return path


def test_a_checkpoint_without_a_drafter_names_the_configs_that_have_one(
    tmp_path: Path, tiny_qwen2: PreTrainedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2, with_drafter=False)
    assert main(["export-drafter", "--checkpoint_path", str(ckpt), "--out_dir", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"lightning-tlt export-drafter: error: {ckpt}: the checkpoint holds no DrafterCoTrainCallback state (its "
        "callbacks: ['RolloutMetricsCallback']): its run did not co-train a drafter; train with a config that does, "
        "e.g. configs/demo_cpu_eagle.yaml on a CPU, and export that run's checkpoint"
    )
    assert not (tmp_path / "out").exists()
    for config in DRAFTER_CONFIGS:  # the configs named do co-train a drafter
        callbacks = yaml.safe_load((ROOT / config).read_text())["trainer"]["callbacks"]
        assert any(c["class_path"].endswith("DrafterCoTrainCallback") for c in callbacks), config
    assert main(["export-drafter", "--checkpoint_path", str(tmp_path / "nope.ckpt"), "--out_dir", "x"]) == 2
    assert "no checkpoint at" in capsys.readouterr().err


def test_a_non_empty_directory_is_replaced_only_with_overwrite(
    tmp_path: Path, tiny_qwen2: PreTrainedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2)
    out = tmp_path / "drafter"
    out.mkdir()  # an empty folder is written into
    argv = ["export-drafter", "--checkpoint_path", str(ckpt), "--out_dir", str(out)]
    assert main(argv) == 0
    assert main(argv) == 2  # now it holds an export
    assert (f"out_dir {str(out)!r} is not empty (config.json, lightning_tlt_export.json, model.safetensors); pass "
            "overwrite=True (--overwrite) to replace a previous export") in capsys.readouterr().err
    (out / "model.safetensors").write_bytes(b"stale")
    assert main([*argv, "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "lightning_tlt_export.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() != b"stale"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".drafter.")]  # no staging directory left


def test_nonfinite_weights_are_refused_unless_asked(
    tmp_path: Path, tiny_qwen2: PreTrainedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2, nan=True)
    with pytest.raises(ValueError, match=r"the published drafter's weights hold 4 NaN/inf values \(in fc.weight, "
                                         r"layers.0.mlp.down_proj.weight\): the drafter diverged; export the other "
                                         r"copy \(which='trained'\) or pass allow_nonfinite=True"):
        export_drafter(ckpt, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    export_drafter(ckpt, tmp_path / "b", which="trained")  # the training copy is finite
    argv = ["export-drafter", "--checkpoint_path", str(ckpt), "--out_dir", str(tmp_path / "c"), "--allow_nonfinite"]
    assert main(argv) == 0 and (tmp_path / "c" / "model.safetensors").is_file()


def test_exported_files_get_ordinary_permissions(tmp_path: Path, tiny_qwen2: PreTrainedModel) -> None:
    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2)
    previous = os.umask(0o022)
    try:
        out = export_drafter(ckpt, tmp_path / "drafter")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644, "lightning_tlt_export.json": 0o644,
    }
    loaded = EagleDrafter.from_pretrained(out, tiny_qwen2)  # and it loads back
    saved = torch.load(ckpt, weights_only=False)["callbacks"]["DrafterCoTrainCallback{'stall_threshold': 16}"]
    for name, value in loaded.state_dict().items():
        if name in saved["published"]:
            assert torch.equal(value, saved["published"][name]), name


def test_the_module_docstring_shows_the_form_the_cli_takes() -> None:
    import lightning_tlt.drafters.export as export

    assert "lightning-tlt export-drafter --checkpoint_path " in (export.__doc__ or "")
    assert "--out_dir drafter/" in (export.__doc__ or "")


def test_an_export_carries_a_marker_with_each_files_checksum(tmp_path: Path, tiny_qwen2: PreTrainedModel) -> None:
    import hashlib
    import json

    from lightning_tlt.drafters.export import MARKER_NAME

    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2)
    out = export_drafter(ckpt, tmp_path / "drafter")
    marker = json.loads((out / MARKER_NAME).read_text())
    assert marker["format"] == "lightning_tlt.drafter_export" and marker["which"] == "published"
    assert marker["checkpoint"] == str(ckpt.resolve())
    assert marker["files"] == {
        name: {"sha256": hashlib.sha256((out / name).read_bytes()).hexdigest()}
        for name in ("config.json", "model.safetensors")
    }


@pytest.mark.parametrize("where", ["cwd", "parent_of_cwd", "home", "root"])
def test_protected_folders_are_refused_even_with_overwrite(
    where: str, tmp_path: Path, tiny_qwen2: PreTrainedModel, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2)
    work = tmp_path / "work" / "repo"
    work.mkdir(parents=True)
    (work / ".git").mkdir()
    (work / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(work if where == "home" else tmp_path / "elsewhere"))
    out_dir, why = {
        "cwd": (".", "the current folder"), "parent_of_cwd": ("..", "a parent of the current folder"),
        "home": (str(work), "the home folder"), "root": ("/", "the filesystem root"),
    }[where]
    assert main(["export-drafter", "--checkpoint_path", str(ckpt), "--out_dir", out_dir, "--overwrite"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"lightning-tlt export-drafter: error: out_dir {out_dir!r} is {why} (")
    assert line.endswith("export into a folder of its own, e.g. --out_dir drafter/")
    assert (work / ".git" / "HEAD").read_text() == "ref: refs/heads/main\n"  # nothing deleted
    assert sorted(p.name for p in work.iterdir()) == [".git"]  # and no staging folder left


def test_overwrite_replaces_only_a_folder_holding_nothing_but_a_previous_export(
    tmp_path: Path, tiny_qwen2: PreTrainedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_tlt.drafters.export import MARKER_NAME

    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2)
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")  # looks like a model folder, but no marker
    argv = ["export-drafter", "--checkpoint_path", str(ckpt), "--overwrite", "--out_dir"]
    assert main([*argv, str(foreign)]) == 2
    assert f"out_dir {str(foreign)!r} holds files (config.json) but no {MARKER_NAME} of a previous export" in (
        capsys.readouterr().err)
    assert (foreign / "config.json").read_text() == "{}"

    out = export_drafter(ckpt, tmp_path / "drafter")
    (out / "README.md").write_text("mine")  # a file the user put beside an export
    assert main([*argv, str(out)]) == 2
    assert "holds a previous export and other files (README.md)" in capsys.readouterr().err
    assert (out / "README.md").read_text() == "mine"
    (out / "README.md").unlink()
    before = (out / MARKER_NAME).stat().st_ino
    assert main([*argv, str(out)]) == 0  # a previous export alone is replaced
    assert sorted(p.name for p in out.iterdir()) == ["config.json", MARKER_NAME, "model.safetensors"]
    assert (out / MARKER_NAME).stat().st_ino != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "notes", "run.ckpt"]  # no staging, no old copy


def test_a_failed_export_leaves_the_previous_one_in_place(
    tmp_path: Path, tiny_qwen2: PreTrainedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    import lightning_tlt.drafters.export as export

    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2)
    out = export_drafter(ckpt, tmp_path / "drafter")
    files = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(export, "write_eagle_dir", broken)
    with pytest.raises(OSError, match="disk full"):
        export_drafter(ckpt, out, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter", "run.ckpt"]


def test_a_corrupt_checkpoint_is_refused_in_one_line(
    tmp_path: Path, tiny_qwen2: PreTrainedModel, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_tlt.core.checksums import add_checksums

    ckpt = write_checkpoint(tmp_path / "run.ckpt", tiny_qwen2)
    saved = torch.load(ckpt, weights_only=False)
    add_checksums(saved)
    torch.save(saved, ckpt)
    key = "DrafterCoTrainCallback{'stall_threshold': 16}"
    weight = saved["callbacks"][key]["drafter"]["fc.weight"]  # the published copy holds the same values: found first
    data = bytearray(ckpt.read_bytes())
    start = bytes(data).index(weight.numpy().tobytes())
    data[start + 8] ^= 0x7F
    ckpt.write_bytes(bytes(data))
    assert main(["export-drafter", "--checkpoint_path", str(ckpt), "--out_dir", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"lightning-tlt export-drafter: error: {ckpt}: checkpoint is corrupt: tensor "
                           f"{f'callbacks/{key}/drafter/fc.weight'!r} fails its checksum")
    assert not (tmp_path / "out").exists()
