"""The two small interfaces a transport implements: how one bucket moves, on each side.

The refit pipeline (:mod:`ckpt_core._internal.pipeline`) owns everything else: splitting weights into
chunks, packing buckets, headers, checksums, double buffering, reassembly and hooks. A
transport owns its bucket buffers (``num_slots`` of them, each ``bucket_size`` bytes, allocated
once) and moves the first ``nbytes`` of a slot, with a header, to its peers.

Direct chunks: a transport that can send from any memory and receive into any memory (sockets,
Gloo, NCCL) sets ``direct_chunks`` on both its sides. The pipeline then moves each large chunk
as a message of its own, from the sender's tensor straight into the receiver's output tensor,
instead of copying it into a slot on one side and out of a slot on the other. A bucket's
messages are always: the header, the packed slot bytes (when there are any), then its direct
chunks in header order.

Bucket ``k`` of a refit always uses slot ``k % num_slots`` on both sides. Every blocking method
takes ``timeout_s`` and raises ``TransferTimeoutError`` past it, or ``PeerLostError`` as soon as
the transport sees its peer gone.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from ckpt_core._internal.host_alloc import copy_into
from ckpt_core.errors import OutOfMemoryError


def bucket_buffers(count: int, bucket_size: int, device: torch.device, *, frame_bytes: int = 0) -> list[torch.Tensor]:
    """``count`` 1-D ``uint8`` buffers of ``bucket_size`` bytes on ``device`` (each preceded
    by ``frame_bytes`` for a header frame), allocated now; ``OutOfMemoryError`` (naming the
    option to lower, and the bucket size as the caller set it) when they do not fit.

    Host buffers are touched here (zeroed), so their memory is resident from the start: a
    worker's RSS then shows what it holds between refits, and the first refit pays no page
    faults on them."""
    try:
        if device.type == "cpu":
            return [torch.zeros(frame_bytes + bucket_size, dtype=torch.uint8) for _ in range(count)]
        return [torch.empty(frame_bytes + bucket_size, dtype=torch.uint8, device=device) for _ in range(count)]
    except (RuntimeError, MemoryError) as exc:  # torch's allocators raise RuntimeError subclasses
        framed = f" (each after a {frame_bytes}-byte header frame)" if frame_bytes else ""
        raise OutOfMemoryError(
            f"cannot allocate {count} bucket buffers of {bucket_size} bytes{framed} on {device} "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); lower "
            "bucket_size_bytes or free memory"
        ) from exc


class BucketSender(abc.ABC):
    """Sender side: moves a packed slot and its header to every receiver of this sender."""

    num_slots: int = 2

    direct_chunks: bool = False
    """Whether ``post`` may be given ``direct`` chunks (see the module docstring)."""

    @abc.abstractmethod
    def buffer(self, slot: int) -> torch.Tensor:
        """The 1-D ``uint8`` buffer of ``slot``, packed by the pipeline."""

    def pack(self, slot: int, offset: int, chunk: torch.Tensor) -> None:
        """Copy ``chunk`` (1-D ``uint8``) into ``buffer(slot)`` at byte ``offset``.

        Override to pack elsewhere than the caller's stream (a device transport may queue the
        copy on its own CUDA stream); the copy must be ordered before the slot's ``post``.
        Unless overridden, the pipeline copies small chunks into a host buffer itself (the
        same bytes, without a call and its checks per chunk).
        """
        copy_into(self.buffer(slot), offset, chunk)

    @abc.abstractmethod
    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()
    ) -> None:
        """Start moving ``header``, ``buffer(slot)[:nbytes]``, then each of ``direct``; may
        return before they arrive.

        Headers reach each receiver in the order they were posted. ``direct`` (non-empty only
        if ``direct_chunks``) holds contiguous 1-D ``uint8`` tensors on the buffers' device,
        each its own message; the transport keeps references to them until
        ``wait_slot(slot)`` returns.
        """

    @abc.abstractmethod
    def wait_slot(self, slot: int, timeout_s: float) -> None:
        """Block until ``buffer(slot)`` may be overwritten (its last post has been delivered)."""

    def close(self) -> None:
        """Release buffers and connections. Idempotent."""


class BucketReceiver(abc.ABC):
    """Receiver side: takes headers and payloads from this receiver's sender."""

    num_slots: int = 2

    direct_chunks: bool = False
    """Whether ``post_payload`` may be given ``direct`` destinations (see the module docstring)."""

    payload_ready_with_header: bool = False
    """Whether a header arriving means its payload is already readable (the sender wrote it
    where the receiver reads it, as with shared memory, or sent it in the header's message);
    read once per refit, so a receiver may set it for itself. The pipeline then finishes each bucket
    as soon as it arrives, handing its slot back at once. Otherwise payloads move only once
    ``post_payload`` says where they go, and the pipeline posts bucket ``k`` before finishing
    bucket ``k - 1``, so the two overlap."""

    @abc.abstractmethod
    def buffer(self, slot: int) -> torch.Tensor:
        """The 1-D ``uint8`` buffer ``slot``'s payload lands in (or is mapped from)."""

    @abc.abstractmethod
    def recv_header(self, timeout_s: float) -> bytes:
        """Block for the next header's bytes."""

    def expect_header(self) -> None:
        """Another header will follow: a transport may start receiving it now, so it is there
        when the current bucket's bytes are. Called after ``post_payload`` of a bucket that is
        not the refit's last, never twice without a ``recv_header`` between. Default: nothing."""

    def expect_refit(self) -> None:
        """The next refit's first header (bucket 0, in slot 0) may come from now on: a transport
        may start receiving it, so that a sender that starts first moves its bytes while this
        side is still on its way to the receive. Called at the end of every refit that ended well
        (every slot released), never between a ``recv_header`` and the end of its refit; not at
        connect (a Gloo fanout pair's receive posted then was, in 2 of 35 runs under load, not
        matched until the rollout waited on it). Default: nothing."""

    @abc.abstractmethod
    def post_payload(self, slot: int, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()) -> None:
        """Start receiving the payload announced by the last header: ``nbytes`` into
        ``buffer(slot)``, then each direct chunk into its destination in ``direct`` (1-D
        ``uint8`` views of output tensors, in header order; non-empty only if ``direct_chunks``)."""

    @abc.abstractmethod
    def wait_payload(self, slot: int, timeout_s: float) -> None:
        """Block until ``buffer(slot)[:nbytes]`` and every direct destination hold their bytes."""

    def release(self, slot: int) -> None:
        """The pipeline is done reading ``buffer(slot)``: the sender may refill it."""

    def hand_over(self, slot: int, nbytes: int) -> bool:
        """Give the pipeline the memory of ``buffer(slot)`` for good, its first ``nbytes``
        received, and take new memory for the slot, before ``release(slot)``: the tensors the
        bucket completes are then views of it, with nothing copied out. ``False`` (the
        default): this transport cannot (a buffer shared with the sender, on a device, or
        registered with the network), and the pipeline copies the tensors out as usual.

        Asked only for a host bucket of small whole tensors, received owned (not borrowed). The
        transport must not touch the memory it handed over again; it stays alive as long as
        one of those tensors does, so pages resident past ``nbytes`` that no bucket wrote (a
        buffer zeroed at start) should go back to the system."""
        return False

    def close(self) -> None:
        """Release buffers and connections. Idempotent."""
