"""Host work split over the cores this process may run on: one small thread pool per process.

For loops that read every byte of large tensors (delta refits' diffs, patches and digests),
whose kernels release the GIL: :func:`run_parts` runs ``parts`` calls of one function at once,
the first on the calling thread and the rest on the pool, and returns their results in order.
The pool's threads start on first use; a forked child starts a pool of its own (the parent's
threads do not survive a fork). The number of parts worth running is :func:`usable_cores`, as
many as torch's intra-op threads: a process given one thread (a local pool's share of a small
machine) or pinned to one core (as vLLM pins its workers) runs its parts one after the other on
the calling thread, with no hand-off at all. Parts may split their work by :class:`Claims`
rather than in fixed shares.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def usable_cores() -> int:
    """The cores this process's host work may use now: torch's intra-op thread count (which
    follows ``OMP_NUM_THREADS``: a launcher that gives each of several processes its share of
    the cores sets it so), within the process's affinity mask where the OS has one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores, torch.get_num_threads()))


def run_parts(work: Callable[[int], T], parts: int) -> list[T]:
    """``[work(0), ..., work(parts - 1)]``, run at once: ``work(0)`` on the calling thread, the
    others on the pool. Every part runs to its end before this returns; the first error raised
    by a part (in part order) is raised here, after the others finished."""
    if parts <= 1:
        return [work(0)] if parts == 1 else []
    pool = _shared_pool()
    futures: list[Future[T]] = [pool.submit(work, index) for index in range(1, parts)]
    first: list[T] = []
    error: BaseException | None = None
    try:
        first.append(work(0))
    except BaseException as exc:  # noqa: BLE001 - raised below, once every part finished
        error = exc
    results = first
    for future in futures:
        try:
            results.append(future.result())
        except BaseException as exc:  # noqa: BLE001 - the first part's error wins
            error = error or exc
    if error is not None:
        raise error
    return results


class Claims:
    """The numbers ``0`` to ``count - 1``, each handed out once, in ascending order, to whichever
    thread asks next (iterate it). Parts of one :func:`run_parts` call that claim their units of
    work from one of these share the work by how fast each runs: a part whose core is shared for
    a while (with a library's spinning worker thread, another process) does fewer units instead
    of holding up the call, as a fixed split would."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._next = 0
        self._lock = threading.Lock()

    def __iter__(self) -> Claims:
        return self

    def __next__(self) -> int:
        with self._lock:
            number = self._next
            if number >= self._count:
                raise StopIteration
            self._next = number + 1
            return number


def _shared_pool() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, (os.cpu_count() or 1) - 1), thread_name_prefix="ckpt-host")
        return _pool


def _forget_pool_in_child() -> None:
    global _lock, _pool
    _lock = threading.Lock()
    _pool = None  # its threads are the parent's: a child that submitted to it would wait forever


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)
