"""Deprecated alias of `lightning_tlt.rl.batch` (the datamodule/RL-module contract moved there); kept for one release."""

import warnings

from lightning_tlt.rl.batch import *  # noqa: F401,F403
from lightning_tlt.rl.batch import __all__  # noqa: F401

warnings.warn("lightning_tlt.data.batch moved to lightning_tlt.rl.batch", DeprecationWarning, stacklevel=2)
