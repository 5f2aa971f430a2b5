"""The two small interfaces a transport implements: how one bucket moves, on each side.

The refit pipeline (:mod:`ckpt_core.pipeline`) owns everything else: splitting weights into
chunks, packing buckets, headers, checksums, double buffering, reassembly and hooks. A
transport owns its bucket buffers (``num_slots`` of them, each ``bucket_size`` bytes, allocated
once) and moves the first ``nbytes`` of a slot, with a header, to its peers.

Bucket ``k`` of a refit always uses slot ``k % num_slots`` on both sides. Every blocking method
takes ``timeout_s`` and raises ``TransferTimeoutError`` past it, or ``PeerLostError`` as soon as
the transport sees its peer gone.
"""

from __future__ import annotations

import abc

import torch


class BucketSender(abc.ABC):
    """Sender side: moves a packed slot and its header to every receiver of this sender."""

    num_slots: int = 2

    accepts_external_payload: bool = False
    """Whether ``post`` may be given a ``payload`` outside the slot buffers. Transports that
    can send from any memory (sockets, Gloo, NCCL) set it, and the pipeline then sends a chunk
    that fills a whole bucket straight from the source tensor, skipping the packing copy."""

    @abc.abstractmethod
    def buffer(self, slot: int) -> torch.Tensor:
        """The 1-D ``uint8`` buffer of ``slot``, packed by the pipeline."""

    def pack(self, slot: int, offset: int, chunk: torch.Tensor) -> None:
        """Copy ``chunk`` (1-D ``uint8``) into ``buffer(slot)`` at byte ``offset``.

        Override to pack elsewhere than the caller's stream (a device transport may queue the
        copy on its own CUDA stream); the copy must be ordered before the slot's ``post``.
        """
        self.buffer(slot)[offset : offset + chunk.numel()].copy_(chunk)

    @abc.abstractmethod
    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, payload: torch.Tensor | None = None
    ) -> None:
        """Start moving ``header`` and ``buffer(slot)[:nbytes]``; may return before they arrive.

        Headers reach each receiver in the order they were posted. When ``payload`` is given
        (only if ``accepts_external_payload``), it is a contiguous ``uint8`` tensor of
        ``nbytes`` on the buffers' device to send instead of the slot's bytes; the transport
        keeps a reference to it until ``wait_slot(slot)`` returns.
        """

    @abc.abstractmethod
    def wait_slot(self, slot: int, timeout_s: float) -> None:
        """Block until ``buffer(slot)`` may be overwritten (its last post has been delivered)."""

    def close(self) -> None:
        """Release buffers and connections. Idempotent."""


class BucketReceiver(abc.ABC):
    """Receiver side: takes headers and payloads from this receiver's sender."""

    num_slots: int = 2

    @abc.abstractmethod
    def buffer(self, slot: int) -> torch.Tensor:
        """The 1-D ``uint8`` buffer ``slot``'s payload lands in (or is mapped from)."""

    @abc.abstractmethod
    def recv_header(self, timeout_s: float) -> bytes:
        """Block for the next header's bytes."""

    @abc.abstractmethod
    def post_payload(self, slot: int, nbytes: int, timeout_s: float) -> None:
        """Start receiving the payload announced by the last header into ``buffer(slot)``."""

    @abc.abstractmethod
    def wait_payload(self, slot: int, timeout_s: float) -> None:
        """Block until ``buffer(slot)[:nbytes]`` holds the whole payload."""

    def release(self, slot: int) -> None:
        """The pipeline is done reading ``buffer(slot)``: the sender may refill it."""

    def close(self) -> None:
        """Release buffers and connections. Idempotent."""
