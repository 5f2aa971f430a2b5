"""``CudaIpcCheckpointEngine``: colocated refit through buffers the rollouts map.

Lifecycle (what each call does on each side):

* ``prepare()`` (every worker; the role is not known yet): sweeps control directories left by
  killed processes, opens a Unix listener in a fresh private directory and returns its path,
  the node's identity and the buffer device kind. Nothing is allocated.
* ``init_policy_process_group``: policy rank 0 allocates the slot buffers (once), accepts one
  connection per rollout rank, checks each (same user, expected rank and engine id), sends it
  the buffers (a memfd descriptor, or the CUDA IPC handle, exported once) and waits until every
  rollout has mapped them; then it removes its listener. Other policy ranks remove theirs and
  drain their weights at each refit (topology ``broadcast``).
* ``init_rollout_process_group``: removes its own listener, connects to policy rank 0, maps
  the buffers once and keeps them for every refit.
* refits: see :mod:`.transport`. ``finalize()`` closes channels, mappings, buffers and listeners.
"""

from __future__ import annotations

import gc
import os
import selectors
import socket
import sys
import tempfile
from typing import Any, ClassVar

import torch

from ckpt_core.errors import (
    AuthenticationError,
    BackendUnavailableError,
    EngineOptionError,
    LifecycleError,
    PeerLostError,
    TransferError,
    TransferTimeoutError,
    WireFormatError,
)
from ckpt_core.transport import (
    BackendCapabilities,
    BucketedEngine,
    BucketReceiver,
    BucketSender,
    Checksum,
    Option,
    Topology,
    device_payload_checksum,
    payload_checksum,
)

from .buffers import CudaSlots, HostSlots, import_cupy
from .control import (
    Channel,
    Deadline,
    Kind,
    Listener,
    check_socket_parent,
    connect,
    decode_json,
    peer_credentials,
    sweep_stale,
)
from .transport import IpcReceiver, IpcSender

NUM_SLOTS = 2
TOPOLOGIES = (Topology.BROADCAST.value, Topology.FANOUT.value)
_ROLLOUT_PEER = "policy rank 0"


def _node_identity() -> str:
    """Which machine (boot) this is: processes on one node agree, across containers too."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def _parse_device(owner: str, device: Any) -> torch.device:
    if not isinstance(device, (str, torch.device)):
        raise EngineOptionError(f"{owner}: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise EngineOptionError(f"{owner}: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if parsed.type not in ("cpu", "cuda") or (parsed.type == "cpu" and parsed.index not in (None, 0)):
        raise EngineOptionError(f"{owner}: device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    return torch.device("cpu") if parsed.type == "cpu" else parsed


def _device_option(option: Option, owner: str, device: Any) -> torch.device:
    return _parse_device(owner, device)


def _socket_dir_option(option: Option, owner: str, socket_dir: Any) -> str | None:
    if socket_dir is None:
        return None
    if not isinstance(socket_dir, str) or not socket_dir:
        raise EngineOptionError(f"{owner}: socket_dir must be a directory path string, got {socket_dir!r}")
    problem = check_socket_parent(socket_dir)
    if problem:
        raise EngineOptionError(f"{owner}: socket_dir {problem}")
    return socket_dir


class CudaIpcCheckpointEngine(BucketedEngine):
    """Refit between processes on one node through shared slot buffers (see the module docstring).

    Its options are :class:`~ckpt_core.transport.engine.BucketedEngine`'s plus ``device``,
    ``socket_dir`` and ``topology`` (``"broadcast"`` or ``"fanout"``), all listed at the end of
    this docstring. ``bucket_size`` is the size of each of the two slots. ``device``: every
    worker must use the same kind; a rollout maps the policy's buffers in place, so its device
    must be the policy's physical GPU (compared by UUID at init: ``EngineOptionError`` naming
    both GPUs otherwise; the index may differ per process). ``checksum`` (off by default, as on
    every engine: the bytes never cross a wire, and on a path as fast as memory one more read
    of every byte on each side is not cheap) is xxh3-64 for host slots and the device checksum
    for CUDA slots. ``topology="fanout"`` gives every rollout rank two slots of its own (the
    policy then holds two per rollout rank) and is host-only for now. The slot buffers are
    shared with the peers of one ``init``, so ``finalize()`` always unmaps them;
    ``release_after_refit`` also empties torch's CUDA cache on a CUDA device.
    """

    backend_name: ClassVar[str] = "cuda_ipc"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cpu", "cuda"), topologies=TOPOLOGIES, placements=("colocated",)
    )
    options = BucketedEngine.options.extend(
        Option.custom(
            "device",
            "cpu",
            'where the slots live: "cpu" (shared host memory, runs anywhere), "cuda" (the '
            'current CUDA device) or "cuda:N"; the same kind on every worker',
            parse=_device_option,
            kind="'cpu' | 'cuda' | 'cuda:N'",
        ),
        Option.custom(
            "socket_dir",
            None,
            "where each worker's private control directory is made; the socket path must fit in 107 bytes",
            parse=_socket_dir_option,
            kind="directory path or None",
            shown_default="system temp dir",
        ),
        Option.choice(
            "topology",
            Topology.BROADCAST,
            TOPOLOGIES,
            "broadcast: every rollout rank maps the same two slots; fanout: two slots and a stream "
            "per rollout rank (host slots only, for now)",
            convert=Topology,
            agreed=True,
        ),
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """``None`` on Linux: the ``device="cpu"`` mode runs on any Linux machine.

        ``device="cuda"`` additionally needs a CUDA device and cupy; that is checked (with a
        clear error) when such an engine is constructed.
        """
        if not sys.platform.startswith("linux"):
            return f"needs Linux (memfd_create and descriptor passing); this is {sys.platform}"
        return None

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        owner = type(self).__name__
        values = self.option_values
        self.topology: Topology = values.topology
        reason = self.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"the cuda_ipc backend cannot run here: {reason}")
        self.device: torch.device = values.device
        if self.topology.separate_streams and self.device.type == "cuda":
            # Fanout packs on one thread per destination: those are not ordered after the CUDA
            # stream the caller produced the weights on, and the path has not run on a GPU yet.
            raise EngineOptionError(
                f"{owner}: topology='fanout' is host-only for now (device='cpu'); with device={str(self.device)!r} "
                "use topology='broadcast'"
            )
        if self.device.type == "cuda":
            self._check_cuda(owner)
        socket_dir: str | None = values.socket_dir
        if socket_dir is None:
            socket_dir = tempfile.gettempdir()
            problem = check_socket_parent(socket_dir)
            if problem:
                raise EngineOptionError(f"{owner}: socket_dir {problem}")
        self.socket_dir: str = socket_dir
        self._listener: Listener | None = None
        self._host_slots: list[HostSlots] = []  # this engine's host mappings, until unmapped

    def _check_cuda(self, owner: str) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                f"{owner}: device={str(self.device)!r} needs a CUDA device, but none is visible "
                "(torch.cuda.is_available() is False); use device='cpu' for shared host memory"
            )
        count = torch.cuda.device_count()
        if self.device.index is not None and self.device.index >= count:
            raise EngineOptionError(
                f"{owner}: device={str(self.device)!r}, but only {count} CUDA device(s) are visible"
            )
        import_cupy()

    def _buffer_device(self) -> torch.device:
        if self.device.type == "cuda" and self.device.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return self.device

    # --- transport hooks ---------------------------------------------------------------

    def _prepare_transport(self) -> dict[str, Any]:
        sweep_stale(self.socket_dir)
        self._listener = Listener(self.socket_dir)
        return {
            "socket": self._listener.path,
            "node": _node_identity(),
            "device": self.device.type,
            "bucket_size": self.bucket_size,
            "pid": os.getpid(),
        }

    def _check_peers(self, train_world_size: int, metadata: list[dict[str, Any]], *, moves_data: bool) -> None:
        """Every worker must run the same mode and bucket size; rollouts on policy rank 0's node."""
        owner = type(self).__name__
        node = _node_identity()
        for index, entry in enumerate(metadata):
            who = f"policy rank {index}" if index < train_world_size else f"rollout rank {index - train_world_size}"
            for key in ("socket", "node", "device", "bucket_size"):
                if key not in entry:
                    raise WireFormatError(
                        f"{owner}: metadata[{index}] ({who}) has no {key!r}: is it a cuda_ipc prepare() result?"
                    )
            if entry["device"] != self.device.type:
                raise EngineOptionError(
                    f"{owner}: {who} uses device kind {entry['device']!r}, this worker {self.device.type!r}: "
                    "every worker of one engine must use the same device kind"
                )
            if entry["bucket_size"] != self.bucket_size:
                raise EngineOptionError(
                    f"{owner}: {who} uses bucket_size {entry['bucket_size']!r}, this worker {self.bucket_size}: "
                    "pass the same bucket_size_bytes on every worker"
                )
            # Only policy rank 0 sends; other policy ranks may live anywhere.
            if moves_data and entry["node"] != node and (index == 0 or index >= train_world_size):
                raise BackendUnavailableError(
                    f"{owner}: {who} runs on node {entry['node']!r}, this worker on {node!r}: cuda_ipc "
                    "only connects processes on one node; use nccl or gloo_cpu across nodes"
                )
        if not isinstance(metadata[0]["socket"], str):
            raise WireFormatError(f"{owner}: metadata[0] has no valid control socket path: {metadata[0]['socket']!r}")

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | dict[int, BucketSender] | None:
        drains = self.topology.drains(worker_rank, train_world_size, rollout_world_size)
        self._check_peers(train_world_size, metadata, moves_data=not drains)
        if drains:
            self._close_listener()
            return None
        if self._listener is None:
            raise LifecycleError(
                f"{type(self).__name__}: a failed init closed this worker's control socket; call "
                "finalize(), then prepare() and init again on every worker"
            )
        destinations = self.topology.destinations(worker_rank, train_world_size, rollout_world_size)
        ranks: list[int | None] = list(destinations) if self.topology.separate_streams else [None]
        slots: dict[int | None, HostSlots | CudaSlots] = {}
        try:
            for rank in ranks:  # broadcast: one pair of slots for all; fanout: a pair per rank
                slots[rank] = self._allocate_slots()
        except BaseException:
            for allocated in slots.values():
                allocated.close()
            self._close_listener()  # rollouts already connecting learn of the failure at once
            raise
        channels: list[Channel] = []
        try:
            channels = _Handshake(self, slots, train_world_size, rollout_world_size, metadata).run()
        except BaseException:
            for channel in channels:
                channel.close()
            for allocated in slots.values():
                allocated.close()
            raise
        finally:
            self._close_listener()
        for allocated in slots.values():
            if isinstance(allocated, HostSlots):
                allocated.release_fd()
        if self.topology.separate_streams:
            return {
                rank: IpcSender(
                    slots[rank], [channels[rank]], wait_for_peers_on_close=isinstance(slots[rank], CudaSlots)
                )
                for rank in destinations
            }
        (shared,) = slots.values()
        return IpcSender(shared, channels, wait_for_peers_on_close=isinstance(shared, CudaSlots))

    def _allocate_slots(self) -> HostSlots | CudaSlots:
        device = self._buffer_device()
        if device.type == "cpu":
            host = HostSlots.allocate(self.bucket_size, NUM_SLOTS)
            self._host_slots.append(host)
            return host
        return CudaSlots.allocate(device, self.bucket_size, NUM_SLOTS)

    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        self._check_peers(train_world_size, metadata, moves_data=True)
        self._close_listener()
        deadline = Deadline(self.timeout_s)
        channel = Channel(connect(metadata[0]["socket"], deadline, _ROLLOUT_PEER), _ROLLOUT_PEER)
        try:
            slots = self._join(channel, rollout_rank, (train_world_size, rollout_world_size), metadata, deadline)
        except BaseException:
            channel.close()
            raise
        return IpcReceiver(slots, channel, self.timeout_s)

    def _join(
        self,
        channel: Channel,
        rollout_rank: int,
        world_sizes: tuple[int, int],
        metadata: list[dict[str, Any]],
        deadline: Deadline,
    ) -> HostSlots | CudaSlots:
        hello = {
            "type": "hello",
            "rollout_rank": rollout_rank,
            "engine_id": self._engine_id,
            "policy_engine_id": metadata[0]["engine_id"],
            "world_sizes": list(world_sizes),
        }
        channel.send_json(hello, deadline, "introducing this rollout")
        kind, body, fds = channel.recv_with_fds(deadline, "waiting for the shared buffers", max_fds=1)
        try:
            if kind is not Kind.CONTROL:
                raise WireFormatError(f"expected a welcome from {_ROLLOUT_PEER}, got a {kind.name} frame")
            welcome = decode_json(body, _ROLLOUT_PEER)
            if welcome["type"] == "reject":
                error = EngineOptionError if welcome.get("mismatch") is True else AuthenticationError
                raise error(f"{_ROLLOUT_PEER} refused this rollout: {welcome.get('reason')}")
            buffers = welcome.get("buffers")
            if welcome["type"] != "welcome" or not isinstance(buffers, dict):
                raise WireFormatError(f"expected a welcome with buffers from {_ROLLOUT_PEER}, got {welcome!r:.300}")
            if self.device.type == "cpu":
                if len(fds) != 1:
                    raise WireFormatError(f"{_ROLLOUT_PEER} sent {len(fds)} descriptors with its welcome, expected 1")
                host = HostSlots.attach(fds.pop(), buffers, self.bucket_size, NUM_SLOTS)
                self._host_slots.append(host)
                slots: HostSlots | CudaSlots = host
            else:
                slots = CudaSlots.attach(buffers, self._buffer_device(), self.bucket_size, NUM_SLOTS)
        except BaseException as exc:
            for fd in fds:
                os.close(fd)
            try:
                channel.send_json(
                    {"type": "error", "reason": f"{type(exc).__name__}: {exc}"}, deadline, "reporting a failure"
                )
            except TransferError:
                pass
            raise
        try:
            channel.send_json({"type": "ready"}, deadline, "confirming the mapping")
        except BaseException:
            slots.close()
            raise
        return slots

    def _release_transport(self) -> None:
        self._close_listener()
        # A refit that failed dropped its transport while its traceback, still alive then,
        # held views of the host slots in a reference cycle; collect it now so the mapping
        # goes with finalize().
        if any(slots.mapped for slots in self._host_slots):
            gc.collect()
        self._host_slots = [slots for slots in self._host_slots if slots.mapped]

    def _release_cached_memory(self) -> None:
        super()._release_cached_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _payload_checksum(self) -> Checksum | None:
        if not self.checksum:
            return None
        return device_payload_checksum if self.device.type == "cuda" else payload_checksum

    def _merge_device(self) -> torch.device | str | None:
        return None  # the slots' device: rollouts get tensors where their buffers are


class _Handshake:
    """Policy rank 0 meets every rollout rank: accept, check, hand out buffers, wait until mapped.

    Any local process of the same user can connect to the control socket, so connections wait
    in a lobby until their hello arrives, read as they become readable: one silent or slow
    connection holds up nobody, a malformed or unexpected one is refused and closed without
    failing the init, and the lobby holds at most ``LOBBY_SIZE`` strangers (the oldest is
    dropped for a new one) whose hellos may be at most ``HELLO_MAX_BYTES`` long.
    """

    LOBBY_SIZE = 64
    HELLO_MAX_BYTES = 4096

    def __init__(
        self,
        engine: CudaIpcCheckpointEngine,
        slots: dict[int | None, HostSlots | CudaSlots],
        train_world_size: int,
        rollout_world_size: int,
        metadata: list[dict[str, Any]],
    ) -> None:
        assert engine._listener is not None
        self.listener = engine._listener
        self.engine_id = engine._engine_id
        self.slots = slots
        self.train_world_size = train_world_size
        self.rollout_world_size = rollout_world_size
        self.metadata = metadata
        self.deadline = Deadline(engine.timeout_s)
        self.channels: dict[int, Channel] = {}
        self.lobby: dict[Channel, int] = {}  # connected, hello not read yet -> pid; oldest first
        self.owner = type(engine).__name__

    def run(self) -> list[Channel]:
        try:
            self._gather()
            shared = self.slots.get(None)  # broadcast: one pair of slots; fanout: one per rank
            for rank, channel in sorted(self.channels.items()):
                self._welcome(channel, shared if shared is not None else self.slots[rank])
            for _, channel in sorted(self.channels.items()):
                kind, body = channel.recv(self.deadline, "waiting for it to map the shared buffers")
                message = decode_json(body, channel.peer) if kind is Kind.CONTROL else {"type": kind.name}
                if message["type"] == "error":
                    raise TransferError(f"{channel.peer} could not map the shared buffers: {message.get('reason')}")
                if message["type"] != "ready":
                    raise WireFormatError(f"expected 'ready' from {channel.peer}, got {message['type']!r}")
        except BaseException:
            for channel in self.channels.values():
                channel.close()
            raise
        finally:
            for stranger in self.lobby:
                stranger.close()
            self.lobby = {}
        return [self.channels[rank] for rank in range(self.rollout_world_size)]

    def _gather(self) -> None:
        """Accept connections and read hellos, as each is ready, until every rank is in."""
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener.sock, selectors.EVENT_READ, None)
            while len(self.channels) < self.rollout_world_size:
                remaining = self.deadline.remaining()
                if remaining <= 0:
                    raise self._timeout("connect")
                for key, _ in selector.select(remaining):
                    if key.data is None:
                        self._accept(selector)
                    elif key.data in self.lobby:
                        self._hear(selector, key.data)

    def _accept(self, selector: selectors.BaseSelector) -> None:
        conn = self.listener.accept_now()
        if conn is None:
            return
        pid, uid, _ = peer_credentials(conn)
        stranger = Channel(conn, f"a process (pid {pid}) connecting to the control socket")
        if uid != os.getuid():
            self._refuse(stranger, f"it runs as uid {uid}, the policy as uid {os.getuid()}")
            return
        if len(self.lobby) >= self.LOBBY_SIZE:
            oldest = next(iter(self.lobby))
            self._leave(selector, oldest)
            oldest.close()
        self.lobby[stranger] = pid
        selector.register(stranger.sock, selectors.EVENT_READ, stranger)

    def _leave(self, selector: selectors.BaseSelector, stranger: Channel) -> None:
        selector.unregister(stranger.sock)
        del self.lobby[stranger]

    def _hear(self, selector: selectors.BaseSelector, stranger: Channel) -> None:
        """Read what ``stranger`` sent; once it is a whole frame, admit or refuse it."""
        try:
            frames = stranger.read_ready("waiting for its hello")
            if not frames and stranger.buffered > self.HELLO_MAX_BYTES:
                raise WireFormatError(f"its hello exceeds {self.HELLO_MAX_BYTES} bytes")
        except PeerLostError:  # it gave up before saying anything (a stale-directory probe, say)
            self._leave(selector, stranger)
            stranger.close()
            return
        except WireFormatError as exc:
            self._leave(selector, stranger)
            self._refuse(stranger, f"it sent a malformed frame ({exc})")
            return
        if not frames:
            return
        pid = self.lobby[stranger]
        self._leave(selector, stranger)
        kind, body = frames[0]
        try:
            hello = decode_json(body, stranger.peer) if kind is Kind.CONTROL else {"type": kind.name}
        except WireFormatError as exc:
            self._refuse(stranger, f"its hello is malformed ({exc})")
            return
        self._admit(stranger, pid, hello)

    def _timeout(self, step: str) -> TransferTimeoutError:
        missing = sorted(set(range(self.rollout_world_size)) - set(self.channels))
        return TransferTimeoutError(
            f"policy rank 0 waited timeout_s={self.deadline.timeout_s:g}s for rollout ranks {missing} to "
            f"{step} to its control socket; have they called init_rollout_process_group with the same "
            "metadata?"
        )

    def _admit(self, stranger: Channel, pid: int, hello: dict[str, Any]) -> None:
        """Keep the connection if ``hello`` is an expected rollout's, else refuse it."""
        rank = hello.get("rollout_rank")
        if hello.get("type") != "hello" or hello.get("policy_engine_id") != self.engine_id:
            self._refuse(stranger, "it is not a rollout of this engine (wrong message or engine id)")
            return
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < self.rollout_world_size:
            self._refuse(stranger, f"rollout_rank {rank!r} is outside [0, {self.rollout_world_size})")
            return
        if hello.get("engine_id") != self.metadata[self.train_world_size + rank].get("engine_id"):
            self._refuse(stranger, f"its engine id is not the one rollout rank {rank} gave in the metadata")
            return
        if rank in self.channels:
            self._refuse(stranger, f"rollout rank {rank} is already connected")
            return
        mine = [self.train_world_size, self.rollout_world_size]
        if hello.get("world_sizes") != mine:
            reason = (
                f"rollout rank {rank} was initialized with (train_world_size, rollout_world_size) = "
                f"{hello.get('world_sizes')!r}, policy rank 0 with {mine!r}: pass the same world sizes "
                "to every worker"
            )
            self._refuse(stranger, reason, mismatch=True)
            raise EngineOptionError(f"{self.owner}: {reason}")
        self.channels[rank] = Channel(stranger.sock, f"rollout rank {rank} (pid {pid})")

    def _refuse(self, channel: Channel, reason: str, *, mismatch: bool = False) -> None:
        try:
            channel.send_json({"type": "reject", "reason": reason, "mismatch": mismatch}, self.deadline, "refusing it")
        except TransferError:
            pass
        channel.close()

    def _welcome(self, channel: Channel, slots: HostSlots | CudaSlots) -> None:
        message = {"type": "welcome", "buffers": slots.describe()}
        if isinstance(slots, HostSlots):
            fd = slots.open_reader_fd()
            try:
                channel.send_json(message, self.deadline, "handing it the shared buffers", fds=[fd])
            finally:
                os.close(fd)
        else:
            channel.send_json(message, self.deadline, "handing it the shared buffers")
