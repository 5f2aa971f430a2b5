"""Kept import path (the flat layout's): the code lives in
:mod:`ckpt_vllm.weight_transfer.trainer_engine`, the trainer's side. Importing either registers
the ``"ckpt"`` backend with vLLM's trainer factory."""

from ckpt_vllm.weight_transfer.trainer_engine import CkptTrainerInitInfo, CkptTrainerWeightTransferEngine, Weights

__all__ = ["CkptTrainerInitInfo", "CkptTrainerWeightTransferEngine", "Weights"]
