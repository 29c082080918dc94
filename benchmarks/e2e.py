"""``python benchmarks/e2e.py``: the end-to-end benchmark's old command, kept; the code is the package
``benchmarks/e2e/`` (``python -m benchmarks.e2e``), which this directory's ``import e2e`` finds first."""

from e2e import main

if __name__ == "__main__":
    main()
