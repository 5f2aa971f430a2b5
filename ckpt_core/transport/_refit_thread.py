"""A refit's own worker thread: the blocking pipeline runs there, the engine's coroutines await it.

``BucketedEngine.send_weights`` and ``receive_weight_batches`` are coroutines, but a refit
blocks on its transport (slots, payloads, up to ``timeout_s`` each). :class:`RefitThread` runs
each such step on one dedicated thread per refit and lets the event loop await it, so other
coroutines of the caller's loop keep running for the whole refit.

One thread serves a whole refit (never a pool): a receive's generator is advanced one batch
per call on it, so thread-local state (the CUDA device and stream the caller had, which the
thread adopts when it starts) stays the same from the first bucket to the last.

Cancellation: :meth:`RefitThread.stop` asks a step still running to stop (``cancel``, which the
pipeline checks before each weight and bucket), waits for it, runs the refit's cleanup on the
thread, and joins the thread, each within a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ckpt_core.errors import TransferTimeoutError

T = TypeVar("T")

_Request = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"]


def _caller_cuda() -> tuple[int, Any] | None:
    """The calling thread's CUDA device and its current stream, where CUDA is initialized
    (never initializes it)."""
    if not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    return device, torch.cuda.current_stream(device)


class RefitThread:
    """One refit's worker thread; built (and started) on the caller's thread.

    ``idle_s`` bounds how long the thread waits for its next step (a consumer that does not
    ask for the next batch): past it, the thread runs ``on_idle`` (if set) and ends, and
    later steps raise ``TransferTimeoutError``. ``stop_s`` bounds how long :meth:`stop` waits
    for a step to stop and the thread to end."""

    def __init__(
        self,
        name: str,
        *,
        idle_s: float,
        stop_s: float,
        cancel: threading.Event | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.cancel = cancel if cancel is not None else threading.Event()
        """Set by :meth:`stop` while a step runs: the pipeline stops at its next check."""
        self.on_idle = on_idle
        self.idle_s = idle_s
        self.stop_s = stop_s
        self._requests: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._current: concurrent.futures.Future[Any] | None = None
        self._ended: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._idled = False
        self._idle_lock = threading.Lock()  # no step is queued once the thread idled out
        self._cuda = _caller_cuda()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _serve(self) -> None:
        try:
            if self._cuda is not None:
                device, stream = self._cuda
                torch.cuda.set_device(device)
                torch.cuda.set_stream(stream)
            while True:
                try:
                    request = self._requests.get(timeout=self.idle_s)
                except queue.Empty:
                    with self._idle_lock:
                        if not self._requests.empty():
                            continue
                        self._idled = True
                    if self.on_idle is not None:
                        try:
                            self.on_idle()
                        except Exception:  # noqa: BLE001 - the refit is void; the next step says so
                            pass
                    return
                if request is None:
                    return
                call, future = request
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    result = call()
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    future.set_exception(exc)
                else:
                    future.set_result(result)
        finally:
            self._ended.set_result(None)

    async def run(self, call: Callable[[], T]) -> T:
        """``call()`` on the thread, awaited without blocking the loop; its exception (any
        type, unchanged) is raised here."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._idle_lock:
            if self._idled or self._ended.done():
                raise TransferTimeoutError(
                    f"the refit was voided: its next step was not asked for within timeout_s={self.idle_s:g}s"
                )
            self._current = future
            self._requests.put((call, future))
        return await asyncio.wrap_future(future)

    async def stop(self, cleanup: Callable[[], None] | None = None) -> None:
        """End the refit's thread: a step still running (its awaiting task was cancelled) is
        cancelled and waited for, then ``cleanup`` runs on the thread, then the thread ends.
        Each wait is bounded by ``stop_s`` in all; further cancellation of the calling task
        is held back until the thread ended (then raised), so the transport is never dropped
        under a running step. A thread that outlives the deadline is reported, not waited
        for: ``TransferTimeoutError``, or a ``RuntimeWarning`` when the caller was cancelled."""
        deadline = time.monotonic() + self.stop_s
        cancelled = False
        current = self._current
        if current is not None and not current.done():
            self.cancel.set()
            cancelled |= await _wait(current, deadline)
        done: concurrent.futures.Future[None] | None = None
        with self._idle_lock:
            if cleanup is not None and not self._idled and not self._ended.done():
                done = concurrent.futures.Future()
                self._requests.put((cleanup, done))
            self._requests.put(None)
        if done is not None:
            cancelled |= await _wait(done, deadline)
        cancelled |= await _wait(self._ended, deadline)
        self._thread.join(max(0.0, min(1.0, deadline - time.monotonic())))
        if self._thread.is_alive():
            message = (
                f"the refit thread {self._thread.name!r} did not stop within {self.stop_s:g}s "
                "(a weights generator or transport call that does not return); it is left running"
            )
            if cancelled:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            else:
                raise TransferTimeoutError(message)
        if cancelled:
            raise asyncio.CancelledError


async def _wait(future: concurrent.futures.Future[Any], deadline: float) -> bool:
    """Wait for ``future`` until ``deadline`` (its outcome is not ours to raise); whether the
    calling task was cancelled meanwhile (it keeps waiting)."""
    cancelled = False
    waiter = asyncio.wrap_future(future)
    while not waiter.done():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            await asyncio.wait({waiter}, timeout=remaining)
        except asyncio.CancelledError:
            cancelled = True
    if waiter.done() and not waiter.cancelled():
        waiter.exception()  # retrieved: the refit's own error, if any, is raised elsewhere
    return cancelled
