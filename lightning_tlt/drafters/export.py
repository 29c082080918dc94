"""``lightning-tlt export-drafter``: write a co-trained drafter from a Lightning checkpoint as an EAGLE directory.

The checkpoint of a run with `lightning_tlt.callbacks.drafter_cotrain.DrafterCoTrainCallback` holds
the drafter's config and weights in the callback's state; this writes vLLM's EAGLE-1 layout
(`lightning_tlt.drafters.eagle.write_eagle_dir`) without loading the policy::

    lightning-tlt export-drafter --checkpoint_path runs/demo_cpu_eagle/version_0/checkpoints/last.ckpt \\
        --out_dir drafter/ [--which published|trained] [--overwrite] [--allow_nonfinite]

Load the result with ``vllm.LLM(target, speculative_config={"method": "eagle", "model": out_dir, ...})``
or ``EagleDrafter.from_pretrained(out_dir, policy)``. Weights holding NaN or inf (a diverged drafter) are
refused unless ``allow_nonfinite``.

Nothing but a previous export is ever replaced: the files are written into a fresh staging folder beside
``out_dir`` and swapped in by renames, with a marker file (`MARKER_NAME`: what was exported, from which
checkpoint, and each file's SHA-256). A non-empty ``out_dir`` is replaced only with ``overwrite``, and only
when it holds a previous export and nothing else; the filesystem root, the home folder, the current folder
and its parents are refused whatever ``overwrite`` says.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_tlt.core.checksums import load_checkpoint
from lightning_tlt.core.cli_options import OptionParser
from lightning_tlt.drafters.eagle import process_umask, write_eagle_dir

Which = Literal["published", "trained"]

DRAFTER_CONFIGS = ("configs/demo_cpu_eagle.yaml", "configs/grpo_gpu_100m.yaml", "configs/grpo_gpu_400m.yaml")
"""The shipped configs whose runs co-train a drafter (they hold `DrafterCoTrainCallback`)."""

MARKER_NAME = "lightning_tlt_export.json"
"""The marker file an export writes beside its weights; only a folder holding one is ever replaced."""
MARKER_FORMAT = "lightning_tlt.drafter_export"
"""The marker's ``format`` field (a JSON file of this name written by another tool is not a marker)."""
MARKER_VERSION = 1


def find_drafter_state(checkpoint: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ``(callback state key, state)`` of the drafter co-training callback in a checkpoint dict.

    Raises:
        ValueError: none, or more than one, callback state holds a drafter.
    """
    callbacks = checkpoint.get("callbacks") or {}
    found = [(str(k), v) for k, v in callbacks.items() if isinstance(v, Mapping) and "drafter_config" in v]
    if not found:
        names = sorted(str(k).split("{")[0] for k in callbacks)
        raise ValueError(
            f"the checkpoint holds no DrafterCoTrainCallback state (its callbacks: {names or 'none'}): its run "
            f"did not co-train a drafter; train with a config that does, e.g. {DRAFTER_CONFIGS[0]} on a CPU, "
            "and export that run's checkpoint"
        )
    if len(found) > 1:
        raise ValueError(
            f"the checkpoint holds {len(found)} DrafterCoTrainCallback states ({[k for k, _ in found]}); "
            "expected exactly one"
        )
    return found[0][0], dict(found[0][1])


def _nonfinite(weights: Mapping[str, Any]) -> dict[str, int]:
    """Per tensor name, how many entries are NaN or inf."""
    counts = {}
    for name, value in weights.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            bad = int((~torch.isfinite(value)).sum())
            if bad:
                counts[name] = bad
    return counts


def export_drafter(
    checkpoint_path: str | Path,
    out_dir: str | Path,
    *,
    which: Which = "published",
    overwrite: bool = False,
    allow_nonfinite: bool = False,
) -> Path:
    """Write the drafter stored in a Lightning checkpoint as an EAGLE draft directory.

    Args:
        checkpoint_path: a ``.ckpt`` written by a ``Trainer`` with `DrafterCoTrainCallback`.
        out_dir: the directory to write (``config.json`` and ``model.safetensors``).
        which: "published" (the version the engine last drafted with) or "trained" (the latest
            weights of the training copy).
        overwrite: replace ``out_dir`` if it holds a previous export (its marker file) and nothing else;
            without it a non-empty directory is refused. Never the root, home or current folder.
        allow_nonfinite: export weights holding NaN or inf (a diverged drafter) instead of refusing.

    Returns:
        ``out_dir``.

    Raises:
        FileNotFoundError: no checkpoint at ``checkpoint_path``.
        ValueError: the checkpoint is damaged (`lightning_tlt.core.checksums.CheckpointCorruptError`) or holds no drafter, ``out_dir`` may not be written (`check_out_dir`) or
            the weights are not finite (without ``allow_nonfinite``).
    """
    if which not in ("published", "trained"):
        raise ValueError(f"which must be 'published' or 'trained', got {which!r}")
    checkpoint_path, out = Path(checkpoint_path), Path(out_dir)
    if not checkpoint_path.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(checkpoint_path)!r}")
    check_out_dir(out, overwrite)
    checkpoint = load_checkpoint(checkpoint_path)  # a damaged file, or a tensor failing its checksum: one line
    try:
        _, state = find_drafter_state(checkpoint)
    except ValueError as err:
        raise ValueError(f"{checkpoint_path}: {err}") from None
    use_published = which == "published" and state.get("published") is not None
    weights = state["published"] if use_published else state["drafter"]
    bad = _nonfinite(weights)
    if bad and not allow_nonfinite:
        raise ValueError(
            f"the {'published' if use_published else 'trained'} drafter's weights hold {sum(bad.values())} NaN/inf "
            f"values (in {', '.join(sorted(bad))}): the drafter diverged; export the other copy "
            f"(which='{'trained' if use_published else 'published'}') or pass allow_nonfinite=True (--allow_nonfinite)"
        )
    # written beside out_dir, then swapped in: a failed export leaves the old directory as it was
    target = out.resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".staging", dir=target.parent))
    try:
        write_eagle_dir(staging, state["drafter_config"], weights, state.get("feature_layers"))
        _write_marker(staging, checkpoint_path, "published" if use_published else "trained")
        # ordinary permissions, as open() and mkdir() give (0644 and 0755 under umask 022): safetensors writes
        # 0600 and mkdtemp 0700, and an exported model is meant to be read by others (a vLLM server's user)
        umask = process_umask()
        for path in staging.iterdir():
            path.chmod(0o666 & ~umask)
        staging.chmod(0o777 & ~umask)
        _swap_in(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _protected(target: Path) -> str | None:
    """Why ``target`` (resolved) may never be replaced, or ``None``."""
    if target == target.parent:
        return "the filesystem root"
    if target == Path.home().resolve():
        return "the home folder"
    cwd = Path.cwd().resolve()
    if target == cwd:
        return "the current folder"
    if target in cwd.parents:
        return "a parent of the current folder"
    return None


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse an ``out_dir`` that an export may not write: one that is protected (`_protected`), a file, or a
    non-empty folder unless ``overwrite`` and it holds a previous export (its marker and the files the marker
    lists) and nothing else.

    Raises:
        ValueError: one line naming the folder and why.
    """
    target = out.resolve()
    why = _protected(target)
    if why is not None:
        raise ValueError(f"out_dir {str(out)!r} is {why} ({target}); export into a folder of its own, "
                         "e.g. --out_dir drafter/")
    if out.exists() and not out.is_dir():
        raise ValueError(f"out_dir {str(out)!r} is a file, not a directory")
    existing = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not existing:
        return
    shown = f"{', '.join(existing[:5])}{', ...' if len(existing) > 5 else ''}"
    if not overwrite:
        raise ValueError(f"out_dir {str(out)!r} is not empty ({shown}); pass overwrite=True (--overwrite) to "
                         "replace a previous export")
    listed = _marker_files(out)
    if listed is None:
        raise ValueError(f"out_dir {str(out)!r} holds files ({shown}) but no {MARKER_NAME} of a previous export; "
                         "--overwrite replaces only a previous export: choose an empty or new folder")
    others = sorted(set(existing) - set(listed) - {MARKER_NAME})
    if others:
        raise ValueError(f"out_dir {str(out)!r} holds a previous export and other files "
                         f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); --overwrite replaces only "
                         "a folder holding nothing but an export: move those files first")


def _marker_files(folder: Path) -> list[str] | None:
    """The files the export marker in ``folder`` lists, or ``None`` when there is no (readable) marker."""
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT or not isinstance(marker.get("files"), dict):
        return None
    return [str(name) for name in marker["files"]]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_marker(folder: Path, checkpoint_path: Path, which: str) -> None:
    """Write `MARKER_NAME` into ``folder``: what this is, its source, and each file's SHA-256."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        tlt_version = version("lightning_tlt")
    except PackageNotFoundError:
        tlt_version = "unknown"
    marker = {
        "format": MARKER_FORMAT,
        "format_version": MARKER_VERSION,
        "what": "EAGLE drafter co-trained by DrafterCoTrainCallback",
        "lightning_tlt_version": tlt_version,
        "checkpoint": str(checkpoint_path.resolve()),
        "which": which,
        "files": {p.name: {"sha256": _sha256(p)} for p in sorted(folder.iterdir()) if p.name != MARKER_NAME},
    }
    (folder / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")


def _swap_in(staging: Path, target: Path) -> None:
    """Put ``staging`` at ``target`` by renames; a previous export there is moved aside first and removed last,
    and put back if the swap fails."""
    old: Path | None = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
        old.rmdir()  # a free name beside target, for the rename
        target.rename(old)
    try:
        staging.rename(target)
    except OSError:
        if old is not None:
            old.rename(target)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-tlt export-drafter --checkpoint_path CKPT --out_dir DIR [--which ...] [--overwrite] [--allow_nonfinite]``."""
    parser = OptionParser(
        "lightning-tlt export-drafter",
        "Write the drafter co-trained in a Lightning run (DrafterCoTrainCallback) as a vLLM EAGLE draft directory "
        "(config.json, model.safetensors).",
    )
    parser.add_option("checkpoint_path", required=True, help="a Lightning .ckpt of a run with DrafterCoTrainCallback")
    parser.add_option("out_dir", required=True, help="directory to write the EAGLE draft to")
    parser.add_option("which", choices=["published", "trained"], default="published",
                      help="the copy the engine last drafted with (published) or the training copy (trained)")
    parser.add_option("overwrite", action="store_true", help="replace out_dir if it holds a previous export (and nothing else)")
    parser.add_option("allow_nonfinite", action="store_true",
                      help="export weights that hold NaN or inf (a diverged drafter)")
    args = parser.parse_args(argv)
    try:
        path = export_drafter(args.checkpoint_path, args.out_dir, which=args.which, overwrite=args.overwrite,
                              allow_nonfinite=args.allow_nonfinite)
    except (FileNotFoundError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote EAGLE drafter to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
