"""The ``"ckpt"`` weight-transfer backend that vLLM loads (:mod:`ckpt_vllm.plugin` registers
it by module path with vLLM's two factories).

* :mod:`~ckpt_vllm.weight_transfer.worker_engine`: the engine vLLM builds in each of its
  workers (``CkptWeightTransferEngine``) and what ``init_weight_transfer_engine`` takes
  (``CkptInitInfo``).
* :mod:`~ckpt_vllm.weight_transfer.trainer_engine`: the trainer's side, through vLLM's own
  clients (``CkptTrainerInitInfo``, ``CkptTrainerWeightTransferEngine``).
* :mod:`~ckpt_vllm.weight_transfer.extension`: the worker extension, for what vLLM's API does
  not say (metadata before init, reports, status, discard, adapters).
* :mod:`~ckpt_vllm.weight_transfer.heap`: how a worker keeps its heap within a refit's budget.

Importing this package imports nothing: its modules import vLLM and ckpt-core.
"""
