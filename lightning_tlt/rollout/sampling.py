"""Deprecated alias of `lightning_tlt.core.sampling` (moved to the core layer); kept for one release."""

import warnings

from lightning_tlt.core.sampling import *  # noqa: F401,F403
from lightning_tlt.core.sampling import __all__  # noqa: F401

warnings.warn("lightning_tlt.rollout.sampling moved to lightning_tlt.core.sampling", DeprecationWarning, stacklevel=2)
