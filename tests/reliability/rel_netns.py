"""Two "hosts" on one machine: network namespaces joined by a veth pair, and a worker pool
whose processes start inside them.

:class:`TwoHosts` creates namespaces ``<prefix>-a`` (address ``10.77.0.1/24``) and
``<prefix>-b`` (``10.77.0.2/24``), each with its end of one veth pair; only these private test
addresses, only inside namespaces it made. Deleting a namespace deletes its veth end, so
:meth:`TwoHosts.close` (run even when a test fails) leaves nothing behind; namespaces left by
a killed earlier run (their creator's pid is gone) are swept first.

:class:`NamespacedProcessPool` is ``LocalProcessPool`` with a command prefix per worker
(``ip netns exec NS``); ``LocalProcessPool`` has no such parameter yet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from ckpt_core.orchestration import local

PREFIX = "ckrel"
ADDRESSES = ("10.77.0.1", "10.77.0.2")
_IP_TIMEOUT_S = 30.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=check)


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or ``None``."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed; CI set-up: apt-get install -y iproute2"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"{PREFIX}-{os.getpid()}-probe"
    made = ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` is not allowed here: {made.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _sweep_stale() -> None:
    listed = ip("netns", "list", check=False).stdout.split()
    for name in listed:
        parts = name.split("-")
        if len(parts) >= 3 and parts[0] == PREFIX and parts[1].isdigit() and not os.path.exists(f"/proc/{parts[1]}"):
            ip("netns", "del", name, check=False)


class TwoHosts:
    """Namespaces ``a`` and ``b`` joined by a veth pair (see the module docstring)."""

    def __init__(self) -> None:
        _sweep_stale()
        tag = f"{PREFIX}-{os.getpid()}"
        self.names = (f"{tag}-a", f"{tag}-b")
        self.links = (f"ckr{os.getpid()}a", f"ckr{os.getpid()}b")
        self.addresses = ADDRESSES
        self._made: list[str] = []
        try:
            for name in self.names:
                ip("netns", "add", name)
                self._made.append(name)
            ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for name, link, address in zip(self.names, self.links, self.addresses):
                ip("link", "set", link, "netns", name)
                ip("-n", name, "addr", "add", f"{address}/24", "dev", link)
                ip("-n", name, "link", "set", link, "up")
                ip("-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def prefix(self, host: int) -> list[str]:
        """Command prefix that runs a program on host ``host`` (0 or 1)."""
        return ["ip", "netns", "exec", self.names[host]]

    def cut(self, host: int) -> None:
        """Take host ``host``'s link down: its packets stop, no connection is reset."""
        ip("-n", self.names[host], "link", "set", self.links[host], "down")

    def close(self) -> None:
        made, self._made = self._made, []
        for name in made:
            ip("netns", "del", name, check=False)
        # The veth pair goes with its namespaces; if it was made but never moved, remove it.
        ip("link", "del", self.links[0], check=False)

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _PrefixedWorker(local._Worker):
    """``local._Worker`` started as ``prefix + [python, -m, worker_main, IN, OUT]``."""

    def __init__(self, label: str, env: dict[str, str] | None, prefix: Sequence[str]) -> None:
        self.label = label
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "ckpt_core.orchestration.worker_main", str(to_child_r), str(from_child_w)],
            pass_fds=(to_child_r, from_child_w),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""


class NamespacedProcessPool(local.LocalProcessPool):
    """``LocalProcessPool`` whose worker ``i`` is started behind ``prefixes[i]``."""

    def __init__(
        self,
        services: Sequence[dict[str, Any]],
        *,
        labels: Sequence[str],
        prefixes: Sequence[Sequence[str]],
        env: dict[str, str] | None = None,
        start_timeout_s: float = 300.0,
    ) -> None:
        self._workers = [_PrefixedWorker(label, env, prefix) for label, prefix in zip(labels, prefixes)]
        try:
            results = self.call([(i, "__init__", dict(spec)) for i, spec in enumerate(services)], start_timeout_s)
            failed = [r for r in results if not r.ok]
            if failed:
                raise RuntimeError("starting workers failed:\n" + "\n".join(r.describe() for r in failed))
        except BaseException:
            self.close()
            raise
