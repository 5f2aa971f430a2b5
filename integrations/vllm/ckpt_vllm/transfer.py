"""Kept import path (the flat layout's): the code lives in
:mod:`ckpt_vllm.weight_transfer.worker_engine`, the engine vLLM builds in each worker and the
``init_info`` it takes."""

from ckpt_vllm.weight_transfer.worker_engine import CkptInitInfo, CkptUpdateInfo, CkptWeightTransferEngine, settle

__all__ = ["CkptInitInfo", "CkptUpdateInfo", "CkptWeightTransferEngine", "settle"]
