"""Fencing Gloo's listening sockets once a group has formed.

Every Gloo device listens on a TCP port for its group's pair connections, and keeps listening
for the device's whole life. A connection that is not one of its pairs is never closed: Gloo
reads it for a sequence number no pair waits for, or parks it for one that may come later,
so each stranger's connection costs the process a descriptor until the group dies (one
connect-and-close each: 200 connections, 200 descriptors, measured). When descriptors run out,
Gloo's accept fails on its event-loop thread and the process aborts. Gloo offers no way to
close its listener, and closing a descriptor behind its back would leave its event loop
pointing at whatever reuses the number. What does work from outside: a socket filter that
drops every packet (classic BPF ``ret #0``, locked so it cannot be removed) attached to the
listening socket. New SYNs are dropped before a connection exists, so strangers time out
connecting and the process never sees them; the group's own pair connections are separate
sockets, created before the fence, and are not affected.

:func:`gloo_device` creates a device and finds its listener (the one listening socket that
appeared while it was created, under a process-wide lock); :meth:`ListenerFence.apply`
fences it once this worker's group has formed (its pairs are then connected at both ends).
Where another thread opens a listener at the same moment, the two cannot be told apart and no
fence is made. With ``TORCH_GLOO_LAZY_INIT`` set, Gloo connects pairs on first use, so no
fence is made either (the listener must stay open).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
from typing import Any

import torch.distributed as dist

_SO_ATTACH_FILTER = 26
_SO_LOCK_FILTER = 44
_LISTEN = "0A"
_LOCK = threading.Lock()
_DROP_ALL = (ctypes.c_ubyte * 8)(0x06, 0, 0, 0, 0, 0, 0, 0)  # BPF_RET | BPF_K, k = 0: keep 0 bytes


class ListenerFence:
    """One listening socket of this process, by descriptor and inode, to be fenced later."""

    def __init__(self, fd: int, inode: str) -> None:
        self.fd = fd
        self.inode = inode

    def apply(self) -> bool:
        """Drop every packet the listener receives from now on. ``False`` (and nothing done)
        if the descriptor no longer is that socket (its group was destroyed meanwhile)."""
        try:
            if os.readlink(f"/proc/self/fd/{self.fd}") != f"socket:[{self.inode}]":
                return False
            dup = os.dup(self.fd)
        except OSError:
            return False
        with socket.socket(fileno=dup) as sock:  # closes the duplicate only
            program = struct.pack("@HP", len(_DROP_ALL) // 8, ctypes.addressof(_DROP_ALL))
            sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, program)
            sock.setsockopt(socket.SOL_SOCKET, _SO_LOCK_FILTER, 1)
        return True


def gloo_device(host: str) -> tuple[Any, ListenerFence | None]:
    """A Gloo device bound to ``host``'s interface, and the fence of its listener (``None``
    where it cannot be told apart, or where lazy init needs it open)."""
    with _LOCK:
        before = _listening_sockets()
        device = dist.ProcessGroupGloo.create_device(hostname=host)
        after = _listening_sockets()
    new = set(after.items()) - set(before.items())
    if lazy_init() or len(new) != 1:
        return device, None
    return device, ListenerFence(*new.pop())


def lazy_init() -> bool:
    """Whether Gloo connects pairs on first use (``TORCH_GLOO_LAZY_INIT``): then the listener
    and the store must stay open for the groups' life."""
    return os.environ.get("TORCH_GLOO_LAZY_INIT", "").lower() in ("1", "true", "yes")


def _listening_sockets() -> dict[int, str]:
    """This process's listening TCP sockets: descriptor -> inode."""
    sockets = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        if target.startswith("socket:["):
            sockets[int(name)] = target[len("socket:[") : -1]
    listening = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{table}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN:
                listening.add(fields[9])
    return {fd: inode for fd, inode in sockets.items() if inode in listening}
