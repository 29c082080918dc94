"""``python -m benchmarks.e2e``: one call of the end-to-end benchmark."""

from .main import main

main()
