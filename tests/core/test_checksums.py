"""`lightning_tlt.core.checksums`: every tensor's CRC-32 stored on save and checked on load; damaged files in one line."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

from lightning_tlt.core.checksums import (
    CHECKSUMS_KEY,
    CheckpointCorruptError,
    add_checksums,
    load_checkpoint,
    tensor_checksums,
    verify_checksums,
)


def checkpoint() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "state_dict": {"w": torch.randn(64, 64, generator=g) * 0.01, "b": torch.zeros(3, dtype=torch.bfloat16)},
        "optimizer_states": [{"state": {0: {"exp_avg": torch.randn(64, generator=g), "step": torch.tensor(3.0)}}}],
        "callbacks": {"Drafter{'k': 1}": {"mask": torch.tensor([True, False]), "count": 3}},
        "global_step": 7,
    }


def saved(path: Path) -> dict:
    """`checkpoint()` with its checksums, written to ``path``."""
    ckpt = checkpoint()
    add_checksums(ckpt)
    torch.save(ckpt, path)
    return ckpt


def flip_inside(path: Path, tensor: torch.Tensor, offset: int = 100) -> None:
    """Flip the bits of a few bytes in the middle of ``tensor``'s data, where it lies in the file."""
    data = bytearray(path.read_bytes())
    start = bytes(data).index(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    for i in range(start + offset, start + offset + 3):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_checksums_cover_every_tensor_by_path_and_round_trip(tmp_path: Path) -> None:
    ckpt = checkpoint()
    assert sorted(tensor_checksums(ckpt)) == [
        "callbacks/Drafter{'k': 1}/mask", "optimizer_states/0/state/0/exp_avg", "optimizer_states/0/state/0/step",
        "state_dict/b", "state_dict/w",
    ]
    add_checksums(ckpt)
    torch.save(ckpt, tmp_path / "a.ckpt")
    loaded = load_checkpoint(tmp_path / "a.ckpt")
    assert verify_checksums(loaded, "a.ckpt") == 5
    assert torch.equal(loaded["state_dict"]["w"], ckpt["state_dict"]["w"])
    # the dtype and shape are part of a tensor's checksum: the same bytes read as another shape fail
    loaded["state_dict"]["w"] = loaded["state_dict"]["w"].reshape(32, 128)
    with pytest.raises(CheckpointCorruptError, match=r"tensor 'state_dict/w' fails its checksum"):
        verify_checksums(loaded, "a.ckpt")


def test_flipped_bytes_inside_a_weight_name_the_file_and_the_tensor(tmp_path: Path) -> None:
    path = tmp_path / "run.ckpt"
    ckpt = saved(path)
    flip_inside(path, ckpt["state_dict"]["w"])
    unchecked = torch.load(path, weights_only=False)  # what torch.load alone gives: no error, wrong weights
    assert not torch.equal(unchecked["state_dict"]["w"], ckpt["state_dict"]["w"])
    with pytest.raises(CheckpointCorruptError) as err:
        load_checkpoint(path)
    assert str(err.value) == (
        f"{path}: checkpoint is corrupt: tensor 'state_dict/w' fails its checksum (its bytes differ from those "
        "saved); restore the file from a copy or resume from an earlier checkpoint"
    )


def test_a_missing_tensor_is_corrupt_too() -> None:
    ckpt = checkpoint()
    add_checksums(ckpt)
    del ckpt["optimizer_states"][0]["state"][0]["exp_avg"]
    with pytest.raises(CheckpointCorruptError, match=r"x.ckpt: .* tensor 'optimizer_states/0/state/0/exp_avg' fails "
                                                     r"its checksum \(it is missing\)"):
        verify_checksums(ckpt, "x.ckpt")


def test_empty_truncated_and_garbled_files_are_one_line(tmp_path: Path) -> None:
    good = tmp_path / "good.ckpt"
    saved(good)
    data = good.read_bytes()
    (tmp_path / "empty.ckpt").write_bytes(b"")
    (tmp_path / "half.ckpt").write_bytes(data[: len(data) // 2])
    (tmp_path / "pickle.ckpt").write_bytes(pickle.dumps({"a": 1})[:-3] + b"\x00\x01\x02")
    expected = {
        "empty.ckpt": "checkpoint is empty (0 bytes)",
        "half.ckpt": "not a readable checkpoint (",
        "pickle.ckpt": "not a readable checkpoint (",
    }
    for name, said in expected.items():
        with pytest.raises(CheckpointCorruptError) as err:
            load_checkpoint(tmp_path / name)
        message = str(err.value)
        assert message.startswith(f"{tmp_path / name}: {said}") and "\n" not in message, message
    with pytest.raises(FileNotFoundError, match="no checkpoint at '.*nope.ckpt'"):
        load_checkpoint(tmp_path / "nope.ckpt")


def test_a_checkpoint_saved_before_checksums_loads_unchecked(tmp_path: Path) -> None:
    ckpt = checkpoint()
    torch.save(ckpt, tmp_path / "old.ckpt")
    loaded = load_checkpoint(tmp_path / "old.ckpt")
    assert CHECKSUMS_KEY not in loaded and verify_checksums(loaded, "old.ckpt") == 0


def test_a_sharded_checkpoint_directory_is_read_through_its_metadata(tmp_path: Path) -> None:
    """Lightning's distributed checkpoint (FSDP2): a directory; its meta.pt holds what is not sharded, checked."""
    directory = tmp_path / "last.ckpt"
    directory.mkdir()
    meta = {k: v for k, v in checkpoint().items() if k not in ("state_dict", "optimizer_states")}
    add_checksums(meta)
    torch.save(meta, directory / "meta.pt")
    with pytest.raises(CheckpointCorruptError, match=r"last.ckpt: a directory, but not a complete sharded checkpoint"):
        load_checkpoint(directory)  # no .metadata: the shards were never finished
    (directory / ".metadata").write_bytes(b"x")
    loaded = load_checkpoint(directory)
    assert loaded["global_step"] == 7 and torch.equal(loaded["callbacks"]["Drafter{'k': 1}"]["mask"], meta["callbacks"]
                                                      ["Drafter{'k': 1}"]["mask"])  # fmt: skip
    meta["callbacks"]["Drafter{'k': 1}"]["mask"][0] = False  # a flipped byte after the checksums
    torch.save(meta, directory / "meta.pt")
    with pytest.raises(CheckpointCorruptError, match="meta.pt: checkpoint is corrupt"):
        load_checkpoint(directory)
