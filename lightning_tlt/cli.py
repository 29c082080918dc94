"""The ``lightning-tlt`` command (the LightningCLI arrives with the RL modules)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    print("lightning-tlt: fit | validate | warmstart | export-drafter (see README.md)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
