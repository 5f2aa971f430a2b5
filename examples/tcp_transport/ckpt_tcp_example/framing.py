"""Length-prefixed messages over one TCP connection, every wait bounded by a deadline.

A message is ``[header length: u64][payload length: u64][header][payload]`` (big-endian).
A bucket is one message (the core's header bytes, then the packed payload); the hello and
welcome of the rendezvous are JSON headers with no payload. Nothing is ever unpickled.

Errors are the core's types: a peer that closes the connection or dies raises
``PeerLostError`` at once; a wait past its deadline raises ``TransferTimeoutError``; bytes that
cannot be a message raise ``WireFormatError``.
"""

from __future__ import annotations

import functools
import json
import socket
import struct
import time
from typing import Any

from ckpt_core.errors import PeerLostError, TransferTimeoutError, WireFormatError

PREFIX = struct.Struct("!QQ")
MAX_HEADER_BYTES = 64 << 20
"""Larger header lengths are refused as garbage (a refit of a million tiny tensors stays below)."""


class Deadline:
    """The moment by which one operation (all of its socket waits) must be done."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    def remaining(self, what: str, peer: str) -> float:
        """Seconds left; ``TransferTimeoutError`` naming ``what`` and ``peer`` if none are."""
        left = self._end - time.monotonic()
        if left <= 0:
            raise TransferTimeoutError(f"{what} with {peer}: no progress within timeout_s={self.timeout_s:g}s")
        return left


class Connection:
    """One connected TCP socket and the name of the process at its other end."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.peer = peer

    # --- sending -----------------------------------------------------------------------------

    def send(self, header: bytes, payload: memoryview | None, deadline: Deadline, what: str) -> None:
        """Send one message; returns once its bytes are in the kernel's socket buffer."""
        nbytes = 0 if payload is None else payload.nbytes
        self._io(what, deadline, lambda: self.sock.sendall(PREFIX.pack(len(header), nbytes) + header))
        if nbytes:
            assert payload is not None
            self._io(what, deadline, lambda: self.sock.sendall(payload))

    def send_json(self, message: dict[str, Any], deadline: Deadline, what: str) -> None:
        self.send(json.dumps(message).encode(), None, deadline, what)

    # --- receiving -----------------------------------------------------------------------------

    def recv_header(self, deadline: Deadline, what: str, max_payload: int) -> tuple[bytes, int]:
        """The next message's header bytes and the length of the payload that follows it."""
        prefix = bytearray(PREFIX.size)
        self.recv_into(memoryview(prefix), deadline, what)
        header_len, payload_len = PREFIX.unpack(prefix)
        if not 0 < header_len <= MAX_HEADER_BYTES or payload_len > max_payload:
            raise WireFormatError(
                f"{what}: {self.peer} announced a {header_len}-byte header and a {payload_len}-byte "
                f"payload (limits {MAX_HEADER_BYTES} and {max_payload}); the stream is corrupt or "
                "the peer runs another protocol"
            )
        header = bytearray(header_len)
        self.recv_into(memoryview(header), deadline, what)
        return bytes(header), payload_len

    def recv_json(self, deadline: Deadline, what: str) -> dict[str, Any]:
        header, payload_len = self.recv_header(deadline, what, max_payload=0)
        try:
            message = json.loads(header)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise WireFormatError(f"{what}: {self.peer} sent a message that is not JSON ({exc})") from None
        if not isinstance(message, dict):
            raise WireFormatError(f"{what}: {self.peer} sent {message!r:.100}, not a JSON object")
        return message

    def recv_into(self, view: memoryview, deadline: Deadline, what: str) -> None:
        """Fill ``view`` completely from the socket."""
        got = 0
        while got < view.nbytes:
            n = self._io(what, deadline, functools.partial(self.sock.recv_into, view[got:]))
            if n == 0:
                raise PeerLostError(f"{what}: {self.peer} closed the connection (it exited, was killed or finalized)")
            got += n

    # --- both ------------------------------------------------------------------------------------

    def _io(self, what: str, deadline: Deadline, op: Any) -> Any:
        self.sock.settimeout(deadline.remaining(what, self.peer))
        try:
            return op()
        except TimeoutError:
            raise TransferTimeoutError(
                f"{what} with {self.peer}: no progress within timeout_s={deadline.timeout_s:g}s"
            ) from None
        except OSError as exc:  # reset, broken pipe, closed socket: the peer is gone
            raise PeerLostError(f"{what} with {self.peer} failed, the peer is gone: {exc}") from exc

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
