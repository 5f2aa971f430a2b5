"""Transports over dedicated ``torch.distributed`` process groups (Gloo, NCCL).

Peers meet through a ``TCPStore`` served by policy rank 0 during ``init`` (every worker binds
a socket in ``prepare()`` so it can advertise a port; only policy rank 0's becomes the store,
and listens, at init: before that a connection to it is refused, so the others retry until
their ``timeout_s`` instead of waiting on a socket nobody serves). Groups are built on that
store, under a per-``prepare`` prefix, and are never registered with ``torch.distributed``:
the caller's default process group is never created, required or changed, and
``torch.distributed.is_initialized()`` stays as it was.

Once its groups have formed, a worker stops listening for strangers: it fences its Gloo
listeners at once (:mod:`ckpt_core._internal.fence`) and drops the store; policy rank 0, once
every member said its groups formed, closes the store server (:mod:`ckpt_core._internal.store`).
A payload group of its own (NCCL's) moves its first byte during init
(:meth:`DistributedEngine._connect_data_group`), so its communicator exists before the store
goes.
Before groups form, members compare world sizes and metadata at rendezvous
(:mod:`ckpt_core._internal.agreement`), so a mismatch is named at once instead of timing out.

Topologies (:class:`~ckpt_core.topology.Topology` says who feeds whom):

* ``broadcast``: one group of policy rank 0 and every rollout rank; each bucket is broadcast
  from policy rank 0. Other policy ranks drain their weights.
* ``paired``: one two-member group per pair (policy rank ``i``, rollout rank ``i``). Needs at
  least as many policy as rollout ranks; policy ranks without a partner drain their weights.
* ``fanout``: one two-member group per rollout rank, all with policy rank 0, which sends each
  rollout rank a stream of its own (with destination layouts: only its parts). Other policy
  ranks drain their weights.

Per bucket: a header frame (``HEADER_FRAME_BYTES``: the header's length, then as much of the
header as fits), the rest of a longer header, the packed payload, then each direct chunk
(received straight into its output tensor), each a send/recv (paired, fanout) or a broadcast
(broadcast). A frame has a fixed size so a receiver can post the next one before the bytes of
the current bucket have arrived (``expect_header``): when they have, the next header is there,
and the link does not idle for a header's round trip between buckets. Headers travel on the
control group (always Gloo, on the host); payloads on the data group (Gloo for host buffers,
NCCL for device ones).

A pair whose payloads ride the control group (Gloo, host buffers, paired or fanout) sends a
bucket's frame and packed payload as *one* message: each slot is a frame followed by its
buffer, and the receiver posts its next slot whole as soon as that slot is free. Gloo takes a
message smaller than the posted buffer, so the payload's size need not be known in advance;
and a message whose receive was posted first moves at once, where one posted after the header
arrived waits for Gloo's own round trip (on a small refit, the frame's round trip and Gloo's
together were 0.4-0.9 ms). The payload is then readable when the header is
(``payload_ready_with_header``). A broadcast cannot do this (every member of a Gloo broadcast
posts the same size), nor can a payload on another group.

A pair's receiver posts the next refit's first slot when a refit ends (``expect_refit``): Gloo
moves a message only once its receive is posted, so a policy that starts first would otherwise
hold its first bucket until the rollout reached its receive (a vLLM rank is reached through its
engine's call, 1-3 ms after the trainer's). Not at connect: a fanout pair's receive posted then
was, in 2 of 35 runs with the cores loaded, not matched until the rollout waited on it.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import gc
import socket
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ckpt_core._internal.agreement import agree_as_member, agree_as_policy
from ckpt_core._internal.auth import answer_challenge, host_challenge, resolve_token, verify_members
from ckpt_core._internal.bucket_io import BucketReceiver, BucketSender, bucket_buffers
from ckpt_core._internal.fence import ListenerFence, gloo_device, lazy_init
from ckpt_core._internal.host_alloc import release_pages_past
from ckpt_core._internal.node_address import AUTO, HOST_ENV, node_address
from ckpt_core._internal.slot_memory import SlotMemories
from ckpt_core._internal.store import DetachableStore, join_store
from ckpt_core._internal.wire import MAX_HEADER_BYTES
from ckpt_core.errors import EngineOptionError, LifecycleError, PeerLostError, TransferTimeoutError, WireFormatError
from ckpt_core.options import Option
from ckpt_core.topology import Topology
from ckpt_core.transport._lifecycle import Phase
from ckpt_core.transport.engine import BucketedEngine

TOPOLOGIES = tuple(topology.value for topology in Topology)
"""The topologies ``DistributedEngine`` supports (a subclass may narrow its ``topology`` choices)."""
_FRAME_TAG, _HEADER_REST_TAG, _PAYLOAD_TAG = 1, 2, 3

HEADER_FRAME_BYTES = 64 << 10
"""A header frame: an 8-byte little-endian length, then the header's first bytes. Headers of up
to ``HEADER_FRAME_BYTES - 8`` bytes (about 700 chunks) travel in the frame alone."""
_FRAME_ROOM = HEADER_FRAME_BYTES - 8


def gloo_group(
    store: Any,
    rank: int,
    size: int,
    *,
    host: str,
    timeout: datetime.timedelta,
    fences: list[ListenerFence] | None = None,
) -> Any:
    """A Gloo process group of ``size`` on ``store``, bound to ``host``'s interface. The fence
    of its device's listener is appended to ``fences`` (if given and found)."""
    device, fence = gloo_device(host)
    if fences is not None and fence is not None:
        fences.append(fence)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs omit it
    options._devices = [device]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


class Link:
    """One sender (rank 0 of its groups) and its receivers (ranks 1..n): ordered messages.

    ``control`` carries headers (always Gloo, on the host); ``data`` carries payloads.
    """

    def __init__(self, control: Any, data: Any, *, rank: int, size: int, broadcast: bool, peer: str) -> None:
        self.control, self.data = control, data
        self.rank, self.size = rank, size
        self.broadcast = broadcast
        self.peer = peer  # who is on the other side, for error messages

    @property
    def frames_carry_payload(self) -> bool:
        """Whether a bucket's packed payload travels in its header frame's message (see the
        module docstring): point-to-point, and payloads on the control group."""
        return not self.broadcast and self.data is self.control

    def release(self) -> None:
        """Drop this link's groups. Gloo closes a group's sockets only when the group object is
        destroyed (``shutdown()`` does not), and peers notice a failure only then."""
        self.control = self.data = None

    def post(self, group: Any, tensor: torch.Tensor, tag: int, phase: str = "posting a message") -> Any:
        """Start one message of ``tensor`` on ``group`` (a broadcast, or a send/recv with the
        peer); a peer already gone is a ``PeerLostError`` here too (Gloo's point-to-point
        calls fail at once on a closed pair, its broadcast only when waited on)."""
        if group is None:
            raise LifecycleError(f"the link with {self.peer} was released (finalize() ran during the refit)")
        try:
            if self.broadcast:
                return group.broadcast(tensor, 0)
            if self.rank == 0:
                return group.send([tensor], 1, tag)
            return group.recv([tensor], 0, tag)
        except RuntimeError as exc:
            raise self._typed(exc, phase, None) from exc

    def wait(self, pending: list[Any], timeout_s: float, phase: str) -> None:
        """Wait for every work in ``pending``, emptying it, with our error types.

        Works are taken from a list the caller owns, never held in a local: a failed wait's
        traceback outlives the wait, and a work it still referenced would keep the group's
        sockets open (peers would learn of the failure only at their own timeout).
        """
        try:
            while pending:
                pending[0].wait(_timedelta(timeout_s))
                pending.pop(0)
        except RuntimeError as exc:
            pending.clear()
            raise self._typed(exc, phase, timeout_s) from exc

    def _typed(self, exc: RuntimeError, phase: str, timeout_s: float | None) -> Exception:
        """Gloo's ``RuntimeError`` as ours: a timeout, or a lost peer."""
        text = _first_line(exc)
        if timeout_s is not None and ("timed out" in text.lower() or "timeout" in text.lower()):
            return TransferTimeoutError(
                f"{phase} with {self.peer}: no progress within timeout_s={timeout_s:g}s ({text})"
            )
        return PeerLostError(f"{phase} with {self.peer} failed, the peer is gone: {text}")


def _framed_slots(
    count: int, bucket_size: int, device: torch.device
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """``count`` slots of a header frame followed by a bucket buffer, one allocation each (a
    framed link moves a slot's frame and payload as one message): ``(slots, frames, buffers)``,
    the frames and buffers being views of the slots."""
    slots = bucket_buffers(count, bucket_size, device, frame_bytes=HEADER_FRAME_BYTES)
    return slots, [whole[:HEADER_FRAME_BYTES] for whole in slots], [whole[HEADER_FRAME_BYTES:] for whole in slots]


class DistributedSender(BucketSender):
    direct_chunks = True

    def __init__(self, link: Link, bucket_size: int, device: torch.device) -> None:
        self.link = link
        self._framed = link.frames_carry_payload
        if self._framed:  # each slot: its frame, then its buffer, sent as one message
            self._slots, self._frames, self._buffers = _framed_slots(self.num_slots, bucket_size, device)
        else:
            self._buffers = bucket_buffers(self.num_slots, bucket_size, device)
            self._slots = []
            self._frames = [torch.zeros(HEADER_FRAME_BYTES, dtype=torch.uint8) for _ in range(self.num_slots)]
        self._in_flight: list[list[Any]] = [[] for _ in range(self.num_slots)]
        self._sending: list[list[torch.Tensor]] = [[] for _ in range(self.num_slots)]

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()
    ) -> None:
        frame = self._frames[slot]  # free: wait_slot(slot) preceded this post
        view = frame.numpy().data
        struct.pack_into("<Q", view, 0, len(header))
        view[8 : 8 + min(len(header), _FRAME_ROOM)] = header[:_FRAME_ROOM]
        link = self.link
        packed = nbytes and not self._framed  # framed: the payload rides the frame's message
        message = self._slots[slot][: HEADER_FRAME_BYTES + nbytes] if self._framed else frame
        works = [link.post(link.control, message, _FRAME_TAG, "sending a bucket")]
        tensors = [message]  # alive until the sends complete
        if len(header) > _FRAME_ROOM:
            rest = torch.frombuffer(bytearray(header[_FRAME_ROOM:]), dtype=torch.uint8)
            works.append(link.post(link.control, rest, _HEADER_REST_TAG, "sending a bucket"))
            tensors.append(rest)
        payloads = [self._buffers[slot][:nbytes], *direct] if packed else list(direct)
        for data in payloads:
            works.append(link.post(link.data, data, _PAYLOAD_TAG, "sending a bucket"))
            tensors.append(data)
        self._in_flight[slot] = works
        self._sending[slot] = tensors

    def wait_slot(self, slot: int, timeout_s: float) -> None:
        self.link.wait(self._in_flight[slot], timeout_s, "sending a bucket")
        self._sending[slot] = []

    def close(self) -> None:
        self._in_flight = [[] for _ in range(self.num_slots)]
        self._sending = [[] for _ in range(self.num_slots)]
        self._buffers = self._frames = self._slots = []
        self.link.release()


class DistributedReceiver(BucketReceiver):
    direct_chunks = True

    def __init__(self, link: Link, bucket_size: int, device: torch.device) -> None:
        self.link = link
        self._framed = self.payload_ready_with_header = link.frames_carry_payload
        if self._framed:  # each slot: the frame its header arrives in, then its buffer
            self._slots, self._frames, self._buffers = _framed_slots(self.num_slots, bucket_size, device)
        else:
            self._buffers = bucket_buffers(self.num_slots, bucket_size, device)
            self._slots = []
            self._frames = [torch.zeros(HEADER_FRAME_BYTES, dtype=torch.uint8)]
        self._in_flight: list[list[Any]] = [[] for _ in range(self.num_slots)]
        self._frame_in_flight: list[Any] = []
        self._frame_slot = 0  # the slot the next header arrives in (framed)
        self._expected = False  # expect_header() or expect_refit() ran; its frame may await its slot's release
        self._busy: set[int] = set()  # slots whose header arrived and the pipeline has not released
        self._memories = [SlotMemories() for _ in range(self.num_slots)]  # each slot's, once handed over

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def expect_header(self) -> None:
        if self._framed:
            self._frame_slot = (self._frame_slot + 1) % self.num_slots
        self._expected = True
        self._post_frame()

    def expect_refit(self) -> None:
        """Post the receive of the next refit's first frame (slot 0) now, on a point-to-point
        link: Gloo moves a message only once its receive is posted, so a sender that starts
        first would otherwise wait, with its whole first bucket, for this side to reach its
        receive. Not on a broadcast link: a posted broadcast would be the group's next
        collective, whatever the group runs before the next refit."""
        if self.link.broadcast:
            return
        self._frame_slot = 0
        self._expected = True
        self._post_frame()

    def _post_frame(self) -> None:
        """Post the receive of the next header's frame, unless it is posted or (framed) its
        slot is still the pipeline's: ``release`` posts it then."""
        if self._frame_in_flight or self._frame_slot in self._busy:
            return
        link = self.link
        message = self._slots[self._frame_slot] if self._framed else self._frames[0]
        self._frame_in_flight = [link.post(link.control, message, _FRAME_TAG, "receiving a bucket header")]

    def recv_header(self, timeout_s: float) -> bytes:
        if not self._expected:  # a refit's first bucket: slot 0
            self._frame_slot = 0
        self._post_frame()
        if not self._frame_in_flight:
            raise LifecycleError(
                f"a bucket header from {self.link.peer} is due in slot {self._frame_slot}, which the "
                "refit has not released: the stream is out of step (finalize(), then init again)"
            )
        link = self.link
        link.wait(self._frame_in_flight, timeout_s, "receiving a bucket header")
        self._expected = False
        frame = self._frames[self._frame_slot if self._framed else 0].numpy()
        if self._framed:
            self._busy.add(self._frame_slot)
        (length,) = struct.unpack_from("<Q", frame.data)
        if not 0 < length <= MAX_HEADER_BYTES:
            raise WireFormatError(f"bucket header length {length} is outside (0, {MAX_HEADER_BYTES}]")
        head = frame[8 : 8 + min(length, _FRAME_ROOM)].tobytes()
        if length <= _FRAME_ROOM:
            return head
        rest = torch.empty(length - _FRAME_ROOM, dtype=torch.uint8)
        phase = "receiving a bucket header"
        link.wait([link.post(link.control, rest, _HEADER_REST_TAG, phase)], timeout_s, phase)
        return head + rest.numpy().tobytes()

    def post_payload(self, slot: int, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()) -> None:
        link = self.link
        packed = nbytes and not self._framed  # framed: the payload came with the header
        targets = [self._buffers[slot][:nbytes], *direct] if packed else list(direct)
        self._in_flight[slot] = [
            link.post(link.data, target, _PAYLOAD_TAG, "receiving a bucket payload") for target in targets
        ]

    def wait_payload(self, slot: int, timeout_s: float) -> None:
        self.link.wait(self._in_flight[slot], timeout_s, "receiving a bucket payload")

    def hand_over(self, slot: int, nbytes: int) -> bool:
        """Host buffers only: the slot (its frame too, when framed) gets new memory, rotating
        among a few blocks of its own (:class:`~ckpt_core._internal.slot_memory.SlotMemories`
        says which, and when it refuses: the bucket is copied out then, and the slot keeps its
        memory). The slot has no receive posted now (its header arrived and the pipeline has
        not released it). A buffer made at start, resident whole, keeps only its first
        ``nbytes`` resident; a rotation block is handed over as it is, resident as far as it
        was ever written (giving its tail back too made the next bucket received into it
        fault that tail in again)."""
        old = self._buffers[slot]
        if old.device.type != "cpu":
            return False
        memories = self._memories[slot]
        made_at_start = memories.current is None
        whole = memories.take(self._slots[slot].numel() if self._framed else old.numel())
        if whole is None:
            return False
        if self._framed:
            self._slots[slot] = whole
            self._frames[slot] = whole[:HEADER_FRAME_BYTES]
            self._buffers[slot] = whole[HEADER_FRAME_BYTES:]
        else:
            self._buffers[slot] = whole
        if made_at_start:
            release_pages_past(old, nbytes)
        return True

    def release(self, slot: int) -> None:
        self._busy.discard(slot)
        if self._expected:  # the next header's slot may be free now
            self._post_frame()

    def close(self) -> None:
        self._in_flight = [[] for _ in range(self.num_slots)]
        self._frame_in_flight = []
        self._buffers = self._frames = self._slots = []
        self._memories = []  # the slots' spare blocks go now; those a tensor holds, with it
        self.link.release()


class DistributedEngine(BucketedEngine):
    """A ``BucketedEngine`` over dedicated torch.distributed groups; subclasses pick the groups.

    Its options are ``BucketedEngine``'s plus ``topology`` (who feeds whom:
    :class:`~ckpt_core.topology.Topology`; ``"broadcast"``: policy rank 0 to every rollout
    rank, one stream; ``"paired"``: policy rank i to rollout rank i; ``"fanout"``: policy rank 0
    to every rollout rank, each over a pair of its own and sent a stream of its own, so that
    with destination layouts each receives only its parts), ``host`` (set it to the node's
    address for multi-node runs, or to ``"auto"`` where every worker gets the same options: see
    :mod:`ckpt_core._internal.node_address`) and ``auth_token`` (see
    :mod:`ckpt_core._internal.auth`), all listed at the end of this docstring. ``checksum``
    is off by default: on a host refit xxh3 takes a large share of the time
    (docs/reliability.md); turn it on across hosts or to debug a transport.

    What a subclass provides: ``backend_name``, ``device_type`` and ``_new_data_group``
    (abstract: the group payloads move on); optionally ``_new_control_group``,
    ``_shares_control_group``, ``_buffer_device``, ``_new_sender`` and ``_new_receiver``.
    The rendezvous (``_connect_store``, ``_make_link``) and the topology are this class's.
    """

    device_type: ClassVar[str] = "cpu"

    options = BucketedEngine.options.extend(
        Option.choice(
            "topology",
            Topology.BROADCAST,
            TOPOLOGIES,
            "who feeds whom: policy rank 0 to all (broadcast), policy i to rollout i (paired), or "
            "policy rank 0 to each rollout rank over a pair and a stream of its own (fanout)",
            convert=Topology,
            agreed=True,
        ),
        Option.text(
            "host",
            "127.0.0.1",
            "address to bind and advertise; \"auto\": this node's own (CKPT_CORE_HOST, else Ray's "
            "node address, else the host name's)",
            noun="address string",
        ),
        Option.text(
            "auth_token",
            None,
            "shared secret every worker proves at rendezvous; default: CKPT_CORE_AUTH_TOKEN, else none",
        ),
    )

    DISTRIBUTED_HOOKS: ClassVar[frozenset[str]] = frozenset(
        {
            "_new_data_group",
            "_new_control_group",
            "_shares_control_group",
            "_buffer_device",
            "_new_sender",
            "_new_receiver",
        }
    )
    """What a subclass provides (``_new_data_group``) or may override, beside the hooks of
    :class:`~ckpt_core.transport.hooks.TransportHooks` (the section below); every other
    underscore name is private to this class."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        owner = type(self).__name__
        values = self.option_values
        self._auth_token = resolve_token(values.auth_token)
        self.topology: Topology = values.topology
        host: str = values.host
        if host == AUTO:
            try:
                host = node_address()
            except OSError as exc:
                raise EngineOptionError(
                    f"{owner}: host='auto' could not find this node's address ({exc}); set {HOST_ENV} "
                    "on each node, or pass the address as host"
                ) from exc
        self.host = host
        self._listener: socket.socket | None = None  # bound in prepare(); listens as the store, at init
        self._store: DetachableStore | None = None
        self._groups: list[Any] = []
        self._fences: list[ListenerFence] = []

    # --- what a subclass provides ------------------------------------------------------

    @abc.abstractmethod
    def _new_data_group(self, store: Any, rank: int, size: int) -> Any:
        """A group for payloads on ``store`` (already prefixed), of which this worker is ``rank``."""

    def _new_control_group(self, store: Any, rank: int, size: int) -> Any:
        return gloo_group(store, rank, size, host=self.host, timeout=_timedelta(self.timeout_s), fences=self._fences)

    def _shares_control_group(self) -> bool:
        """Whether payloads may ride the control group (true when both live on the host)."""
        return self.device_type == "cpu"

    def _buffer_device(self) -> torch.device:
        return torch.device(self.device_type)

    def _new_sender(self, link: Link) -> DistributedSender:
        """The sender on ``link``; override to specialize packing or posting."""
        return DistributedSender(link, self.bucket_size, self._buffer_device())

    def _new_receiver(self, link: Link) -> DistributedReceiver:
        """The receiver on ``link``; override to specialize receiving."""
        return DistributedReceiver(link, self.bucket_size, self._buffer_device())

    # --- rendezvous --------------------------------------------------------------------

    def _prepare_transport(self) -> dict[str, Any]:
        listener = socket.socket(_family(self.host), socket.SOCK_STREAM)
        try:
            listener.bind((self.host, 0))
        except OSError as exc:
            listener.close()
            raise EngineOptionError(
                f"{type(self).__name__}: cannot listen on host={self.host!r} ({exc}); set host to "
                "an address of this machine"
            ) from exc
        # Only bound, not listening, until init: a connection is refused (the kernel would
        # otherwise accept it into a backlog nobody reads, and TCPStore's client waits on
        # such a socket without end); policy rank 0 listens once it serves the store.
        self._listener = listener
        return {"host": self.host, "port": listener.getsockname()[1]}

    def _connect_store(
        self, metadata: list[dict[str, Any]], identity: str, members: list[str], world_sizes: tuple[int, int]
    ) -> Any:
        """Join policy rank 0's store (serving it if this is policy rank 0), compare world sizes
        and metadata, and pass the token challenge; returns the store under this rendezvous'
        prefix."""
        is_master = identity == "policy rank 0"
        listener, self._listener = self._listener, None
        if listener is None:
            raise LifecycleError(
                f"{type(self).__name__}: a failed init closed this worker's rendezvous socket; call "
                "finalize(), then prepare() and init again on every worker"
            )
        if is_master:
            listener.listen(1024)
            tcp_store = dist.TCPStore(
                self.host,
                listener.getsockname()[1],
                None,
                True,
                _timedelta(self.timeout_s),
                wait_for_workers=False,
                master_listen_fd=listener.detach(),  # the store takes the socket over
            )
        else:
            listener.close()
            first = metadata[0]
            tcp_store = join_store(first.get("host"), first.get("port"), self.timeout_s, who="policy rank 0")
        self._store = DetachableStore(tcp_store)
        del tcp_store  # the DetachableStore holds the only reference: detaching closes it
        store = dist.PrefixStore(f"ckpt_core/{metadata[0]['engine_id']}/", self._store)
        view = {
            "train_world_size": world_sizes[0],
            "rollout_world_size": world_sizes[1],
            "engine_ids": [entry.get("engine_id") for entry in metadata],
        }
        owner = type(self).__name__
        start = time.monotonic()
        try:
            if is_master:
                host_challenge(store, self._auth_token)
                agree_as_policy(store, owner, view, [m for m in members if m != identity])
                verify_members(store, self._auth_token, [m for m in members if m != identity])
            else:
                agree_as_member(store, owner, view, identity)
                answer_challenge(store, self._auth_token, identity, "policy rank 0")
        except (RuntimeError, dist.DistError) as exc:
            raise PeerLostError(
                f"rendezvous as {identity} failed after {time.monotonic() - start:.1f}s "
                f"(timeout_s={self.timeout_s:g}): {_first_line(exc)}"
            ) from exc
        return store

    @contextlib.contextmanager
    def _reporting_failure(self, store: Any, identity: str) -> Iterator[None]:
        """Forming this worker's groups failed: tell policy rank 0 (best effort), which waits
        for every member's groups, instead of letting it wait out its timeout."""
        try:
            yield
        except BaseException as exc:
            if identity != "policy rank 0":
                try:
                    store.set(f"formed/{identity}", f"failed: {type(exc).__name__}: {exc}"[:2000])
                except Exception:  # noqa: BLE001 - the error being raised is what matters
                    pass
            raise

    def _seal(self, store: Any, identity: str, members: list[str]) -> None:
        """Every group this worker needs has formed: stop listening for anyone else. Its Gloo
        listeners are fenced at once (a pair is connected on both ends once either end's group
        has formed, so no member needs them any more). Members then report their groups formed
        and drop the store; policy rank 0 closes the store server once every member has
        reported (they may still be forming groups among themselves)."""
        lazy = lazy_init()  # Gloo would connect pairs later, through the listener and the store
        if not lazy:
            for fence in self._fences:
                fence.apply()
        start = time.monotonic()
        try:
            if identity != "policy rank 0":
                store.set(f"formed/{identity}", "ok")
            else:
                for member in members:
                    if member != identity:
                        report = bytes(store.get(f"formed/{member}")).decode("utf-8", errors="replace")
                        if report != "ok":
                            raise PeerLostError(f"{member} could not form its groups: {report}")
        except (RuntimeError, dist.DistError) as exc:
            raise PeerLostError(
                f"waiting for every member's groups to form, as {identity}, failed after "
                f"{time.monotonic() - start:.1f}s (timeout_s={self.timeout_s:g}): {_first_line(exc)}"
            ) from exc
        if not lazy:
            self._close_store()

    def _make_link(self, store: Any, name: str, rank: int, size: int, peer: str) -> Link:
        prefixed = dist.PrefixStore(f"{name}/", store)
        start = time.monotonic()
        try:
            control = self._new_control_group(dist.PrefixStore("control/", prefixed), rank, size)
            if self._shares_control_group():
                data = control
            else:
                data = self._new_data_group(dist.PrefixStore("data/", prefixed), rank, size)
        except RuntimeError as exc:
            raise PeerLostError(
                f"forming the {name!r} group with {peer} failed after {time.monotonic() - start:.1f}s "
                f"(timeout_s={self.timeout_s:g}): {_first_line(exc)}"
            ) from exc
        self._groups.extend({id(control): control, id(data): data}.values())
        link = Link(control, data, rank=rank, size=size, broadcast=self.topology.shares_link, peer=peer)
        if data is not control:
            self._connect_data_group(link)
        return link

    def _connect_data_group(self, link: Link) -> None:
        """Move one byte on the payload group now, the way payloads will move (a broadcast, or
        a send/recv per pair). A group such as NCCL's builds its communicator through the store
        at its first message; made here, during init, the store can close like a Gloo one."""
        first = torch.zeros(1, dtype=torch.uint8, device=self._buffer_device())
        phase = "connecting the payload group"
        link.wait([link.post(link.data, first, _PAYLOAD_TAG, phase)], self.timeout_s, phase)

    def _check_topology(self, train_world_size: int, rollout_world_size: int) -> None:
        self.topology.check_world_sizes(type(self).__name__, train_world_size, rollout_world_size)

    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | dict[int, BucketSender] | None:
        self._check_topology(train_world_size, rollout_world_size)
        members = _identities(train_world_size, rollout_world_size)
        identity = f"policy rank {worker_rank}"
        store = self._connect_store(metadata, identity, members, (train_world_size, rollout_world_size))
        with self._reporting_failure(store, identity):
            sender: BucketSender | dict[int, BucketSender] | None = None
            destinations = self.topology.destinations(worker_rank, train_world_size, rollout_world_size)
            if not destinations:
                pass  # this rank drains its weights
            elif self.topology.shares_link:  # one group: this rank and every destination
                peers = f"rollout ranks {destinations[0]}..{destinations[-1]}"
                link = self._make_link(store, "broadcast", 0, len(destinations) + 1, peers)
                sender = self._new_sender(link)
            elif self.topology.separate_streams:  # a pair, and a stream, per destination
                sender = {
                    rank: self._new_sender(self._make_link(store, f"fan{rank}", 0, 2, f"rollout rank {rank}"))
                    for rank in destinations
                }
            else:  # one pair
                (rank,) = destinations
                sender = self._new_sender(self._make_link(store, f"pair{rank}", 0, 2, f"rollout rank {rank}"))
        self._seal(store, identity, members)
        return sender

    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        self._check_topology(train_world_size, rollout_world_size)
        members = _identities(train_world_size, rollout_world_size)
        identity = f"rollout rank {rollout_rank}"
        store = self._connect_store(metadata, identity, members, (train_world_size, rollout_world_size))
        with self._reporting_failure(store, identity):
            source = f"policy rank {self.topology.source(rollout_rank)}"
            if self.topology.shares_link:
                link = self._make_link(store, "broadcast", rollout_rank + 1, rollout_world_size + 1, source)
            elif self.topology.separate_streams:
                link = self._make_link(store, f"fan{rollout_rank}", 1, 2, source)
            else:
                link = self._make_link(store, f"pair{rollout_rank}", 1, 2, source)
            receiver = self._new_receiver(link)
        self._seal(store, identity, members)
        return receiver

    def _release_transport(self) -> None:
        groups, self._groups = self._groups, []
        while groups:
            try:
                groups.pop().shutdown()
            except Exception:  # noqa: BLE001 - a group whose peer died may refuse a clean shutdown
                pass
        self._close_store()
        self._fences = []
        if self._life.phase is Phase.FAILED:
            # A failed refit's traceback is a reference cycle that can still reach the groups;
            # collecting it now closes their sockets now, not at some later collection. Only
            # then: a full collection costs 0.15-0.5 s in a trainer's heap, and a plain
            # finalize (verl's manager runs one every sync) leaves no such cycle.
            gc.collect()

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.detach()
            self._store = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


def _identities(train_world_size: int, rollout_world_size: int) -> list[str]:
    return [f"policy rank {r}" for r in range(train_world_size)] + [
        f"rollout rank {r}" for r in range(rollout_world_size)
    ]


def _first_line(exc: BaseException) -> str:
    """An exception's first line (torch's carry a C++ backtrace after it)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET
