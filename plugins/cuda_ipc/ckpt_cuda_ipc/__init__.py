"""ckpt-cuda-ipc: the ``cuda_ipc`` transport of ckpt-core."""

from .engine import CudaIpcCheckpointEngine

__all__ = ["CudaIpcCheckpointEngine"]
