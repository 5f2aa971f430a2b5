"""ckpt-gloo-cpu: the ``gloo_cpu`` transport of ckpt-core."""

from .engine import GlooCpuCheckpointEngine

__all__ = ["GlooCpuCheckpointEngine"]
