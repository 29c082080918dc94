"""Checksums of every tensor in a checkpoint: flipped bytes are an error at load, not a silent resume.

PyTorch's zip checkpoints are read without checking the archive's CRCs, so a few flipped bytes
inside a weight load silently (a weight of 0.01 read back as 355). `add_checksums` stores a CRC-32
of each tensor's raw bytes (with its dtype and shape) under `CHECKSUMS_KEY` when a checkpoint is
written, and `verify_checksums` recomputes them when it is read: a mismatch is a
`CheckpointCorruptError` naming the file and the first bad tensor. `load_checkpoint` also turns a
missing, empty, truncated or unreadable file into that error, in one line.

CRC-32 (``zlib.crc32``) runs at memory speed, about a second per few GB; it catches corruption, not
tampering. Checkpoints written before the checksums existed load unchecked.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_tlt.core.sharding import is_dtensor

__all__ = ["CHECKSUMS_KEY", "CheckpointCorruptError", "add_checksums", "load_checkpoint", "tensor_checksums",
           "verify_checksums"]

SHARDED_METADATA = "meta.pt"
"""What a sharded checkpoint's directory holds besides the shards (Lightning's ``_METADATA_FILENAME``)."""

CHECKSUMS_KEY = "lightning_tlt_checksums"
"""Where a checkpoint dict holds its tensors' checksums: ``{"algorithm": "crc32", "tensors": {path: crc}}``."""


class CheckpointCorruptError(ValueError):
    """A checkpoint that cannot be trusted: unreadable, truncated, or a tensor whose bytes changed since it was saved."""


def _tensors(node: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for every plain tensor under ``node``, through mappings, lists and tuples, in order."""
    if isinstance(node, torch.Tensor):
        # plain dense tensors only: a subclass (DTensor, ...) or a sparse, quantized or meta tensor has no flat bytes
        if type(node) in (torch.Tensor, torch.nn.Parameter) and node.layout == torch.strided and (
            not node.is_quantized and not node.is_meta
        ):
            yield path, node
    elif isinstance(node, Mapping):
        for key, value in node.items():
            if path or key != CHECKSUMS_KEY:
                yield from _tensors(value, f"{path}/{key}" if path else str(key))
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _tensors(value, f"{path}/{i}" if path else str(i))


def crc32(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's raw bytes, seeded with its dtype and shape."""
    seed = zlib.crc32(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    flat = tensor.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    data: Any = flat.contiguous().view(torch.uint8).numpy() if flat.numel() else b""
    return zlib.crc32(data, seed)


def tensor_checksums(checkpoint: Mapping[str, Any]) -> dict[str, int]:
    """The CRC-32 of every tensor in ``checkpoint`` by path (``"state_dict/policy.lm_head.weight"``)."""
    return {path: crc32(tensor) for path, tensor in _tensors(checkpoint, "")}


def add_checksums(checkpoint: dict[str, Any]) -> None:
    """Store the checksums of every tensor of ``checkpoint`` in it, under `CHECKSUMS_KEY`.

    A top-level entry that holds a sharded tensor (``DTensor``: the ``state_dict`` and
    ``optimizer_states`` of an FSDP2 policy) is left out: Lightning's distributed checkpoint writes it
    through ``torch.distributed.checkpoint``, one file per rank beside the checkpoint's metadata, not into
    the file these checksums are checked against.
    """
    kept = {key: value for key, value in checkpoint.items() if not _holds_sharded(value)}
    checkpoint[CHECKSUMS_KEY] = {"algorithm": "crc32", "tensors": tensor_checksums(kept)}


def _holds_sharded(node: Any) -> bool:
    if isinstance(node, torch.Tensor):
        return is_dtensor(node)
    if isinstance(node, Mapping):
        return any(_holds_sharded(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_holds_sharded(v) for v in node)
    return False


def verify_checksums(checkpoint: Mapping[str, Any], source: str | os.PathLike[str]) -> int:
    """Check every tensor of ``checkpoint`` against the checksums it was saved with.

    Args:
        checkpoint: a loaded checkpoint dict.
        source: the file it came from, for the message.

    Returns:
        How many tensors were checked (0 for a checkpoint saved without checksums).

    Raises:
        CheckpointCorruptError: a tensor's bytes differ from those saved, or a tensor is missing or new;
            the message names the file, the first bad tensor and how many are bad.
    """
    stored = checkpoint.get(CHECKSUMS_KEY)
    if not isinstance(stored, Mapping) or stored.get("algorithm") != "crc32":
        return 0
    expected: Mapping[str, int] = stored["tensors"]
    found = dict(_tensors(checkpoint, ""))
    bad = [path for path, tensor in found.items() if path in expected and crc32(tensor) != expected[path]]
    missing = [path for path in expected if path not in found]
    if bad or missing:
        first = bad[0] if bad else missing[0]
        what = "its bytes differ from those saved" if bad else "it is missing"
        count = len(bad) + len(missing)
        raise CheckpointCorruptError(
            f"{source}: checkpoint is corrupt: tensor {first!r} fails its checksum ({what})"
            f"{f'; {count} of {len(expected)} tensors are bad' if count > 1 else ''}; restore the file from a "
            "copy or resume from an earlier checkpoint"
        )
    return len(expected)


def load_checkpoint(path: str | os.PathLike[str], *, verify: bool = True) -> dict[str, Any]:
    """Load a checkpoint onto the CPU (memory-mapped where the format allows) and check its checksums.

    A sharded checkpoint (Lightning's distributed checkpoint of an FSDP2 policy: a directory of one
    ``torch.distributed.checkpoint`` file per rank, ``.metadata`` and ``meta.pt``) gives its ``meta.pt``:
    everything but the sharded weights and optimizer states, which the strategy loads itself.

    Raises:
        FileNotFoundError: no file at ``path`` (nor a sharded checkpoint's directory).
        CheckpointCorruptError: the file is empty, truncated or not a readable checkpoint, or a tensor
            fails its checksum (`verify_checksums`); one line naming the file.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / SHARDED_METADATA).is_file() or not (path / ".metadata").is_file():
            raise CheckpointCorruptError(
                f"{path}: a directory, but not a complete sharded checkpoint (it needs {SHARDED_METADATA} and "
                ".metadata beside one .distcp file per rank); resume from another checkpoint"
            )
        path = path / SHARDED_METADATA
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    if path.stat().st_size == 0:
        raise CheckpointCorruptError(f"{path}: checkpoint is empty (0 bytes); it was not written to the end")
    try:
        try:
            checkpoint = torch.load(str(path), map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):  # only the legacy (non-zip) format cannot be memory-mapped
                raise
            checkpoint = torch.load(str(path), map_location="cpu", weights_only=False)
    except Exception as err:  # truncated zip, corrupted pickle: whatever the unpickler raises
        detail = str(err).splitlines()[0] if str(err) else ""
        raise CheckpointCorruptError(
            f"{path}: not a readable checkpoint ({type(err).__name__}{f': {detail}' if detail else ''}); the file is "
            "truncated or corrupt: restore it from a copy or resume from an earlier checkpoint"
        ) from None
    if not isinstance(checkpoint, dict):
        raise CheckpointCorruptError(f"{path}: not a Lightning checkpoint (it holds a {type(checkpoint).__name__})")
    if verify:
        verify_checksums(checkpoint, path)
    return checkpoint
