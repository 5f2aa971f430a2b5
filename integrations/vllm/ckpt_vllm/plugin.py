"""vLLM's plug-in point for ckpt-vllm: the ``vllm.general_plugins`` entry point calls
:func:`register` in every vLLM process (front end, engine core, each worker).

It registers the weight-transfer backend ``"ckpt"`` with vLLM's two factories, by module path:
nothing of ckpt-core or of the transports is imported until a config selects the backend, so a
broken ckpt-core install never stops vLLM from starting; it is a clear error when, and only
when, ``"ckpt"`` is selected (:mod:`ckpt_vllm.transfer` fails to import, naming the cause).
"""

from __future__ import annotations

BACKEND_NAME = "ckpt"  # ckpt_vllm.transfer.BACKEND_NAME, spelt here so registering imports nothing


def register() -> None:
    """Make ``weight_transfer_config={"backend": "ckpt"}`` and ``CkptTrainerInitInfo`` known to
    vLLM. Idempotent: a name already registered (by an earlier call) is left as it is."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, class_name, module in (
        (WeightTransferEngineFactory, "CkptWeightTransferEngine", "ckpt_vllm.transfer"),
        (WeightTransferTrainerFactory, "CkptTrainerWeightTransferEngine", "ckpt_vllm.trainer"),
    ):
        if BACKEND_NAME not in factory._registry:  # vLLM refuses a second registration of a name
            factory.register_engine(BACKEND_NAME, module, class_name)
