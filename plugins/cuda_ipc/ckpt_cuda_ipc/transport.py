"""``BucketSender`` / ``BucketReceiver`` over mapped slot buffers and control channels.

One bucket, policy rank 0 -> every rollout rank:

1. the pipeline packs the bucket into slot ``k % 2`` (after :meth:`IpcSender.wait_slot` said
   every rollout released that slot);
2. :meth:`IpcSender.post` makes the bytes visible (a stream synchronize on CUDA; nothing on
   the host) and sends the header frame to every rollout;
3. each rollout's :meth:`IpcReceiver.recv_header` returns it; the payload is already in the
   mapped slot, so ``post_payload``/``wait_payload`` have nothing to do;
4. the core's merge copies the tensors out, then calls :meth:`IpcReceiver.release`, which
   sends a RELEASE frame for the slot;
5. the sender overwrites a slot only once every rollout released it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from ckpt_core.errors import PeerLostError, RemoteRefitError, TransferError, WireFormatError
from ckpt_core.transport import BucketReceiver, BucketSender
from ckpt_core.transport.wire import decode_header

from .control import Channel, Deadline, Kind, decode_json, lost, readable_now, timed_out, wait_readable


class Slots(Protocol):
    """What the transport needs from :class:`~.buffers.HostSlots` / :class:`~.buffers.CudaSlots`."""

    bucket_size: int

    def view(self, slot: int) -> torch.Tensor: ...

    def publish(self) -> None: ...

    def consumed(self) -> None: ...

    def close(self) -> None: ...


_BYE_GRACE_S = 5.0
_NOTICE_S = 1.0


class IpcSender(BucketSender):
    """Policy rank 0's end: owns the slot buffers and one channel per rollout rank.

    ``channels[r]`` is rollout rank ``r``'s. ``wait_for_peers_on_close`` makes :meth:`close`
    wait (briefly) for rollouts to drop their mappings before the buffers are freed, which CUDA
    IPC requires of the exporting process.
    """

    def __init__(self, slots: Slots, channels: list[Channel], *, wait_for_peers_on_close: bool) -> None:
        self.slots = slots
        self.channels = channels
        self._pending: list[set[int]] = [set() for _ in range(self.num_slots)]
        self._wait_on_close = wait_for_peers_on_close
        self._closed = False

    def buffer(self, slot: int) -> torch.Tensor:
        return self.slots.view(slot)

    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()
    ) -> None:
        if direct:  # receivers read the mapped slot, so the bytes must be there
            raise TransferError("cuda_ipc sends only from its slots (direct_chunks is False)")
        if self._pending[slot]:
            raise TransferError(
                f"slot {slot} was posted while rollout ranks {sorted(self._pending[slot])} still read it"
            )
        self.slots.publish()
        kind = Kind.HEADER
        if nbytes == 0 and decode_header(header, bucket_size=self.slots.bucket_size).abort is not None:
            kind = Kind.ABORT
        deadline = Deadline(timeout_s)
        with self._failing_others():
            if kind is Kind.HEADER:
                self._read_what_came(f"before sending the header of the bucket in slot {slot}")
            for channel in self.channels:
                channel.send(kind, header, deadline, f"sending it the header of the bucket in slot {slot}")
        if kind is Kind.ABORT:
            # Receivers stop at an abort without releasing anything: no slot is in use any more.
            self._pending = [set() for _ in range(self.num_slots)]
        else:
            self._pending[slot] = set(range(len(self.channels)))

    def wait_slot(self, slot: int, timeout_s: float) -> None:
        deadline = Deadline(timeout_s)
        with self._failing_others():
            while self._pending[slot]:
                waiting = [self.channels[rank] for rank in sorted(self._pending[slot])]
                phase = f"waiting for it to release slot {slot}"
                ready = wait_readable(waiting, deadline)
                if not ready:
                    raise timed_out(", ".join(c.peer for c in waiting), phase, timeout_s)
                for channel in ready:
                    for kind, body in channel.read_ready(phase):
                        self._on_frame(self.channels.index(channel), kind, body)

    def _read_what_came(self, phase: str) -> None:
        """Take what the rollouts sent so far (releases, a failure), without waiting: a rollout
        already gone is found here, before any of them has this header. Otherwise the ranks
        before it could take the refit's last bucket and complete while the refit fails."""
        ready = readable_now(self.channels)
        while ready:  # until drained: a peer's last frames may come before its end of file
            for channel in ready:
                for kind, body in channel.read_ready(phase):
                    self._on_frame(self.channels.index(channel), kind, body)
            ready = readable_now(ready)

    @contextlib.contextmanager
    def _failing_others(self) -> Iterator[None]:
        """On a transport failure, tell every rollout at once that the refit is void, so none
        of them waits out its timeout for a bucket that will never come."""
        try:
            yield
        except TransferError as exc:
            deadline = Deadline(_NOTICE_S)
            for channel in self.channels:
                try:
                    channel.send_json({"type": "error", "reason": str(exc)}, deadline, "telling it the refit failed")
                except TransferError:
                    pass
            raise

    def _on_frame(self, rank: int, kind: Kind, body: bytes) -> None:
        peer = self.channels[rank].peer
        if kind is Kind.RELEASE:
            if len(body) != 1 or body[0] >= self.num_slots or rank not in self._pending[body[0]]:
                raise WireFormatError(f"{peer} released slot {body!r}, which it was not reading")
            self._pending[body[0]].discard(rank)
        elif kind is Kind.CONTROL:
            message = decode_json(body, peer)
            if message["type"] == "error":
                raise TransferError(f"{peer} failed: {message.get('reason')}")
            raise WireFormatError(f"unexpected control message {message['type']!r} from {peer} during a refit")
        else:
            raise WireFormatError(f"unexpected {kind.name} frame from {peer}")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = Deadline(_BYE_GRACE_S)
        for channel in self.channels:
            try:
                channel.send_json({"type": "bye"}, deadline, "saying goodbye")
            except TransferError:
                pass
        if self._wait_on_close:
            for channel in self.channels:
                channel.wait_closed(deadline)
        for channel in self.channels:
            channel.close()
        self.slots.close()


class IpcReceiver(BucketReceiver):
    """A rollout rank's end: its mapping of the policy's slots and its channel to policy rank 0."""

    payload_ready_with_header = True  # the policy fills the mapped slot before sending its header

    def __init__(self, slots: Slots, channel: Channel, timeout_s: float) -> None:
        self.slots = slots
        self.channel = channel
        self.timeout_s = timeout_s
        self._closed = False

    def buffer(self, slot: int) -> torch.Tensor:
        return self.slots.view(slot)

    def recv_header(self, timeout_s: float) -> bytes:
        kind, body = self.channel.recv(Deadline(timeout_s), "waiting for the next bucket header")
        if kind in (Kind.HEADER, Kind.ABORT):
            return body
        if kind is Kind.CONTROL:
            message = decode_json(body, self.channel.peer)
            if message["type"] == "bye":
                raise lost(self.channel.peer, "waiting for the next bucket header", "it finalized its engine")
            if message["type"] == "error":
                raise RemoteRefitError(f"{self.channel.peer} abandoned the refit: {message.get('reason')}")
        raise WireFormatError(f"expected a bucket header from {self.channel.peer}, got a {kind.name} frame")

    def post_payload(self, slot: int, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()) -> None:
        if nbytes > self.slots.bucket_size:
            raise WireFormatError(f"a payload of {nbytes} bytes does not fit a {self.slots.bucket_size}-byte slot")

    def wait_payload(self, slot: int, timeout_s: float) -> None:
        """The payload was in the mapped slot before its header was sent."""

    def release(self, slot: int) -> None:
        self.slots.consumed()
        try:
            self.channel.send(Kind.RELEASE, bytes([slot]), Deadline(self.timeout_s), f"releasing slot {slot}")
        except PeerLostError:
            # The policy is gone. What it sent before going (an abort header, an error message)
            # is still buffered on the socket: the next recv_header reports it, or the loss.
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            # The mapping goes before the channel: the policy frees CUDA slots once every
            # rollout's channel closed (an exporter must outlive its importers' mappings).
            self.slots.close()
        finally:
            self.channel.close()
