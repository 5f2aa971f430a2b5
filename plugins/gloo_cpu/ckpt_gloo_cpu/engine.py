"""``GlooCpuCheckpointEngine``: refit between CPU processes over a dedicated Gloo group."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ckpt_core.errors import EngineOptionError
from ckpt_core.transport import TOPOLOGIES, BackendCapabilities, DistributedEngine, Option


def _host_device(option: Option, owner: str, device: Any) -> str:
    """The ``device`` option: only the host (``"cpu"``, ``"cpu:0"`` or such a ``torch.device``)."""
    parsed = None
    if isinstance(device, (str, torch.device)):
        try:
            parsed = torch.device(device)
        except RuntimeError:
            pass
    if parsed is None or parsed.type != "cpu" or parsed.index not in (None, 0):
        raise EngineOptionError(
            f"{owner}: device must be 'cpu', got {device!r}: gloo_cpu moves weights through host "
            "memory; for GPU buffers use the nccl backend (across GPUs) or cuda_ipc (processes "
            "sharing a GPU)"
        )
    return "cpu"


class GlooCpuCheckpointEngine(DistributedEngine):
    """Moves buckets between host buffers with Gloo; headers and payloads share one group.

    Its options are :class:`~ckpt_core.transport.torch_distributed.DistributedEngine`'s plus
    ``device`` (``"cpu"``, the only value: accepted because NeMo RL passes one), all listed at
    the end of this docstring.
    """

    backend_name: ClassVar[str] = "gloo_cpu"
    device_type: ClassVar[str] = "cpu"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cpu",),
        topologies=TOPOLOGIES,
        placements=("colocated", "disaggregated"),
    )
    options = DistributedEngine.options.extend(
        Option.custom(
            "device",
            "cpu",
            "where bucket buffers and received tensors live: host memory only (NeMo RL passes a "
            "device); for GPUs use nccl or cuda_ipc",
            parse=_host_device,
            kind="'cpu'",
        )
    )

    def _new_data_group(self, store: Any, rank: int, size: int) -> Any:
        return self._new_control_group(store, rank, size)
