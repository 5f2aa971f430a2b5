"""A store whose connection to the rendezvous can be cut once groups have formed.

Gloo groups keep a reference to the store they were built on for their whole life, so the
``TCPStore`` served by policy rank 0 used to stay open, unauthenticated, as long as the
engine: any client could write keys into it and grow that process's memory without bound.
Groups are built on a :class:`DetachableStore` instead; :meth:`DetachableStore.detach` drops
its ``TCPStore`` once every member's groups have formed, which closes the server (policy
rank 0) or the client connection (everyone else). Groups never use the store after forming
(unless ``TORCH_GLOO_LAZY_INIT`` is set: then the store is never detached, see
:func:`ckpt_core._internal.fence.lazy_init`).
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ckpt_core.errors import PeerLostError, WireFormatError

MAX_HOST_CHARS = 253
"""The longest host name DNS allows; a longer ``host`` in a peer's metadata is refused at once."""

_RETRY_S = 0.05


def join_store(host: Any, port: Any, timeout_s: float, *, who: str) -> Any:
    """A ``TCPStore`` client of the store ``who`` serves at ``host:port``, reached within
    ``timeout_s`` or ``PeerLostError`` saying how long it tried.

    ``TCPStore`` alone has no such deadline: it retries a refused connection for up to about
    twice its timeout, and it waits without end on a socket that accepts connections but is
    never served. So this side first connects itself, retrying until the deadline, and starts
    the client only once the socket accepts (the server listens only while it serves, see
    ``DistributedEngine._prepare_transport``); the client is then built on a helper thread,
    given what is left of the deadline. A client that still hangs (its server froze after it
    began to listen) is abandoned on that thread, which ends when the server's process does.
    The store keeps ``timeout_s`` as the timeout of its later operations.
    """
    if not isinstance(host, str) or not 0 < len(host) <= MAX_HOST_CHARS:
        shown = f"{host[:40]!r}... ({len(host)} characters)" if isinstance(host, str) else repr(host)[:80]
        raise WireFormatError(f"{who}'s metadata has no valid host: {shown}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise WireFormatError(f"{who}'s metadata has no valid port: {port!r}")
    start = time.monotonic()
    deadline = start + timeout_s
    last_error = _wait_until_served(host, port, deadline)
    if last_error is not None:
        raise PeerLostError(
            f"cannot reach {who}'s rendezvous at {host}:{port}: gave up after {time.monotonic() - start:.1f}s "
            f"(timeout_s={timeout_s:g}; last error: {last_error}). It has not started its init, its init failed "
            "before serving the rendezvous, or it is gone: check that worker's own error"
        )
    result: list[Any] = []

    def connect() -> None:
        try:
            left = max(0.1, deadline - time.monotonic())
            result.append(dist.TCPStore(host, port, None, False, timedelta(seconds=left)))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            result.append(exc)

    thread = threading.Thread(target=connect, name="ckpt-rendezvous-client", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
    if not result:
        raise PeerLostError(
            f"{who}'s rendezvous at {host}:{port} accepted the connection but did not answer: gave up after "
            f"{time.monotonic() - start:.1f}s (timeout_s={timeout_s:g}); is that process stopped?"
        )
    store = result[0]
    if isinstance(store, BaseException):
        raise PeerLostError(
            f"cannot reach {who}'s rendezvous at {host}:{port}: gave up after {time.monotonic() - start:.1f}s "
            f"(timeout_s={timeout_s:g}): {str(store).splitlines()[0] if str(store) else type(store).__name__}"
        ) from store
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


def _wait_until_served(host: str, port: int, deadline: float) -> str | None:
    """Connect to ``host:port`` until it accepts (``None``) or ``deadline`` passes (the last
    error, as text)."""
    last = "no attempt before the deadline"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return last
        try:
            with socket.create_connection((host, port), timeout=min(left, 2.0)):
                return None
        except (OSError, UnicodeError) as exc:  # refused, unreachable, unresolvable, timed out
            last = f"{type(exc).__name__}: {exc}"
        time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))


class DetachableStore(dist.Store):
    """Forwards every call to ``inner`` until :meth:`detach`; then each raises ``RuntimeError``,
    but ``check``, which answers ``False``: a ``ProcessGroupNCCL``'s heartbeat monitor asks its
    store every second whether a debug dump was requested (``check(["exception_dump"])``) and
    logs an error for each failed ask; none can be requested through a closed rendezvous."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self._inner = inner
        self.checks_after_detach = 0
        """How many ``check`` calls this store answered itself since :meth:`detach`."""

    def detach(self) -> None:
        self._inner = None

    @property
    def attached(self) -> bool:
        return self._inner is not None

    def _store(self) -> Any:
        if self._inner is None:
            raise RuntimeError(
                "the rendezvous store was closed after the groups formed; an operation that needs it (a new "
                "communicator) cannot run any more"
            )
        return self._inner

    def set(self, key: str, value: Any) -> None:
        self._store().set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store().get(key))

    def add(self, key: str, value: int) -> int:
        return int(self._store().add(key, value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._store().compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        if self._inner is None:
            self.checks_after_detach += 1
            return False
        return bool(self._inner.check(keys))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self._store().wait(keys)
        else:
            self._store().wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return bool(self._store().delete_key(key))

    def num_keys(self) -> int:
        return int(self._store().num_keys())
