"""The transport floors a refit is measured against, in the same run (a ratio of two figures of
one run means something on a noisy machine; two figures of two runs do not).

* ``RawGlooWorker``, a worker service (like :class:`ckpt_core.orchestration.worker.RefitWorker`)
  for the local launcher: raw ``torch.distributed`` Gloo moving the same bytes as one tensor,
  worker 0 sending, workers 1..R receiving, by ``send``/``recv`` per pair (``paired``) or one
  ``broadcast`` (``broadcast``); :meth:`RawGlooWorker.round_trip` is the same between two
  workers with a 1-byte answer back.
* ``SharedMemoryWorker``: shared host memory (what ``cuda_ipc`` with ``device="cpu"`` moves
  through), a copy in and a copy out with a 1-byte message over a Unix socket each way.
* :func:`small_refit_floor`: a pool of two of either, measuring a small refit's floor (its
  bytes moved plus one round trip), the figure a small refit's fixed cost is judged against.
"""

from __future__ import annotations

import datetime
import mmap
import os
import socket
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist

from ckpt_core.rss import lifetime_peak_rss_bytes
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
        return {"rank": self.rank, "seconds": seconds, "lifetime_peak_rss_bytes": lifetime_peak_rss_bytes()}

    def round_trip(self, *, nbytes: int, start_at: float) -> dict[str, float]:
        """Rank 0, at ``start_at`` (a ``time.perf_counter`` stamp), sends ``nbytes`` as one
        tensor to rank 1, which answers 1 byte once they are in; each rank's stamps."""
        payload = torch.ones(nbytes, dtype=torch.uint8)
        answer = torch.zeros(1, dtype=torch.uint8)
        if self.rank == 0:
            time.sleep(max(0.0, start_at - time.perf_counter()))
            start = time.perf_counter()
            self._group.send([payload], 1, 0).wait(self.timeout)
            self._group.recv([answer], 1, 1).wait(self.timeout)
            return {"started_at": start, "ended_at": time.perf_counter()}
        self._group.recv([payload], 0, 0).wait(self.timeout)
        ended = time.perf_counter()
        self._group.send([answer], 0, 1).wait(self.timeout)
        return {"ended_at": ended}

    def finalize(self) -> None:
        self._group = None
        self._store = None


class SharedMemoryWorker:
    """One side of a shared-memory transfer: ``rank`` 0 copies ``nbytes`` into a mapping both
    sides share (a file in ``directory``) and writes a byte to a Unix socket; rank 1, woken by
    it, copies them out and answers a byte. Rank 1 listens at construction; :meth:`connect`
    (called on both) joins them."""

    def __init__(self, *, rank: int, directory: str, nbytes: int) -> None:
        self.rank, self.nbytes = rank, nbytes
        fd = os.open(os.path.join(directory, "floor.shm"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.shared = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self.local = torch.ones(nbytes, dtype=torch.uint8)
        self.shared.fill_(1)
        self._path = os.path.join(directory, "floor.sock")
        self._sock: socket.socket | None = None
        self._listener: socket.socket | None = None
        if rank == 1:
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self._path)
            self._listener.listen(1)

    def connect(self) -> None:
        if self.rank == 0:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._sock.connect(self._path)
        else:
            assert self._listener is not None
            self._sock, _ = self._listener.accept()

    def round_trip(self, *, nbytes: int, start_at: float) -> dict[str, float]:
        """As :meth:`RawGlooWorker.round_trip`, through the shared mapping."""
        assert self._sock is not None and nbytes == self.nbytes
        if self.rank == 0:
            time.sleep(max(0.0, start_at - time.perf_counter()))
            start = time.perf_counter()
            self.shared.copy_(self.local)
            self._sock.sendall(b"x")
            self._sock.recv(1)
            return {"started_at": start, "ended_at": time.perf_counter()}
        self._sock.recv(1)
        self.local.copy_(self.shared)
        ended = time.perf_counter()
        self._sock.sendall(b"x")
        return {"ended_at": ended}


FLOOR_BACKENDS = ("gloo_cpu", "cuda_ipc")
"""The backends :func:`small_refit_floor` has a floor for (``cuda_ipc`` with host memory)."""
_START_MARGIN_S = 0.02  # a measurement's sender starts this long after the calls, once the receiver waits


def timed_pair(pool: Any, method: str, timeout_s: float = 60.0, **kwargs: Any) -> tuple[float, float]:
    """Call ``method`` on workers 0 (the sender) and 1 at once, the sender starting
    ``_START_MARGIN_S`` later: ``(sender start to receiver end, sender start to sender end)``
    from the stamps they return (``time.perf_counter``: one clock for a machine's processes)."""
    start_at = time.perf_counter() + _START_MARGIN_S
    results = pool.call([(rank, method, {**kwargs, "start_at": start_at}) for rank in (0, 1)], timeout_s)
    failed = [result.describe() for result in results if not result.ok]
    if failed:
        raise RuntimeError("\n".join(failed))
    sent, got = (result.value for result in results)
    return got["ended_at"] - sent["started_at"], sent["ended_at"] - sent["started_at"]


def small_refit_floor(backend: str, nbytes: int, reps: int, *, env: dict[str, str] | None = None) -> list[float]:
    """``reps`` measurements (seconds, after three untimed) of ``backend``'s raw transport
    moving ``nbytes`` from one process to another plus one round trip: raw Gloo for
    ``gloo_cpu``, shared host memory for ``cuda_ipc``."""
    from ckpt_core.orchestration.local import LocalProcessPool

    if backend not in FLOOR_BACKENDS:
        raise ValueError(f"no small-refit floor for backend {backend!r}; there is one for {FLOOR_BACKENDS}")
    with tempfile.TemporaryDirectory(
        prefix="ckpt-floor-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    ) as scratch:
        if backend == "gloo_cpu":
            specs: list[dict[str, Any]] = [
                {"service": "ckpt_core.bench.baselines:RawGlooWorker", "rank": rank, "size": 2} for rank in range(2)
            ]
        else:
            specs = [
                {
                    "service": "ckpt_core.bench.baselines:SharedMemoryWorker",
                    "rank": rank,
                    "directory": scratch,
                    "nbytes": nbytes,
                }
                for rank in range(2)
            ]
        with LocalProcessPool(specs, labels=[f"{backend}-floor-0", f"{backend}-floor-1"], env=env) as pool:
            if backend == "gloo_cpu":
                (prepared,) = pool.call([(0, "prepare", {})], 60.0)
                joins = pool.call([(rank, "init", {"metadata": [prepared.value, {}]}) for rank in range(2)], 60.0)
            else:
                joins = pool.call([(rank, "connect", {}) for rank in range(2)], 60.0)
            if not all(result.ok for result in joins):
                raise RuntimeError("\n".join(result.describe() for result in joins if not result.ok))
            for _ in range(3):
                timed_pair(pool, "round_trip", nbytes=nbytes)
            return [timed_pair(pool, "round_trip", nbytes=nbytes)[0] for _ in range(reps)]
