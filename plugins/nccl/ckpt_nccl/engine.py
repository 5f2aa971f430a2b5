"""``NcclCheckpointEngine``: GPU refit over a dedicated NCCL group per link.

Everything but two questions is ckpt-core's: the bucket pipeline, header format, topologies,
rendezvous store, Gloo control group for headers, lifecycle and option semantics are those
of :class:`ckpt_core.transport.torch_distributed.DistributedEngine` (the ``gloo_cpu`` backend runs the same
code on the host). This module answers how peers meet (a ``ProcessGroupNCCL`` built on the
link's prefixed store, each member on its own GPU) and how one buffer moves (an NCCL
broadcast from the link's sender, ordered after the sender's device work).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

import torch

from ckpt_core.errors import BackendUnavailableError, EngineOptionError
from ckpt_core.transport import (
    BackendCapabilities,
    BucketReceiver,
    BucketSender,
    Checksum,
    DistributedEngine,
    DistributedSender,
    Link,
    Option,
    Topology,
    device_payload_checksum,
)

from .cuda import CudaPlatform, PackStream, Platform, use_clean_up_only_mode
from .transport import NcclSender, PayloadGroup, check_distinct_gpus, link_members

NCCL_TOPOLOGIES = (Topology.BROADCAST.value, Topology.PAIRED.value)
"""DistributedEngine's topologies but ``"fanout"`` (a communicator per destination: not yet
tested on GPUs)."""

_CUDA_DEVICE = re.compile(r"cuda(?::(\d+))?")


def parse_device(owner: str, device: Any) -> int | None:
    """The CUDA device index named by ``device`` (``"cuda"`` -> ``None``: the current device
    at construction; ``"cuda:1"`` -> 1). Accepts ``"cuda"``, ``"cuda:N"`` and ``torch.device``
    objects of type ``cuda``; anything else is an ``EngineOptionError``. Needs no CUDA: whether
    ``cuda:N`` exists here is the platform's question, asked after every option is checked."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise EngineOptionError(
                f"{owner}: device must be a CUDA device ('cuda' or 'cuda:N'), got {device!r}: "
                "the nccl backend keeps its bucket buffers on a GPU"
            )
        return device.index
    if isinstance(device, str):
        match = _CUDA_DEVICE.fullmatch(device.strip())
        if match:
            return None if match.group(1) is None else int(match.group(1))
    raise EngineOptionError(
        f"{owner}: device must be 'cuda' (the current CUDA device) or 'cuda:N' with N >= 0, got {device!r}"
    )


def _device_option(option: Option, owner: str, device: Any) -> int | None:
    return parse_device(owner, device)


class NcclCheckpointEngine(DistributedEngine):
    """Moves buckets between GPU buffers with NCCL; headers travel on a Gloo control group.

    Its options are :class:`~ckpt_core.transport.torch_distributed.DistributedEngine`'s, with
    ``topology`` narrowed to ``"broadcast"`` and ``"paired"``, plus ``device``; all are listed at
    the end of this docstring and checked before CUDA is looked for, so a bad config is named
    as such on any machine. ``release_after_refit`` also returns the freed buffer memory from
    torch's cache to the device (for an inference engine that sizes its KV cache from free
    memory). ``checksum`` is off by default, as on every engine; on, each bucket carries a
    device checksum, verified on the receiving GPU.

    Checksums are :func:`ckpt_core._internal.device_checksum.device_payload_checksum` (computed on the
    GPU), not the core's host-memory xxh3.

    Constructing one sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=2`` in the process's environment,
    once (see :func:`ckpt_nccl.cuda.use_clean_up_only_mode`). Received tensors, borrowed or
    not, are ready on the CUDA stream that was current on the receiving thread when their
    batch was asked for; a consumer reading them on another stream must first make that stream
    wait for it, and a borrowing consumer must have queued every read of a borrowed tensor on
    that stream (or synchronized) before it asks for the next batch.
    """

    backend_name: ClassVar[str] = "nccl"
    device_type: ClassVar[str] = "cuda"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cuda",), topologies=("broadcast", "paired"), placements=("disaggregated",)
    )
    platform: ClassVar[Platform] = CudaPlatform()

    options = DistributedEngine.options.replace("topology", choices=NCCL_TOPOLOGIES).extend(
        Option.custom(
            "device",
            "cuda",
            'GPU of the bucket buffers: "cuda" (the current device at construction) or "cuda:N"',
            parse=_device_option,
            kind="'cuda' | 'cuda:N'",
        )
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return cls.platform.unavailable_reason()

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)  # every option checked, before CUDA is looked for
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(
                f"the nccl backend cannot run here: {reason}. It needs a CUDA build of torch "
                "with NCCL and a visible GPU; use the gloo_cpu backend for host-only workers."
            )
        self.device: torch.device = self.platform.resolve_device(type(self).__name__, self.option_values.device)
        # Before this engine builds any NCCL group, and at most once per process.
        use_clean_up_only_mode()
        self._pack_stream: PackStream | None = None

    # --- how peers meet ----------------------------------------------------------------

    def _prepare_transport(self) -> dict[str, Any]:
        identity = {"device": str(self.device), "gpu_uuid": self.platform.device_identity(self.device)}
        return {**super()._prepare_transport(), **identity}

    def _new_data_group(self, store: Any, rank: int, size: int) -> Any:
        backend = self.platform.new_group(store, rank, size, device=self.device, timeout_s=self.timeout_s)
        return PayloadGroup(backend)

    def _buffer_device(self) -> torch.device:
        return self.device

    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | dict[int, BucketSender] | None:
        self._check_link(metadata, "policy", worker_rank, train_world_size, rollout_world_size)
        return super()._connect_policy(worker_rank, train_world_size, rollout_world_size, metadata)

    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        self._check_link(metadata, "rollout", rollout_rank, train_world_size, rollout_world_size)
        return super()._connect_rollout(rollout_rank, train_world_size, rollout_world_size, metadata)

    def _new_sender(self, link: Link) -> DistributedSender:
        self._pack_stream = self.platform.new_pack_stream(self.device)
        return NcclSender(link, self.bucket_size, self.device, self._pack_stream)

    def _check_link(
        self, metadata: list[dict[str, Any]], role: str, rank: int, train_world_size: int, rollout_world_size: int
    ) -> None:
        self._check_topology(train_world_size, rollout_world_size)
        members = link_members(self.topology, role, rank, train_world_size, rollout_world_size)
        check_distinct_gpus(type(self).__name__, metadata, members, train_world_size)

    # --- how one buffer moves ----------------------------------------------------------

    def _payload_checksum(self) -> Checksum | None:
        if not self.checksum:
            return None
        stream = self._pack_stream
        if stream is None:  # a receiver: wait_payload already ordered the caller's stream
            return device_payload_checksum

        def on_pack_stream(payload: torch.Tensor) -> int:
            stream.follow_caller()  # after the packing, wherever it was queued
            with stream.active():
                return device_payload_checksum(payload)

        return on_pack_stream

    def _release_transport(self) -> None:
        try:
            super()._release_transport()
        finally:
            self._pack_stream = None

    def _release_cached_memory(self) -> None:
        super()._release_cached_memory()
        self.platform.release_cached_memory(self.device)
