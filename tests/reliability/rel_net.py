"""What a process has open, read from ``/proc``: listening TCP sockets, descriptors, memory.

Everything here reads another process's ``/proc/<pid>`` from outside, so it works on worker
processes (and on processes in another network namespace: ``/proc/<pid>/net`` shows the
namespace of ``pid``). Linux only.
"""

from __future__ import annotations

import ipaddress
import os

_LISTEN = "0A"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def _decode_address(hex_address: str) -> str:
    address, port = hex_address.split(":")
    raw = bytes.fromhex(address)
    if len(raw) == 4:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.IPv4Address(raw[::-1])
    else:  # four 32-bit words, each in host (little-endian) order
        ip = ipaddress.IPv6Address(b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return f"{ip}:{int(port, 16)}"


def listening_sockets(pid: int) -> list[str]:
    """``address:port`` of every TCP socket in state LISTEN that process ``pid`` holds."""
    inodes = _socket_inodes(pid)
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == _LISTEN and inode in inodes:
                found.append(_decode_address(local))
    return sorted(found)


def descriptor_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_bytes(pid: int) -> int:
    """Resident set size now (``VmRSS``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def shm_in_use(pid: int) -> list[str]:
    """``/dev/shm`` files process ``pid`` maps or holds a descriptor of."""
    found = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            if "/dev/shm/" in line:
                found.add(line.split(None, 5)[-1].strip())
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/dev/shm/"):
            found.add(target)
    return sorted(found)
