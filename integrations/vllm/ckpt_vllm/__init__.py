"""ckpt-vllm: refit a running vLLM engine through any installed ckpt-core backend.

vLLM selects it by name: ``vllm serve --weight-transfer-config '{"backend": "ckpt"}'`` (or
``LLM(weight_transfer_config={"backend": "ckpt"})``), and a trainer refits it through vLLM's own
client with :class:`ckpt_vllm.trainer.CkptTrainerInitInfo`. A driver holding the ``LLM`` builds
it with ``LLM(..., **ckpt_vllm.VLLM_ENGINE_ARGS)`` and drives refits with
:class:`ckpt_vllm.VllmRollout` (or hands :class:`ckpt_vllm.VllmWorkerPool` to a
``RefitCoordinator``). Importing this package does not import vLLM.
"""

from __future__ import annotations

from ckpt_vllm.errors import IncompleteRefitError, RolloutLoadError, StaleWeightsError
from ckpt_vllm.pool import VllmWorkerPool
from ckpt_vllm.rollout import VLLM_ENGINE_ARGS, WORKER_EXTENSION, VllmRollout

__all__ = [
    "VLLM_ENGINE_ARGS",
    "WORKER_EXTENSION",
    "IncompleteRefitError",
    "RolloutLoadError",
    "StaleWeightsError",
    "VllmRollout",
    "VllmWorkerPool",
]
