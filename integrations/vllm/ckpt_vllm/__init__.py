"""ckpt-vllm: refit a running vLLM engine through any installed ckpt-core backend.

vLLM selects it by name: ``vllm serve --weight-transfer-config '{"backend": "ckpt"}'`` (or
``LLM(weight_transfer_config={"backend": "ckpt"})``), and a trainer refits it through vLLM's own
client with :class:`~ckpt_vllm.weight_transfer.trainer_engine.CkptTrainerInitInfo`. A driver
holding the ``LLM`` builds it with ``LLM(..., **ckpt_vllm.VLLM_ENGINE_ARGS)`` and drives refits
with :class:`ckpt_vllm.VllmRollout` (or hands :class:`ckpt_vllm.VllmWorkerPool` to a
``RefitCoordinator``). Importing this package does not import vLLM.

A package per concern:

* :mod:`ckpt_vllm.plugin`: vLLM's ``vllm.general_plugins`` entry point (imports nothing of
  ckpt-core); :mod:`ckpt_vllm.errors`: the adapter's errors.
* :mod:`ckpt_vllm.weight_transfer`: the ``"ckpt"`` weight-transfer backend vLLM loads: each
  worker's engine, the trainer's engine, the worker extension, the worker's heap guard.
* :mod:`ckpt_vllm.driver`: a driver holding the ``LLM`` (``VllmRollout``, ``VllmWorkerPool``).
* :mod:`ckpt_vllm.model`: reading and writing the live model: streaming weights into it, the
  layout and FP8 quantization derived from it, LoRA adapters served from memory.
* :mod:`ckpt_vllm.devtools`: a local ``vllm serve`` for trying refits, examples and tests.

``ckpt_vllm.transfer``, ``ckpt_vllm.trainer``, ``ckpt_vllm.extension`` and ``ckpt_vllm.serve``,
the paths of the flat layout before, still import: each re-exports its module's names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Exports load on first use: vLLM imports ckpt_vllm.plugin in every process it starts, and that
# must work (and import nothing of ckpt-core) even where ckpt-core is broken.
_EXPORTS = {
    "AdapterError": "ckpt_vllm.errors",
    "VLLM_ENGINE_ARGS": "ckpt_vllm.driver.rollout",
    "WORKER_EXTENSION": "ckpt_vllm.driver.rollout",
    "IncompleteRefitError": "ckpt_vllm.errors",
    "RolloutLoadError": "ckpt_vllm.errors",
    "StaleWeightsError": "ckpt_vllm.errors",
    "VllmRollout": "ckpt_vllm.driver.rollout",
    "VllmWorkerPool": "ckpt_vllm.driver.pool",
    "WorkersFailedError": "ckpt_vllm.errors",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from ckpt_vllm.driver.pool import VllmWorkerPool
    from ckpt_vllm.driver.rollout import VLLM_ENGINE_ARGS, WORKER_EXTENSION, VllmRollout
    from ckpt_vllm.errors import (
        AdapterError,
        IncompleteRefitError,
        RolloutLoadError,
        StaleWeightsError,
        WorkersFailedError,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_vllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
