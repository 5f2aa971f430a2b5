"""The transport floor: raw ``torch.distributed`` Gloo moving the same bytes as one tensor.

``RawGlooWorker`` is a worker service (like :class:`ckpt_core.orchestration.worker.RefitWorker`) for the
local launcher: worker 0 sends, workers 1..R receive, by ``send``/``recv`` per pair
(``paired``) or one ``broadcast`` (``broadcast``). Benchmarks run it beside a refit, in the
same run, so their ratio is meaningful on a noisy machine.
"""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from ckpt_core.orchestration.worker import peak_rss_bytes
from ckpt_core.topology import Topology
from ckpt_core.transport.torch_distributed import gloo_group


class RawGlooWorker:
    """One member of a raw Gloo transfer group; rank 0 is the sender."""

    def __init__(self, *, rank: int, size: int, host: str = "127.0.0.1", timeout_s: float = 300.0) -> None:
        self.rank, self.size, self.host = rank, size, host
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._group: Any = None

    def prepare(self) -> dict[str, Any]:
        if self.rank != 0:
            return {}
        listener = socket.create_server((self.host, 0))
        port = listener.getsockname()[1]
        self._store = dist.TCPStore(
            self.host, port, None, True, self.timeout, wait_for_workers=False, master_listen_fd=listener.detach()
        )
        return {"host": self.host, "port": port}

    def init(self, *, metadata: list[dict[str, Any]]) -> None:
        if self.rank != 0:
            self._store = dist.TCPStore(metadata[0]["host"], metadata[0]["port"], None, False, self.timeout)
        self._group = gloo_group(
            dist.PrefixStore("raw/", self._store), self.rank, self.size, host=self.host, timeout=self.timeout
        )

    def transfer(self, *, nbytes: int, topology: str, repetitions: int) -> dict[str, Any]:
        """Move ``nbytes`` ``repetitions`` times; seconds per repetition, as this rank saw it."""
        buffer = torch.zeros(nbytes, dtype=torch.uint8)
        seconds = []
        for _ in range(repetitions):
            self._group.barrier().wait(self.timeout)
            start = time.perf_counter()
            if Topology.parse(topology).shares_link:
                self._group.broadcast(buffer, 0).wait(self.timeout)
            elif self.rank == 0:
                works = [self._group.send([buffer], peer, 0) for peer in range(1, self.size)]
                for work in works:
                    work.wait(self.timeout)
            else:
                self._group.recv([buffer], 0, 0).wait(self.timeout)
            seconds.append(time.perf_counter() - start)
        return {"rank": self.rank, "seconds": seconds, "peak_rss_bytes": peak_rss_bytes()}

    def finalize(self) -> None:
        self._group = None
        self._store = None
