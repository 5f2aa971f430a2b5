"""``CudaIpcCheckpointEngine``: colocated refit through mapped buffers (skeleton)."""

from __future__ import annotations

from typing import ClassVar

from ckpt_core.capabilities import BackendCapabilities
from ckpt_core.engine import BucketedEngine


class CudaIpcCheckpointEngine(BucketedEngine):
    backend_name: ClassVar[str] = "cuda_ipc"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cuda", "cpu"), topologies=("broadcast",), placements=("colocated",)
    )
