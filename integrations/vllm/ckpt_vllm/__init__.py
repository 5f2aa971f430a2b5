"""ckpt-vllm: refit a running vLLM engine through any installed ckpt-core backend.

Build the engine with ``LLM(..., worker_extension_cls=ckpt_vllm.WORKER_EXTENSION)``, then drive
refits with :class:`ckpt_vllm.VllmRollout` (or hand :class:`ckpt_vllm.VllmWorkerPool` to a
``RefitCoordinator``). Importing this package does not import vLLM.
"""

from __future__ import annotations

from ckpt_vllm.errors import IncompleteRefitError, RolloutLoadError, StaleWeightsError
from ckpt_vllm.pool import VllmWorkerPool
from ckpt_vllm.rollout import WORKER_EXTENSION, VllmRollout

__all__ = [
    "WORKER_EXTENSION",
    "IncompleteRefitError",
    "RolloutLoadError",
    "StaleWeightsError",
    "VllmRollout",
    "VllmWorkerPool",
]
