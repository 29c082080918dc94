"""Deprecated alias of `lightning_tlt.core.types` (moved to the core layer); kept for one release."""

import warnings

from lightning_tlt.core.types import *  # noqa: F401,F403
from lightning_tlt.core.types import __all__  # noqa: F401

warnings.warn("lightning_tlt.rollout.types moved to lightning_tlt.core.types", DeprecationWarning, stacklevel=2)
