"""ckpt-nccl: the ``nccl`` transport of ckpt-core (GPU refit over NCCL)."""

from .engine import NcclCheckpointEngine

__all__ = ["NcclCheckpointEngine"]
