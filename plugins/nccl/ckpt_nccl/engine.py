"""``NcclCheckpointEngine``: GPU refit over a dedicated NCCL group per link.

Everything but two questions is ckpt-core's: the bucket pipeline, header format, topologies,
rendezvous store, Gloo control group for headers, lifecycle and option semantics are those
of :class:`ckpt_core.transport.torch_distributed.DistributedEngine` (the ``gloo_cpu`` backend runs the same
code on the host). This module answers how peers meet (a ``ProcessGroupNCCL`` built on the
link's prefixed store, each member on its own GPU) and how one buffer moves (an NCCL
broadcast from the link's sender, ordered after the sender's device work).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from ckpt_core.errors import BackendUnavailableError
from ckpt_core.transport import (
    BackendCapabilities,
    BucketReceiver,
    BucketSender,
    Checksum,
    DistributedEngine,
    DistributedSender,
    Link,
    device_payload_checksum,
)

from .cuda import CudaPlatform, PackStream, Platform, use_clean_up_only_mode
from .options import check_options
from .transport import NcclSender, PayloadGroup, check_distinct_gpus, link_members


class NcclCheckpointEngine(DistributedEngine):
    """Moves buckets between GPU buffers with NCCL; headers travel on a Gloo control group.

    Options: ``bucket_size`` (bytes; each side holds two buffers of it on its GPU),
    ``topology`` (``"broadcast"`` | ``"paired"``), ``host`` (address to bind and advertise,
    default ``127.0.0.1``; ``"auto"``: this node's own), ``timeout_s`` (every wait, default 300), ``checksum`` (a device
    checksum per bucket, verified on the receiving GPU; default on), ``device`` (``"cuda"``
    for the current CUDA device, or ``"cuda:N"``), ``release_after_refit`` (``finalize()`` also
    returns the freed buffer memory from torch's cache to the device, for an inference engine
    that sizes its KV cache from free memory; default off), ``shard_expert_weights`` (see
    :class:`~ckpt_core.transport.engine.BucketedEngine`), ``auth_token`` (shared secret checked at
    rendezvous, see :mod:`ckpt_core._internal.auth`).

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

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return cls.platform.unavailable_reason()

    def __init__(
        self,
        *,
        bucket_size: int,
        topology: str = "broadcast",
        host: str = "127.0.0.1",
        timeout_s: float = 300.0,
        checksum: bool = True,
        device: str = "cuda",
        release_after_refit: bool = False,
        shard_expert_weights: bool = False,
        borrow_received_tensors: bool = False,
        auth_token: str | None = None,
    ) -> None:
        owner = type(self).__name__
        options = check_options(
            owner,
            bucket_size=bucket_size,
            topology=topology,
            host=host,
            timeout_s=timeout_s,
            checksum=checksum,
            device=device,
            release_after_refit=release_after_refit,
            shard_expert_weights=shard_expert_weights,
            auth_token=auth_token,
        )
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(
                f"the nccl backend cannot run here: {reason}. It needs a CUDA build of torch "
                "with NCCL and a visible GPU; use the gloo_cpu backend for host-only workers."
            )
        self.device: torch.device = self.platform.resolve_device(owner, options.device_index)
        # Before this engine builds any NCCL group, and at most once per process.
        use_clean_up_only_mode()
        super().__init__(
            bucket_size=options.bucket_size,
            topology=options.topology,
            host=options.host,
            timeout_s=options.timeout_s,
            checksum=options.checksum,
            auth_token=auth_token,
            release_after_refit=options.release_after_refit,
            shard_expert_weights=options.shard_expert_weights,
            borrow_received_tensors=borrow_received_tensors,
        )
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
