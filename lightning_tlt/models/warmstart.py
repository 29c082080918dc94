"""Deprecated alias of `lightning_tlt.rl.warmstart` (it trains with the RL layer's SFT module); kept for one release."""

import warnings

from lightning_tlt.rl.warmstart import *  # noqa: F401,F403
from lightning_tlt.rl.warmstart import __all__  # noqa: F401

warnings.warn("lightning_tlt.models.warmstart moved to lightning_tlt.rl.warmstart", DeprecationWarning, stacklevel=2)
