"""The transport floors a refit is measured against, in the same run (a ratio of two figures of
one run means something on a noisy machine; two figures of two runs do not).

* ``RawGlooWorker``, a worker service (like :class:`ckpt_core.orchestration.worker.RefitWorker`)
  for the local launcher: raw ``torch.distributed`` Gloo moving the same bytes as one tensor,
  worker 0 sending, workers 1..R receiving, by ``send``/``recv`` per pair (``paired``) or one
  ``broadcast`` (``broadcast``); :meth:`RawGlooWorker.round_trip` is the same between two
  workers with a 1-byte answer back.
* ``SharedMemoryWorker``: shared host memory (what ``cuda_ipc`` with ``device="cpu"`` moves
  through), a copy in and a copy out with a 1-byte message over a Unix socket each way.
* :class:`HandOffs`: either round trip with each side's part run as an engine runs a refit,
  awaited from an event loop on a thread of its own: the raw transport plus what the async
  API adds.
* :class:`SmallRefitFloor`: a pool of two of either, measuring a small refit's floor (its
  bytes moved plus one round trip), the figure a small refit's fixed cost is judged against;
  a benchmark alternates its samples with its own. :func:`small_refit_floor` takes them in a row.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import mmap
import os
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ckpt_core.rss import lifetime_peak_rss_bytes
from ckpt_core.topology import Topology
from ckpt_core.transport.torch_distributed import gloo_group


def _sender_stamps(send: Callable[[], None], start_at: float) -> dict[str, float]:
    """Run ``send`` at ``start_at`` (a ``time.perf_counter`` stamp) on this thread; its stamps,
    and the CPU time the process spent meanwhile (``cpu_s``, every thread's)."""
    time.sleep(max(0.0, start_at - time.perf_counter()))
    start, cpu = time.perf_counter(), time.process_time()
    send()
    return {"started_at": start, "ended_at": time.perf_counter(), "cpu_s": time.process_time() - cpu}


class HandOffs:
    """A side's part of a transfer run as an engine runs a refit: a coroutine on an event loop
    hands it to a worker thread kept from one call to the next and awaits it (the engines'
    ``send_weights`` and ``receive_weight_batches`` never block their caller's loop). Its
    stamps are the coroutine's, so they count the two hand-offs between the loop and the thread
    that every refit makes on each side: what the async API adds to the raw transport."""

    def __init__(self) -> None:
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None

    def sender(self, send: Callable[[], None], start_at: float) -> dict[str, float]:
        """``send`` from ``start_at``, as :func:`_sender_stamps` stamps it."""
        return asyncio.run(self._run(send, start_at))

    def receiver(self, receive: Callable[[], None]) -> dict[str, float]:
        """``receive`` at once; ``{"ended_at"}``: when the loop has its outcome."""
        return asyncio.run(self._run(receive, None))

    async def _run(self, part: Callable[[], None], start_at: float | None) -> dict[str, float]:
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="floor-refit")
        if start_at is not None:
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        start = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self._thread, part)
        stamps = {"ended_at": time.perf_counter()}
        return stamps if start_at is None else {"started_at": start, **stamps}

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None


class RawGlooWorker:
    """One member of a raw Gloo transfer group; rank 0 is the sender."""

    def __init__(self, *, rank: int, size: int, host: str = "127.0.0.1", timeout_s: float = 300.0) -> None:
        self.rank, self.size, self.host = rank, size, host
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store: Any = None
        self._group: Any = None
        self._hand_offs = HandOffs()

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

    def round_trip(self, *, nbytes: int, start_at: float, hand_offs: bool = False) -> dict[str, float]:
        """Rank 0, at ``start_at`` (a ``time.perf_counter`` stamp), sends ``nbytes`` as one
        tensor to rank 1, which answers 1 byte once they are in; each rank's stamps.
        ``hand_offs``: each side's part runs as an engine runs a refit (:class:`HandOffs`),
        the receiver answering before its loop has the bytes."""
        payload = torch.ones(nbytes, dtype=torch.uint8)
        answer = torch.zeros(1, dtype=torch.uint8)
        group, timeout = self._group, self.timeout
        if self.rank == 0:

            def send() -> None:
                group.send([payload], 1, 0).wait(timeout)
                group.recv([answer], 1, 1).wait(timeout)

            return self._hand_offs.sender(send, start_at) if hand_offs else _sender_stamps(send, start_at)
        if hand_offs:

            def receive() -> None:
                group.recv([payload], 0, 0).wait(timeout)
                group.send([answer], 0, 1).wait(timeout)

            return self._hand_offs.receiver(receive)
        cpu = time.process_time()
        group.recv([payload], 0, 0).wait(timeout)
        ended = time.perf_counter()
        group.send([answer], 0, 1).wait(timeout)
        return {"ended_at": ended, "cpu_s": time.process_time() - cpu}

    def finalize(self) -> None:
        self._hand_offs.close()
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
        self._hand_offs = HandOffs()
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

    def round_trip(self, *, nbytes: int, start_at: float, hand_offs: bool = False) -> dict[str, float]:
        """As :meth:`RawGlooWorker.round_trip`, through the shared mapping."""
        sock = self._sock
        assert sock is not None and nbytes == self.nbytes
        if self.rank == 0:

            def send() -> None:
                self.shared.copy_(self.local)
                sock.sendall(b"x")
                sock.recv(1)

            return self._hand_offs.sender(send, start_at) if hand_offs else _sender_stamps(send, start_at)
        if hand_offs:

            def receive() -> None:
                sock.recv(1)
                self.local.copy_(self.shared)
                sock.sendall(b"x")

            return self._hand_offs.receiver(receive)
        cpu = time.process_time()
        sock.recv(1)
        self.local.copy_(self.shared)
        ended = time.perf_counter()
        sock.sendall(b"x")
        return {"ended_at": ended, "cpu_s": time.process_time() - cpu}

    def finalize(self) -> None:
        self._hand_offs.close()


FLOOR_BACKENDS = ("gloo_cpu", "cuda_ipc")
"""The backends :class:`SmallRefitFloor` has a floor for (``cuda_ipc`` with host memory)."""
_START_MARGIN_S = 0.02  # a measurement's sender starts this long after the calls, once the receiver waits


def timed_stamps(
    pool: Any, method: str, timeout_s: float = 60.0, **kwargs: Any
) -> tuple[dict[str, float], dict[str, float]]:
    """Call ``method`` on workers 0 (the sender) and 1 at once, the sender starting
    ``_START_MARGIN_S`` later (``start_at``, a ``time.perf_counter`` stamp: one clock for a
    machine's processes): the stamps each returned, ``(sender's, receiver's)``."""
    start_at = time.perf_counter() + _START_MARGIN_S
    results = pool.call([(rank, method, {**kwargs, "start_at": start_at}) for rank in (0, 1)], timeout_s)
    failed = [result.describe() for result in results if not result.ok]
    if failed:
        raise RuntimeError("\n".join(failed))
    sent, got = (result.value for result in results)
    return sent, got


def timed_pair(pool: Any, method: str, timeout_s: float = 60.0, **kwargs: Any) -> tuple[float, float]:
    """:func:`timed_stamps`, as ``(sender start to receiver end, sender start to sender end)``."""
    sent, got = timed_stamps(pool, method, timeout_s, **kwargs)
    return got["ended_at"] - sent["started_at"], sent["ended_at"] - sent["started_at"]


class SmallRefitFloor:
    """A pool of two workers measuring ``backend``'s small-refit floor: its raw transport moving
    ``nbytes`` from one process to another plus one round trip (raw Gloo for ``gloo_cpu``,
    shared host memory for ``cuda_ipc``). A context manager: entering starts the pool, joins
    the two workers and runs untimed measurements; :meth:`sample` then measures once
    (seconds), and :attr:`cpu_seconds` holds what each side's process spent of its CPU time on
    it. A benchmark alternates samples of it with its own, so that whatever the machine does
    meanwhile weighs on both alike."""

    def __init__(self, backend: str, nbytes: int, *, env: dict[str, str] | None = None) -> None:
        if backend not in FLOOR_BACKENDS:
            raise ValueError(f"no small-refit floor for backend {backend!r}; there is one for {FLOOR_BACKENDS}")
        self.backend, self.nbytes, self.env = backend, nbytes, env
        self._stack = contextlib.ExitStack()
        self._pool: Any = None
        self.cpu_seconds = (0.0, 0.0)
        """``(sender's, receiver's)`` process CPU time in the last :meth:`sample` without
        hand-offs (every thread's, from each side's start to its end)."""

    def __enter__(self) -> SmallRefitFloor:
        from ckpt_core.orchestration.local import LocalProcessPool

        with contextlib.ExitStack() as stack:
            scratch = stack.enter_context(
                tempfile.TemporaryDirectory(prefix="ckpt-floor-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            )
            if self.backend == "gloo_cpu":
                specs: list[dict[str, Any]] = [
                    {"service": "ckpt_core.bench.baselines:RawGlooWorker", "rank": rank, "size": 2} for rank in range(2)
                ]
            else:
                specs = [
                    {
                        "service": "ckpt_core.bench.baselines:SharedMemoryWorker",
                        "rank": rank,
                        "directory": scratch,
                        "nbytes": self.nbytes,
                    }
                    for rank in range(2)
                ]
            labels = [f"{self.backend}-floor-{rank}" for rank in range(2)]
            pool = stack.enter_context(LocalProcessPool(specs, labels=labels, env=self.env))
            if self.backend == "gloo_cpu":
                (prepared,) = pool.call([(0, "prepare", {})], 60.0)
                joins = pool.call([(rank, "init", {"metadata": [prepared.value, {}]}) for rank in range(2)], 60.0)
            else:
                joins = pool.call([(rank, "connect", {}) for rank in range(2)], 60.0)
            if not all(result.ok for result in joins):
                raise RuntimeError("\n".join(result.describe() for result in joins if not result.ok))
            self._pool = pool
            for hand_offs in (False, True) * 2:
                self.sample(hand_offs=hand_offs)
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        self._pool = None
        self._stack.close()

    def sample(self, *, hand_offs: bool = False) -> float:
        """One measurement of the floor, in seconds; ``hand_offs``: with each side's part run
        as an engine runs a refit (:class:`HandOffs`)."""
        if self._pool is None:
            raise RuntimeError("SmallRefitFloor.sample() runs inside its with block")
        sent, got = timed_stamps(self._pool, "round_trip", nbytes=self.nbytes, hand_offs=hand_offs)
        if not hand_offs:
            self.cpu_seconds = (sent["cpu_s"], got["cpu_s"])
        return got["ended_at"] - sent["started_at"]


def small_refit_floor(backend: str, nbytes: int, reps: int, *, env: dict[str, str] | None = None) -> list[float]:
    """``reps`` measurements (seconds, after untimed ones) of ``backend``'s small-refit floor
    (:class:`SmallRefitFloor`), taken one after another."""
    with SmallRefitFloor(backend, nbytes, env=env) as floor:
        return [floor.sample() for _ in range(reps)]
