"""How one bucket moves over NCCL, as thin wrappers around ckpt-core's distributed transport.

* :class:`PayloadGroup` moves every payload as a broadcast from the link's sender.
* :class:`NcclSender` queues the payload's NCCL send after the sender's device work.
* :class:`NcclReceiver` verifies each payload's device checksum when it lands.
* :func:`check_distinct_gpus` refuses a link with two members on one GPU before NCCL does.

Stream order, per bucket. Sender: the bucket is packed on the caller's current stream (or on
the pack stream, through :meth:`NcclSender.pack`), or a chunk that fills a bucket alone is
sent from the caller's tensor; the checksum and the NCCL send are queued after that (the pack
stream first waits for the caller's stream, and ProcessGroupNCCL's stream waits for the
stream current at the call); ``wait_slot`` blocks the thread until the send is complete, so
the slot can then be refilled, and the caller's tensor freed, on any stream.
Receiver: the NCCL receive waits for the caller's current stream (where the previous use of
the slot was copied out); ``wait_payload`` blocks the thread until it is complete and orders
the caller's stream after it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ckpt_core.errors import EngineOptionError, IntegrityError, WireFormatError
from ckpt_core.transport import BucketReceiver, BucketSender

from .cuda import PackStream

Checksum = Callable[[torch.Tensor], int]


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


class NcclSender(BucketSender):
    """Wraps the core's distributed sender: device work on the pack stream precedes each send."""

    def __init__(self, inner: BucketSender, stream: PackStream) -> None:
        self.inner = inner
        self.stream = stream
        self.num_slots = inner.num_slots
        self.accepts_external_payload = inner.accepts_external_payload

    def buffer(self, slot: int) -> torch.Tensor:
        return self.inner.buffer(slot)

    def pack(self, slot: int, offset: int, chunk: torch.Tensor) -> None:
        """Copy ``chunk`` into ``buffer(slot)`` at ``offset`` on the pack stream."""
        self.stream.pack(self.inner.buffer(slot)[offset : offset + chunk.numel()], chunk)

    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, payload: torch.Tensor | None = None
    ) -> None:
        """Queue the send after the pack stream, which first waits for the caller's stream:
        packing (wherever it ran) and a ``payload`` the caller produced precede the send."""
        self.stream.follow_caller()
        with self.stream.active():
            self.inner.post(slot, header, nbytes, timeout_s, payload=payload)

    def wait_slot(self, slot: int, timeout_s: float) -> None:
        self.inner.wait_slot(slot, timeout_s)

    def close(self) -> None:
        self.inner.close()


class NcclReceiver(BucketReceiver):
    """Wraps the core's distributed receiver; verifies device checksums as payloads land.

    ckpt-core's pipeline verifies checksums with its host-memory xxh3, which cannot read a
    GPU buffer, so this engine turns that off and checks the header's device checksum here,
    in ``wait_payload``, with the same function the sender used.
    """

    def __init__(self, inner: BucketReceiver, checksum: Checksum | None) -> None:
        self.inner = inner
        self.checksum = checksum
        self.num_slots = inner.num_slots
        self._announced: _Expected | None = None
        self._expected: list[_Expected | None] = [None] * inner.num_slots

    def buffer(self, slot: int) -> torch.Tensor:
        return self.inner.buffer(slot)

    def recv_header(self, timeout_s: float) -> bytes:
        raw = self.inner.recv_header(timeout_s)
        self._announced = _expected_checksum(raw) if self.checksum is not None else None
        return raw

    def post_payload(self, slot: int, nbytes: int, timeout_s: float) -> None:
        self.inner.post_payload(slot, nbytes, timeout_s)
        self._expected[slot], self._announced = self._announced, None

    def wait_payload(self, slot: int, timeout_s: float) -> None:
        self.inner.wait_payload(slot, timeout_s)
        expected, self._expected[slot] = self._expected[slot], None
        if expected is None or self.checksum is None:
            return
        actual = self.checksum(self.inner.buffer(slot)[: expected.nbytes])
        if actual != expected.digest:
            raise IntegrityError(
                f"bucket {expected.bucket} of refit {expected.refit} is corrupt: device payload "
                f"checksum {actual:#018x} != header's {expected.digest:#018x} "
                f"({expected.nbytes} bytes); the refit is void"
            )

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def close(self) -> None:
        self._expected = [None] * self.num_slots
        self.inner.close()


class _Expected:
    __slots__ = ("digest", "nbytes", "refit", "bucket")

    def __init__(self, digest: int, nbytes: int, refit: int, bucket: int) -> None:
        self.digest, self.nbytes, self.refit, self.bucket = digest, nbytes, refit, bucket


def _expected_checksum(raw: bytes) -> _Expected | None:
    """The checksum a header announces, or ``None`` (none sent, or a header the pipeline
    will refuse with a ``WireFormatError`` before the payload is waited for)."""
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    fields = [doc.get(name) for name in ("checksum", "nbytes", "refit", "bucket")]
    if not all(isinstance(value, int) and not isinstance(value, bool) and value >= 0 for value in fields):
        return None
    return _Expected(*fields)


def link_members(topology: str, role: str, rank: int, train_world_size: int, rollout_world_size: int) -> list[int]:
    """Indices into the metadata list of the workers on this worker's link (empty: no link).

    ``broadcast``: policy rank 0 and every rollout rank. ``paired``: policy rank ``i`` and
    rollout rank ``i``; a policy rank without a partner has no link.
    """
    rollouts = [train_world_size + r for r in range(rollout_world_size)]
    if topology == "broadcast":
        return [] if role == "policy" and rank != 0 else [0, *rollouts]
    if role == "policy" and rank >= rollout_world_size:
        return []
    return [rank, train_world_size + rank]


def check_distinct_gpus(owner: str, metadata: Sequence[dict[str, Any]], members: Sequence[int], train_world_size: int) -> None:
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
