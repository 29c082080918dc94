"""Deprecated alias of `lightning_tlt.core.kv_cache` (moved to the core layer); kept for one release."""

import warnings

from lightning_tlt.core.kv_cache import *  # noqa: F401,F403
from lightning_tlt.core.kv_cache import __all__  # noqa: F401

warnings.warn("lightning_tlt.rollout.kv_cache moved to lightning_tlt.core.kv_cache", DeprecationWarning, stacklevel=2)
