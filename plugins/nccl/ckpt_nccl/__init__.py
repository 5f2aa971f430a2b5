"""ckpt-nccl: the ``nccl`` transport of ckpt-core."""

from .engine import NcclCheckpointEngine

__all__ = ["NcclCheckpointEngine"]
