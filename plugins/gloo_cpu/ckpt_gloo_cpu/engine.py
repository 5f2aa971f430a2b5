"""``GlooCpuCheckpointEngine``: refit between CPU processes over a dedicated Gloo group."""

from __future__ import annotations

from typing import Any, ClassVar

from ckpt_core.capabilities import BackendCapabilities
from ckpt_core.distributed import DistributedEngine


class GlooCpuCheckpointEngine(DistributedEngine):
    """Moves buckets between host buffers with Gloo; headers and payloads share one group.

    Options: ``bucket_size`` (bytes), ``topology`` (``"broadcast"`` | ``"paired"``), ``host``
    (address to bind and advertise, default ``127.0.0.1``), ``timeout_s`` (every wait, default
    300), ``checksum`` (default off: measured, not cheap). See :class:`ckpt_core.distributed.DistributedEngine`.
    """

    backend_name: ClassVar[str] = "gloo_cpu"
    device_type: ClassVar[str] = "cpu"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cpu",),
        topologies=("broadcast", "paired"),
        placements=("colocated", "disaggregated"),
    )

    def _new_data_group(self, store: Any, rank: int, size: int) -> Any:
        return self._new_control_group(store, rank, size)
