"""``lightning-tlt export-drafter``: write a co-trained drafter from a Lightning checkpoint as an EAGLE directory.

The checkpoint of a run with `lightning_tlt.callbacks.drafter_cotrain.DrafterCoTrainCallback` holds
the drafter's config and weights in the callback's state; this writes vLLM's EAGLE-1 layout
(`lightning_tlt.drafters.eagle.write_eagle_dir`) without loading the policy. Load the result with
``vllm.LLM(target, speculative_config={"method": "eagle", "model": out_dir, ...})`` or
``EagleDrafter.from_pretrained(out_dir, policy)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_tlt.drafters.eagle import write_eagle_dir

Which = Literal["published", "trained"]


def find_drafter_state(checkpoint: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """The ``(callback state key, state)`` of the drafter co-training callback in a checkpoint dict.

    Raises:
        ValueError: none, or more than one, callback state holds a drafter.
    """
    callbacks = checkpoint.get("callbacks") or {}
    found = [(str(k), v) for k, v in callbacks.items() if isinstance(v, Mapping) and "drafter_config" in v]
    if len(found) != 1:
        raise ValueError(
            f"expected exactly one DrafterCoTrainCallback state in the checkpoint, found {len(found)} "
            f"among callbacks {sorted(map(str, callbacks))}"
        )
    return found[0][0], dict(found[0][1])


def export_drafter(checkpoint_path: str | Path, out_dir: str | Path, *, which: Which = "published") -> Path:
    """Write the drafter stored in a Lightning checkpoint as an EAGLE draft directory.

    Args:
        checkpoint_path: a ``.ckpt`` written by a ``Trainer`` with `DrafterCoTrainCallback`.
        out_dir: the directory to write (``config.json`` and ``model.safetensors``).
        which: "published" (the version the engine last drafted with) or "trained" (the latest
            weights of the training copy).

    Returns:
        ``out_dir``.
    """
    if which not in ("published", "trained"):
        raise ValueError(f"which must be 'published' or 'trained', got {which!r}")
    checkpoint = torch.load(str(checkpoint_path), map_location="cpu", weights_only=False)
    _, state = find_drafter_state(checkpoint)
    weights = (
        state["published"]
        if which == "published" and state.get("published") is not None
        else state["drafter"]
    )
    return write_eagle_dir(out_dir, state["drafter_config"], weights, state.get("feature_layers"))


def main(argv: Sequence[str] | None = None) -> int:
    """``lightning-tlt export-drafter CHECKPOINT OUT_DIR [--which published|trained]``."""
    parser = argparse.ArgumentParser(prog="lightning-tlt export-drafter", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a Lightning .ckpt of a run with DrafterCoTrainCallback")
    parser.add_argument("out_dir", help="directory to write the EAGLE draft to")
    parser.add_argument("--which", choices=["published", "trained"], default="published")
    args = parser.parse_args(argv)
    path = export_drafter(args.checkpoint, args.out_dir, which=args.which)
    print(f"wrote EAGLE drafter to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
