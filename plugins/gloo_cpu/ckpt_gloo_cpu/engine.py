"""``GlooCpuCheckpointEngine``: refit between CPU processes over a dedicated Gloo group."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ckpt_core.errors import EngineOptionError
from ckpt_core.transport import BackendCapabilities, DistributedEngine


class GlooCpuCheckpointEngine(DistributedEngine):
    """Moves buckets between host buffers with Gloo; headers and payloads share one group.

    Options: ``bucket_size`` (bytes), ``device`` (where the bucket buffers and received
    tensors live: ``"cpu"``, the only value; accepted because NeMo RL passes it), ``topology``
    (``"broadcast"`` | ``"paired"`` | ``"fanout"``), ``host`` (address to bind and advertise, default
    ``127.0.0.1``; ``"auto"``: this node's own), ``timeout_s`` (every wait, default 300), ``checksum`` (default off:
    measured, not cheap), ``auth_token``, ``release_after_refit``, ``shard_expert_weights``.
    See :class:`ckpt_core.transport.torch_distributed.DistributedEngine`.
    """

    backend_name: ClassVar[str] = "gloo_cpu"
    device_type: ClassVar[str] = "cpu"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cpu",),
        topologies=("broadcast", "paired", "fanout"),
        placements=("colocated", "disaggregated"),
    )

    def __init__(
        self,
        *,
        bucket_size: int,
        device: str = "cpu",
        topology: str = "broadcast",
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        checksum: bool = False,
        auth_token: str | None = None,
        release_after_refit: bool = False,
        shard_expert_weights: bool = False,
        borrow_received_tensors: bool = False,
    ) -> None:
        if not _is_host_device(device):
            raise EngineOptionError(
                f"{type(self).__name__}: device must be 'cpu', got {device!r}: gloo_cpu moves weights "
                "through host memory; for GPU buffers use the nccl backend (across GPUs) or cuda_ipc "
                "(processes sharing a GPU)"
            )
        super().__init__(
            bucket_size=bucket_size,
            topology=topology,
            host=host,
            timeout_s=timeout_s,
            checksum=checksum,
            auth_token=auth_token,
            release_after_refit=release_after_refit,
            shard_expert_weights=shard_expert_weights,
            borrow_received_tensors=borrow_received_tensors,
        )

    def _new_data_group(self, store: Any, rank: int, size: int) -> Any:
        return self._new_control_group(store, rank, size)


def _is_host_device(device: Any) -> bool:
    if not isinstance(device, (str, torch.device)):
        return False
    try:
        parsed = torch.device(device)
    except RuntimeError:
        return False
    return parsed.type == "cpu" and parsed.index in (None, 0)
