"""ckpt-vllm: refit a running vLLM engine through any installed ckpt-core backend.

vLLM selects it by name: ``vllm serve --weight-transfer-config '{"backend": "ckpt"}'`` (or
``LLM(weight_transfer_config={"backend": "ckpt"})``), and a trainer refits it through vLLM's own
client with :class:`ckpt_vllm.trainer.CkptTrainerInitInfo`. A driver holding the ``LLM`` builds
it with ``LLM(..., **ckpt_vllm.VLLM_ENGINE_ARGS)`` and drives refits with
:class:`ckpt_vllm.VllmRollout` (or hands :class:`ckpt_vllm.VllmWorkerPool` to a
``RefitCoordinator``). Importing this package does not import vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Exports load on first use: vLLM imports ckpt_vllm.plugin in every process it starts, and that
# must work (and import nothing of ckpt-core) even where ckpt-core is broken.
_EXPORTS = {
    "AdapterError": "ckpt_vllm.errors",
    "VLLM_ENGINE_ARGS": "ckpt_vllm.rollout",
    "WORKER_EXTENSION": "ckpt_vllm.rollout",
    "IncompleteRefitError": "ckpt_vllm.errors",
    "RolloutLoadError": "ckpt_vllm.errors",
    "StaleWeightsError": "ckpt_vllm.errors",
    "VllmRollout": "ckpt_vllm.rollout",
    "VllmWorkerPool": "ckpt_vllm.pool",
    "WorkersFailedError": "ckpt_vllm.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from ckpt_vllm.errors import (
        AdapterError,
        IncompleteRefitError,
        RolloutLoadError,
        StaleWeightsError,
        WorkersFailedError,
    )
    from ckpt_vllm.pool import VllmWorkerPool
    from ckpt_vllm.rollout import VLLM_ENGINE_ARGS, WORKER_EXTENSION, VllmRollout


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
