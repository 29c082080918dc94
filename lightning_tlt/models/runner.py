"""Deprecated alias of `lightning_tlt.core.runner` (moved to the core layer); kept for one release."""

import warnings

from lightning_tlt.core.runner import *  # noqa: F401,F403
from lightning_tlt.core.runner import __all__  # noqa: F401

warnings.warn("lightning_tlt.models.runner moved to lightning_tlt.core.runner", DeprecationWarning, stacklevel=2)
