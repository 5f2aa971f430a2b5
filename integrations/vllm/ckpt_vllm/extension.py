"""Kept import path (the flat layout's, and a ``--worker-extension-cls`` given by name): the code
lives in :mod:`ckpt_vllm.weight_transfer.extension`, the worker extension."""

from ckpt_vllm.weight_transfer.extension import CkptEngineWorkerExtension

__all__ = ["CkptEngineWorkerExtension"]
