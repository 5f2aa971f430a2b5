"""vLLM's plug-in point for ckpt-vllm: the ``vllm.general_plugins`` entry point calls
:func:`register` in every vLLM process (front end, engine core, each worker).

It registers the weight-transfer backend ``"ckpt"`` with vLLM's two factories, by module path:
nothing of ckpt-core or of the transports is imported until a config selects the backend, so a
broken ckpt-core install never stops vLLM from starting; it is a clear error when, and only
when, ``"ckpt"`` is selected (:mod:`ckpt_vllm.weight_transfer.worker_engine` fails to import,
naming the cause). This module stays at the package's top, out of
:mod:`ckpt_vllm.weight_transfer`, because the entry point names its path
(``ckpt_vllm.plugin:register``) and the driver and tools read :data:`BACKEND_NAME` from it.
"""

from __future__ import annotations

BACKEND_NAME = "ckpt"
"""The name vLLM's ``weight_transfer_config`` selects ckpt-vllm's backend by (its one home:
registering must import nothing of ckpt-core)."""


def register() -> None:
    """Make ``weight_transfer_config={"backend": "ckpt"}`` and ``CkptTrainerInitInfo`` known to
    vLLM. Idempotent: a name already registered (by an earlier call) is left as it is."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, class_name, module in (
        (WeightTransferEngineFactory, "CkptWeightTransferEngine", "ckpt_vllm.weight_transfer.worker_engine"),
        (WeightTransferTrainerFactory, "CkptTrainerWeightTransferEngine", "ckpt_vllm.weight_transfer.trainer_engine"),
    ):
        if BACKEND_NAME not in factory._registry:  # vLLM refuses a second registration of a name
            factory.register_engine(BACKEND_NAME, module, class_name)


def require_ckpt_core() -> None:
    """Import ckpt-core, or fail with an ``ImportError`` that says what is broken and how to
    repair it (what a config that selects ``"ckpt"`` sees on an install without a working
    ckpt-core, instead of a bare ``No module named ...`` deep in vLLM's start-up)."""
    try:
        import ckpt_core.registry  # noqa: F401 - the import is the check
    except ImportError as exc:
        raise ImportError(
            f"vLLM's weight-transfer backend '{BACKEND_NAME}' (ckpt-vllm) cannot import ckpt-core: {exc}. "
            "Install ckpt-core beside vLLM with a transport (pip install ckpt-core ckpt-gloo-cpu, or ckpt-nccl, "
            "ckpt-cuda-ipc), or select another weight_transfer_config backend"
        ) from exc
