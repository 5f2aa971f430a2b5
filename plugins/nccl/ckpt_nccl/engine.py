"""``NcclCheckpointEngine``: GPU refit over a dedicated NCCL group (skeleton)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ckpt_core.capabilities import BackendCapabilities
from ckpt_core.distributed import DistributedEngine
from ckpt_core.errors import BackendUnavailableError


class NcclCheckpointEngine(DistributedEngine):
    backend_name: ClassVar[str] = "nccl"
    device_type: ClassVar[str] = "cuda"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cuda",), topologies=("broadcast", "paired"), placements=("disaggregated",)
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.cuda.is_available():
            return "no CUDA device is visible (torch.cuda.is_available() is False)"
        return None

    def __init__(self, **options: Any) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"the nccl backend cannot run here: {reason}")
        super().__init__(**options)

    def _new_data_group(self, store: Any, rank: int, size: int) -> Any:
        raise NotImplementedError
