"""Deprecated alias of `lightning_tlt.tasks` (the tasks moved below the RL layer that warm-starts on them); kept for one release."""

import warnings

from lightning_tlt.tasks import *  # noqa: F401,F403
from lightning_tlt.tasks import __all__  # noqa: F401

warnings.warn("lightning_tlt.data.tasks moved to lightning_tlt.tasks", DeprecationWarning, stacklevel=2)
