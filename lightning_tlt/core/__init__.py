"""The bottom layer of the kit: value types, sampling, the KV cache, the functional model runner.

Nothing here imports another package of ``lightning_tlt``; every other package may import from
here (``tests/test_layers.py`` checks the direction of every import).
"""
