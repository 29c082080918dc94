"""The vLLM backend, where users look for it: `lightning_tlt.rollout.vllm_engine` and the engine factory.

The engine itself is a rollout backend (it lives in ``rollout/``, below the data and RL layers that
use it); this module re-exports its public names and `lightning_tlt.rollout.factory.make_engine`.
"""

from lightning_tlt.rollout.factory import make_engine  # noqa: F401
from lightning_tlt.rollout.vllm_engine import *  # noqa: F401,F403
