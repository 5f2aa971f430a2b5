"""``TcpExampleEngine``: refit over plain TCP sockets, written only against ckpt-core's public API.

How peers meet: every worker opens a listening socket in ``prepare()`` (the role is not known
yet) and advertises it in its metadata. At init, policy rank 0 keeps its listener and accepts
one connection per rollout rank; each rollout connects to ``metadata[0]`` (policy rank 0),
says hello with its rank and policy rank 0's ``engine_id`` (which only holders of this
prepare round's metadata know), and waits for the welcome. Other listeners are closed.

How one buffer moves: policy rank 0 sends each bucket (header, then payload) to every rollout
in turn (a broadcast); a rollout reads the payload straight into its slot buffer. Other policy
ranks have no receiver: ``BucketedEngine`` drains their weights.

Everything else (packing, headers, checksums, reassembly, lifecycle checks, statistics,
hooks) is ``BucketedEngine``'s.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from ckpt_core.errors import EngineOptionError, PeerLostError, TransferError, TransferTimeoutError, WireFormatError
from ckpt_core.transport import BackendCapabilities, BucketedEngine, BucketReceiver, BucketSender, Option

from .framing import Connection, Deadline


class TcpSender(BucketSender):
    """Policy rank 0's end: two slot buffers and one connection per rollout rank (by rank)."""

    def __init__(self, connections: list[Connection], bucket_size: int) -> None:
        self._connections = connections
        self._buffers = [torch.empty(bucket_size, dtype=torch.uint8) for _ in range(self.num_slots)]

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def post(
        self, slot: int, header: bytes, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()
    ) -> None:
        # direct_chunks is False (one message per bucket keeps the framing simple), so the
        # pipeline packs every chunk and `direct` is always empty.
        deadline = Deadline(timeout_s)
        view = self._buffers[slot][:nbytes].numpy().data
        try:
            for connection in self._connections:
                connection.send(header, view, deadline, "sending a bucket")
        except TransferError:
            # Close every connection, so the other rollouts fail at once instead of timing out.
            self.close()
            raise

    def wait_slot(self, slot: int, timeout_s: float) -> None:
        """Nothing to wait for: ``post`` returns once the bytes are in the kernel's buffers."""

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections = []
        self._buffers = []


class TcpReceiver(BucketReceiver):
    """A rollout rank's end: two slot buffers and its connection to policy rank 0."""

    def __init__(self, connection: Connection, bucket_size: int) -> None:
        self._connection: Connection | None = connection
        self._bucket_size = bucket_size
        self._buffers = [torch.empty(bucket_size, dtype=torch.uint8) for _ in range(self.num_slots)]
        self._announced = 0  # payload length of the last header's message
        self._pending = [0] * self.num_slots

    def _link(self) -> Connection:
        if self._connection is None:
            raise PeerLostError("this rollout's connection to policy rank 0 is closed; init again")
        return self._connection

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def recv_header(self, timeout_s: float) -> bytes:
        header, self._announced = self._link().recv_header(
            Deadline(timeout_s), "receiving a bucket header", max_payload=self._bucket_size
        )
        return header

    def post_payload(self, slot: int, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()) -> None:
        if nbytes != self._announced:
            raise WireFormatError(f"bucket header says {nbytes} payload bytes, its message carries {self._announced}")
        self._pending[slot] = nbytes  # the bytes follow the header on the stream: read them in wait

    def wait_payload(self, slot: int, timeout_s: float) -> None:
        nbytes, self._pending[slot] = self._pending[slot], 0
        if nbytes:
            view = self._buffers[slot].numpy().data[:nbytes]
            self._link().recv_into(view, Deadline(timeout_s), "receiving a bucket payload")

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
        self._connection = None
        self._buffers = []


class TcpExampleEngine(BucketedEngine):
    """Refit over TCP: policy rank 0 to every rollout rank (see the module docstring).

    Its options are ``BucketedEngine``'s plus ``host``, declared once in ``options`` and listed
    at the end of this docstring; the constructor reads them from ``self.option_values``.
    """

    backend_name: ClassVar[str] = "tcp_example"
    capabilities: ClassVar[BackendCapabilities] = BackendCapabilities(
        devices=("cpu",), topologies=("broadcast",), placements=("colocated", "disaggregated")
    )

    options = BucketedEngine.options.extend(
        Option.text(
            "host",
            "127.0.0.1",
            "the address this worker listens on and advertises; set the node's address across machines",
            noun="address string",
        )
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)  # parses every option through `options` above
        self.host: str = self.option_values.host
        self._listener: socket.socket | None = None

    # --- how peers meet ----------------------------------------------------------------------

    def _prepare_transport(self) -> dict[str, Any]:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            self._listener = socket.create_server((self.host, 0), family=family, backlog=128)
        except OSError as exc:
            raise EngineOptionError(
                f"TcpExampleEngine: cannot listen on host={self.host!r} ({exc}); set host to an address of this machine"
            ) from exc
        return {"host": self.host, "port": self._listener.getsockname()[1]}

    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | None:
        if worker_rank != 0:
            self._close_listener()
            return None
        connections = self._accept_rollouts(rollout_world_size, metadata[0]["engine_id"], Deadline(self.timeout_s))
        self._close_listener()
        return TcpSender(connections, self.bucket_size)

    def _accept_rollouts(self, count: int, engine_id: str, deadline: Deadline) -> list[Connection]:
        assert self._listener is not None
        joined: dict[int, Connection] = {}
        try:
            while len(joined) < count:
                missing = sorted(set(range(count)) - set(joined))
                try:
                    self._listener.settimeout(
                        deadline.remaining("waiting for rollout ranks to connect", f"rollout ranks {missing}")
                    )
                    sock, address = self._listener.accept()
                except TimeoutError:
                    raise TransferTimeoutError(
                        f"policy rank 0: rollout ranks {missing} did not connect within timeout_s={self.timeout_s:g}s"
                    ) from None
                connection = Connection(sock, f"a rollout at {address[0]}:{address[1]}")
                rank = self._admit(connection, count, engine_id, joined, deadline)
                if rank is not None:
                    joined[rank] = connection
        except BaseException:
            for connection in joined.values():
                connection.close()
            raise
        return [joined[rank] for rank in range(count)]

    def _admit(
        self, connection: Connection, count: int, engine_id: str, joined: dict[int, Connection], deadline: Deadline
    ) -> int | None:
        """The rollout rank of a valid hello (answered with a welcome); ``None`` if refused."""
        try:
            hello = connection.recv_json(deadline, "reading a rollout's hello")
            rank = hello.get("rollout_rank")
            if hello.get("engine_id") != engine_id:
                reason = "it was given another prepare round's metadata"
            elif not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < count:
                reason = f"rollout_rank {rank!r} is not in [0, {count})"
            elif rank in joined:
                reason = f"rollout rank {rank} is already connected"
            else:
                connection.peer = f"rollout rank {rank}"
                connection.send_json({"welcome": True}, deadline, "welcoming a rollout")
                return rank
            connection.send_json({"refused": reason}, deadline, "refusing a connection")
        except (TransferError, WireFormatError):
            pass  # a stray or broken connection must not stop the rollouts that are expected
        connection.close()
        return None

    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        self._close_listener()
        host, port = metadata[0].get("host"), metadata[0].get("port")
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
            raise WireFormatError(f"metadata[0] (policy rank 0) has no valid host/port: {host!r}:{port!r}")
        deadline = Deadline(self.timeout_s)
        try:
            sock = socket.create_connection((host, port), timeout=deadline.remaining("connecting", "policy rank 0"))
        except OSError as exc:
            raise PeerLostError(f"cannot reach policy rank 0 at {host}:{port}: {exc}") from exc
        connection = Connection(sock, "policy rank 0")
        try:
            hello = {"engine_id": metadata[0]["engine_id"], "rollout_rank": rollout_rank}
            connection.send_json(hello, deadline, "saying hello")
            answer = connection.recv_json(deadline, "waiting for the welcome")
            if answer.get("welcome") is not True:
                raise WireFormatError(
                    f"policy rank 0 refused rollout rank {rollout_rank}: {answer.get('refused', answer)}"
                )
        except BaseException:
            connection.close()
            raise
        return TcpReceiver(connection, self.bucket_size)

    def _release_transport(self) -> None:
        self._close_listener()

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
