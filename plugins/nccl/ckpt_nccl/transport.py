"""How one bucket moves over NCCL, as thin wrappers around ckpt-core's distributed transport.

* :class:`PayloadGroup` moves every payload as a broadcast from the link's sender.
* :class:`NcclSender` packs on a dedicated stream and queues each NCCL send after it.
* :func:`check_distinct_gpus` refuses a link with two members on one GPU before NCCL does.

Stream order, per bucket. Sender: small chunks are packed on the pack stream (through
:meth:`NcclSender.pack`) and large ones are sent from the caller's tensor (direct chunks); the
checksum and the NCCL sends are queued after that (the pack stream first waits for the
caller's stream, and ProcessGroupNCCL's stream waits for the stream current at the call);
``wait_slot`` blocks the thread until the send is complete, so
the slot can then be refilled, and the caller's tensor freed, on any stream.
Receiver: the NCCL receives (into the slot, and direct chunks into their output tensors) wait
for the caller's current stream (where the previous use of the slot was copied out);
``wait_payload`` blocks the thread until it is complete and orders
the caller's stream after it. The pipeline then verifies the payload's device checksum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ckpt_core.errors import EngineOptionError, WireFormatError
from ckpt_core.transport import DistributedSender, Link, Topology

from .cuda import PackStream


class PayloadGroup:
    """A link's payload group in which every payload is a broadcast from the sender.

    In a pair (topology ``"paired"``) a broadcast from rank 0 is the send to rank 1, so a
    send/recv becomes one: each link then uses the one communicator created at init, instead
    of NCCL opening another, point-to-point communicator on the first bucket.
    """

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def broadcast(self, tensor: torch.Tensor, root: int) -> Any:
        return self.backend.broadcast(tensor, root)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        self._check_pair(dst)
        return self.backend.broadcast(tensors[0], self.backend.rank())

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        self._check_pair(src)
        return self.backend.broadcast(tensors[0], src)

    def shutdown(self) -> None:
        """Abort the communicator: never waits for a peer, which may be gone."""
        self.backend.abort()

    def _check_pair(self, peer: int) -> None:
        size = self.backend.size()
        if size != 2 or peer == self.backend.rank():
            raise ValueError(f"send/recv on a payload group needs a pair, got peer {peer} in a group of {size}")


class NcclSender(DistributedSender):
    """The core's distributed sender, with device work on a pack stream ahead of each send."""

    def __init__(self, link: Link, bucket_size: int, device: torch.device, stream: PackStream) -> None:
        super().__init__(link, bucket_size, device)
        self.stream = stream

    def pack(self, slot: int, offset: int, chunk: torch.Tensor) -> None:
        """Copy ``chunk`` into ``buffer(slot)`` at ``offset`` on the pack stream."""
        self.stream.pack(self.buffer(slot)[offset : offset + chunk.numel()], chunk)

    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()
    ) -> None:
        """Queue the sends after the pack stream, which first waits for the caller's stream:
        packing (wherever it ran) and ``direct`` chunks the caller produced precede them."""
        self.stream.follow_caller()
        with self.stream.active():
            super().post(slot, header, nbytes, timeout_s, direct)


def link_members(
    topology: Topology | str, role: str, rank: int, train_world_size: int, rollout_world_size: int
) -> list[int]:
    """Indices into the metadata list of the workers on this worker's links (empty: none), as
    ``topology`` says who feeds whom: a feeding policy rank and its destinations, or a rollout
    rank, its source and (where they share one group) the source's other destinations."""
    topology = Topology.parse(topology)
    source = rank if role == "policy" else topology.source(rank)
    destinations = topology.destinations(source, train_world_size, rollout_world_size)
    if role == "rollout" and not topology.shares_link:
        destinations = [rank]
    if not destinations:
        return []
    return [source, *(train_world_size + destination for destination in destinations)]


def check_distinct_gpus(
    owner: str, metadata: Sequence[dict[str, Any]], members: Sequence[int], train_world_size: int
) -> None:
    """Refuse a link whose members share a GPU (NCCL cannot put two ranks of one communicator
    on one device); raises ``EngineOptionError`` naming both workers."""
    seen: dict[str, int] = {}
    for index in members:
        gpu = metadata[index].get("gpu_uuid")
        if not isinstance(gpu, str) or not gpu:
            raise WireFormatError(f"{owner}: metadata[{index}] has no 'gpu_uuid' string, got {gpu!r}")
        if gpu in seen:
            first, second = (_worker(i, train_world_size) for i in (seen[gpu], index))
            raise EngineOptionError(
                f"{owner}: {first} and {second} are on the same GPU ({gpu}, "
                f"{metadata[index].get('device')!r}); NCCL cannot connect two ranks on one device. "
                "Give each worker its own GPU (device='cuda:N' or CUDA_VISIBLE_DEVICES), or use the "
                "cuda_ipc backend for workers that share a GPU."
            )
        seen[gpu] = index


def _worker(index: int, train_world_size: int) -> str:
    if index < train_world_size:
        return f"policy rank {index}"
    return f"rollout rank {index - train_world_size}"
