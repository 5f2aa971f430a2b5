"""The local control channel: length-prefixed frames over a Unix domain socket.

Every frame is a 5-byte prefix (``kind``: 1 byte, ``length``: 4 bytes, big-endian) and then
``length`` bytes of body. Control messages are JSON objects; bucket headers are the core's wire
bytes, passed through unchanged. Nothing is ever unpickled.

Every blocking call takes a :class:`Deadline`. Running past it raises
``TransferTimeoutError``; a peer that closes its end (it exited, was killed, or finalized)
raises ``PeerLostError`` at once, naming the peer and what this side was doing.

A listener lives in a private directory (mode 0700, made by ``tempfile.mkdtemp``), so only
processes of the same user can reach it; the policy also checks each connection's
``SO_PEERCRED``.
"""

from __future__ import annotations

import contextlib
import enum
import json
import math
import os
import select
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ckpt_core.errors import PeerLostError, TransferError, TransferTimeoutError, WireFormatError
from ckpt_core.transport.wire import MAX_HEADER_BYTES

_PREFIX = struct.Struct("!BI")
MAX_FRAME_BYTES = MAX_HEADER_BYTES + (1 << 16)
DIR_PREFIX = "ckpt-cuda-ipc-"
SOCKET_NAME = "ctl"
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, one of them the terminating NUL
_RECV_CHUNK = 1 << 16


class Kind(enum.IntEnum):
    """What a frame's body is."""

    CONTROL = 1
    """A JSON object with a ``"type"`` field (hello, welcome, ready, reject, error, bye)."""
    HEADER = 2
    """A bucket header (``ckpt_core._internal.wire`` bytes); its payload is already in the slot."""
    ABORT = 3
    """A bucket header that voids the refit; receivers do not release anything after it."""
    RELEASE = 4
    """One byte: the slot the receiver is done reading."""


class Deadline:
    """A point in time every wait of one operation must finish by."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._end = time.monotonic() + timeout_s

    def remaining(self) -> float:
        return self._end - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0


def encode_json(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def decode_json(body: bytes, peer: str) -> dict[str, Any]:
    """A control message from ``peer``; ``WireFormatError`` unless it is a JSON object with a type."""
    try:
        message = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise WireFormatError(f"control message from {peer} is not valid JSON ({exc})") from None
    if not isinstance(message, dict) or not isinstance(message.get("type"), str):
        raise WireFormatError(f"control message from {peer} must be a JSON object with a 'type', got {message!r:.200}")
    return message


def lost(peer: str, phase: str, cause: object) -> PeerLostError:
    return PeerLostError(
        f"{peer} is gone while {phase} ({cause}): its process exited, was killed, or finalized its "
        "engine; this refit is void, re-initialize every worker"
    )


def timed_out(peer: str, phase: str, timeout_s: float) -> TransferTimeoutError:
    return TransferTimeoutError(
        f"no word from {peer} within timeout_s={timeout_s:g}s while {phase}; the peer is stuck "
        "or much slower than expected (raise timeout_s if it is only slow)"
    )


class Channel:
    """One connected control socket to one named peer, with its partly read frames."""

    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self._inbox = bytearray()
        self.closed = False

    def fileno(self) -> int:
        return self.sock.fileno()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as whole frames."""
        return len(self._inbox)

    def send(self, kind: Kind, body: bytes, deadline: Deadline, phase: str, fds: Sequence[int] = ()) -> None:
        """Send one frame (and ``fds`` with its first byte), all of it, by ``deadline``."""
        data = _PREFIX.pack(int(kind), len(body)) + body
        try:
            if fds:
                self.sock.settimeout(max(deadline.remaining(), 1e-3))
                sent = socket.send_fds(self.sock, [data], list(fds))
                data = data[sent:]
            if data:
                self.sock.settimeout(max(deadline.remaining(), 1e-3))
                self.sock.sendall(data)
        except TimeoutError:
            raise timed_out(self.peer, phase, deadline.timeout_s) from None
        except OSError as exc:  # EPIPE, ECONNRESET, EBADF after close
            raise lost(self.peer, phase, exc) from None

    def send_json(self, message: dict[str, Any], deadline: Deadline, phase: str, fds: Sequence[int] = ()) -> None:
        self.send(Kind.CONTROL, encode_json(message), deadline, phase, fds)

    def recv(self, deadline: Deadline, phase: str) -> tuple[Kind, bytes]:
        """Block for the next frame; ``TransferTimeoutError`` past ``deadline``."""
        while True:
            frame = self._pop_frame()
            if frame is not None:
                return frame
            remaining = deadline.remaining()
            if remaining <= 0:
                raise timed_out(self.peer, phase, deadline.timeout_s)
            self._fill(remaining, phase, deadline.timeout_s)

    def recv_with_fds(self, deadline: Deadline, phase: str, max_fds: int) -> tuple[Kind, bytes, list[int]]:
        """Like :meth:`recv`, also taking the file descriptors sent with the frame's first byte.

        The caller owns the returned descriptors (and must close them).
        """
        fds: list[int] = []
        try:
            while True:
                frame = self._pop_frame()
                if frame is not None:
                    return frame[0], frame[1], fds
                remaining = deadline.remaining()
                if remaining <= 0:
                    raise timed_out(self.peer, phase, deadline.timeout_s)
                self.sock.settimeout(remaining)
                try:
                    data, got, flags, _ = socket.recv_fds(self.sock, _RECV_CHUNK, max_fds)
                except TimeoutError:
                    raise timed_out(self.peer, phase, deadline.timeout_s) from None
                except OSError as exc:
                    raise lost(self.peer, phase, exc) from None
                fds.extend(got)
                if flags & socket.MSG_CTRUNC:
                    raise WireFormatError(f"{self.peer} sent more than {max_fds} file descriptors while {phase}")
                if not data:
                    raise lost(self.peer, phase, "it closed the connection")
                self._inbox += data
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise

    def read_ready(self, phase: str) -> list[tuple[Kind, bytes]]:
        """Read what the socket holds now (it was reported readable) and return whole frames."""
        self._fill(None, phase, 0.0)
        frames = []
        while (frame := self._pop_frame()) is not None:
            frames.append(frame)
        return frames

    def drain(self) -> list[tuple[Kind, bytes]]:
        """Whole frames already received or readable without waiting, up to the peer's EOF.

        For reading what a peer said before it closed its end; never raises for a lost peer.
        """
        frames = []
        while True:
            while (frame := self._pop_frame()) is not None:
                frames.append(frame)
            before = len(self._inbox)
            try:
                self._fill(None, "reading what it sent before it closed", 0.0)
            except TransferError:
                return frames
            if len(self._inbox) == before:
                return frames

    def _fill(self, timeout_s: float | None, phase: str, total_timeout_s: float) -> None:
        """Read once: waiting up to ``timeout_s``, or not at all when it is ``None``."""
        try:
            if timeout_s is None:
                self.sock.setblocking(False)
            else:
                self.sock.settimeout(timeout_s)
            data = self.sock.recv(_RECV_CHUNK)
        except TimeoutError:
            if timeout_s is None:
                return
            raise timed_out(self.peer, phase, total_timeout_s) from None
        except BlockingIOError:
            return
        except OSError as exc:
            raise lost(self.peer, phase, exc) from None
        if not data:
            raise lost(self.peer, phase, "it closed the connection")
        self._inbox += data

    def _pop_frame(self) -> tuple[Kind, bytes] | None:
        if len(self._inbox) < _PREFIX.size:
            return None
        kind, length = _PREFIX.unpack_from(self._inbox)
        if length > MAX_FRAME_BYTES:
            raise WireFormatError(f"frame of {length} bytes from {self.peer} exceeds {MAX_FRAME_BYTES}")
        try:
            kind = Kind(kind)
        except ValueError:
            raise WireFormatError(f"unknown frame kind {kind} from {self.peer}") from None
        end = _PREFIX.size + length
        if len(self._inbox) < end:
            return None
        body = bytes(self._inbox[_PREFIX.size : end])
        del self._inbox[:end]
        return kind, body

    def wait_closed(self, deadline: Deadline) -> bool:
        """Discard incoming data until the peer closes its end; whether it did by ``deadline``."""
        while not deadline.expired():
            try:
                self.sock.settimeout(max(deadline.remaining(), 1e-3))
                if not self.sock.recv(_RECV_CHUNK):
                    return True
            except TimeoutError:
                return False
            except OSError:
                return True
        return False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


def readable_now(channels: Sequence[Channel]) -> list[Channel]:
    """The channels with data (or EOF) to read at once, without waiting."""
    return _poll(channels, 0)


def wait_readable(channels: Iterable[Channel], deadline: Deadline) -> list[Channel]:
    """The channels with data (or EOF) to read, waiting at most until ``deadline``; [] past it."""
    remaining = deadline.remaining()
    if remaining <= 0:
        return []
    return _poll(list(channels), math.ceil(remaining * 1000))


def _poll(channels: Sequence[Channel], timeout_ms: int) -> list[Channel]:
    """The channels readable within ``timeout_ms``, in their order. ``poll``, not ``select``:
    a process may hold descriptors past ``select``'s 1024, and one call makes no descriptor of
    its own (an ``epoll`` selector makes and closes one per wait)."""
    poller = select.poll()
    for channel in channels:
        poller.register(channel.sock, select.POLLIN)
    ready = {fd for fd, _ in poller.poll(timeout_ms)}
    return [channel for channel in channels if channel.sock.fileno() in ready]


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


class Listener:
    """A Unix socket listening in its own private (0700) directory, until :meth:`close`."""

    def __init__(self, parent: str) -> None:
        self.directory = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=parent)
        self.path = os.path.join(self.directory, SOCKET_NAME)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.path)
            self.sock.listen(1024)
        except BaseException:
            self.close()
            raise

    def accept_now(self) -> socket.socket | None:
        """A connection waiting to be accepted, or ``None`` if there is none right now."""
        self.sock.setblocking(False)
        try:
            conn, _ = self.sock.accept()
        except (BlockingIOError, InterruptedError):
            return None
        conn.setblocking(True)
        return conn

    def close(self) -> None:
        """Stop listening and remove the socket file and its directory. Idempotent."""
        self.sock.close()
        shutil.rmtree(self.directory, ignore_errors=True)


def connect(path: str, deadline: Deadline, peer: str) -> socket.socket:
    """Connect to the listener at ``path``; a missing or dead listener is ``PeerLostError`` at once."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(max(deadline.remaining(), 1e-3))
        sock.connect(path)
    except TimeoutError:
        sock.close()
        raise timed_out(peer, f"connecting to its control socket {path}", deadline.timeout_s) from None
    except OSError as exc:
        sock.close()
        raise PeerLostError(
            f"cannot reach {peer}'s control socket {path} ({exc}): it exited or finalized after "
            "prepare(), or runs on another node or in another mount namespace (cuda_ipc only "
            "connects processes that share a node and a filesystem view)"
        ) from None
    return sock


def check_socket_parent(parent: str) -> str | None:
    """Why ``parent`` cannot hold control sockets, or ``None`` if it can."""
    if not os.path.isdir(parent):
        return f"{parent!r} is not an existing directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent!r} is not writable by this user"
    # mkdtemp adds the prefix, a pid and 8 random characters; then "/ctl".
    longest = len(os.path.abspath(parent)) + 1 + len(DIR_PREFIX) + 10 + 1 + 8 + 1 + len(SOCKET_NAME)
    if longest > _MAX_SOCKET_PATH:
        return (
            f"{parent!r} is too long for a Unix socket path ({longest} > {_MAX_SOCKET_PATH} "
            "bytes with the socket's own name); choose a shorter directory"
        )
    return None


def sweep_stale(parent: str) -> list[str]:
    """Remove control directories left in ``parent`` by processes killed before they cleaned up.

    A directory is stale only when it is ours (same uid), the pid in its name is not alive,
    and nothing listens on its socket any more; anything else is left alone. Returns what
    was removed.
    """
    removed: list[str] = []
    try:
        entries = os.listdir(parent)
    except OSError:
        return removed
    for name in entries:
        if not name.startswith(DIR_PREFIX):
            continue
        directory = os.path.join(parent, name)
        pid_text = name[len(DIR_PREFIX) :].split("-", 1)[0]
        try:
            if os.lstat(directory).st_uid != os.getuid() or not pid_text.isdigit():
                continue
        except OSError:
            continue
        if _alive(int(pid_text)) or _listening(os.path.join(directory, SOCKET_NAME)):
            continue
        shutil.rmtree(directory, ignore_errors=True)
        removed.append(directory)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _listening(path: str) -> bool:
    if not os.path.exists(path):
        return False
    with contextlib.closing(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True
