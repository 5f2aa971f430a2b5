"""A refit's worker thread: the blocking pipeline runs there, the engine's coroutines await it.

``BucketedEngine.send_weights`` and ``receive_weight_batches`` are coroutines, but a refit
blocks on its transport (slots, payloads, up to ``timeout_s`` each). :class:`RefitThread` runs
each such step on one thread and lets the event loop await it, so other coroutines of the
caller's loop keep running for the whole refit.

One thread serves a whole refit (never a pool): a receive's generator is advanced one batch
per call on it, so thread-local state (the CUDA device and stream the caller had, which the
thread adopts when the refit starts) stays the same from the first bucket to the last. The
thread is a :class:`RefitCarrier`, which an engine keeps from one refit to the next: starting
a thread costs a small refit a third of a millisecond, most of it waiting for the new thread
to be scheduled, where handing a waiting one its next refit costs a wake-up.

A refit's last step may end the refit on the thread, before its result is handed back
(``run(..., ends=...)``): the carrier is then free for the next refit as the caller resumes,
and :meth:`RefitThread.stop` has nothing to wait for, where it would otherwise cost two more
hand-offs between the loop and the thread (0.1-0.3 ms here, docs/benchmarks.md).

Cancellation: :meth:`RefitThread.stop` asks a step still running to stop (``cancel``, which the
pipeline checks before each weight and bucket), waits for it, runs the refit's cleanup on the
thread, and waits for the refit to end there, each within a deadline.
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

_Request = tuple[Callable[[], Any], "concurrent.futures.Future[Any]", "Callable[[Any], bool] | None"]

_RETIRE_JOIN_S = 1.0  # an idle carrier wakes and returns at once; this only bounds a stalled machine


def _caller_cuda() -> tuple[int, Any] | None:
    """The calling thread's CUDA device and its current stream, where CUDA is initialized
    (never initializes it)."""
    if not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    return device, torch.cuda.current_stream(device)


class RefitCarrier:
    """A daemon thread that runs one :class:`RefitThread` at a time and waits between them; an
    engine keeps one across its refits (:meth:`usable` says whether the next refit may use it).

    A refit whose step or cleanup did not end within its stop deadline keeps its carrier busy,
    so the engine starts another for the next refit and retires this one: it ends once that
    refit does."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = False
        """A refit is handed to it and has not ended (written by its thread, read by the engine's)."""
        self._retired = False
        self._refits: queue.SimpleQueue[RefitThread | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def usable(self) -> bool:
        """Whether the next refit may run here: not busy, not retired, and its thread alive
        (it is not where this process was forked after it started)."""
        return not self.busy and not self._retired and self.thread.is_alive()

    def carry(self, refit: RefitThread) -> None:
        self.busy = True
        self._refits.put(refit)

    def retire(self) -> None:
        """End the thread: at once if it is idle (joined here, unless called on it), else
        once the refit it runs has ended. Idempotent."""
        if not self._retired:
            self._retired = True
            self._refits.put(None)
        if not self.busy and self.thread is not threading.current_thread():
            self.thread.join(_RETIRE_JOIN_S)

    def _serve(self) -> None:
        while (refit := self._refits.get()) is not None:
            refit.serve()
            if self._retired:
                return


class RefitThread:
    """One refit's worker thread: its steps run on ``carrier`` (handed this refit at once).

    ``idle_s`` bounds how long the refit waits for its next step (a consumer that does not
    ask for the next batch): past it, the carrier runs ``on_idle`` (if set) and the refit ends
    there, and later steps raise ``TransferTimeoutError``. ``stop_s`` bounds how long
    :meth:`stop` waits for a step to stop and the refit to end."""

    def __init__(
        self,
        carrier: RefitCarrier,
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
        self._idle_lock = threading.Lock()  # no step is queued once the refit idled out
        self._cuda = _caller_cuda()
        self._carrier = carrier
        carrier.carry(self)

    @property
    def thread(self) -> threading.Thread:
        return self._carrier.thread

    def serve(self) -> None:
        """The refit's steps, on the carrier's thread, until :meth:`stop`, ``idle_s``, or a
        step whose ``ends`` says so."""
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
                call, future, ends = request
                if not future.set_running_or_notify_cancel():
                    continue
                try:
                    # Handed over in a box the caller empties: neither this thread nor the future
                    # holds a step's result (a batch) once the caller has it, even while this
                    # thread is still returning from the step after the caller resumed.
                    box = [call()]
                    last = ends is not None and ends(box[0])
                except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                    future.set_exception(exc)
                    continue
                if last:
                    self._end()  # before the caller resumes: the next refit may use the carrier
                    future.set_result(box)
                    return
                future.set_result(box)
        finally:
            self._end()

    def _end(self) -> None:
        """The refit ended on this thread (idempotent): its carrier is free for the next one
        (marked before the refit is seen to end), and no step is taken any more."""
        with self._idle_lock:
            if self._ended.done():
                return
            self._current = None  # its result may be a batch: the carrier keeps this object until the next refit
            self._carrier.busy = False
            self._ended.set_result(None)

    async def run(self, call: Callable[[], T], *, ends: Callable[[T], bool] | None = None) -> T:
        """``call()`` on the thread, awaited without blocking the loop; its exception (any
        type, unchanged) is raised here. ``ends``: asked of the result on the thread; where it
        is true, the refit ends there before the result is handed back (no later step may be
        run, and :meth:`stop` then waits for nothing). A ``call`` that raises never ends it."""
        future: concurrent.futures.Future[list[T]] = concurrent.futures.Future()
        with self._idle_lock:
            if self._idled:
                raise TransferTimeoutError(
                    f"the refit was voided: its next step was not asked for within timeout_s={self.idle_s:g}s"
                )
            if self._ended.done():
                raise RuntimeError("RefitThread.run(): the refit already ended on its thread; it takes no more steps")
            self._current = future
            self._requests.put((call, future, ends))
        box = await asyncio.wrap_future(future)
        return box.pop()

    async def stop(self, cleanup: Callable[[], None] | None = None) -> None:
        """End the refit: a step still running (its awaiting task was cancelled) is cancelled
        and waited for, then ``cleanup`` runs on the thread, then the refit ends there (its
        carrier waits for the next). Each wait is bounded by ``stop_s`` in all; further
        cancellation of the calling task is held back until the refit ended (then raised), so
        the transport is never dropped under a running step. A refit that outlives the
        deadline is reported, not waited for (its carrier is retired): ``TransferTimeoutError``,
        or a ``RuntimeWarning`` when the caller was cancelled."""
        deadline = time.monotonic() + self.stop_s
        cancelled = False
        current = self._current
        if current is not None and not current.done():
            self.cancel.set()
            cancelled |= await _wait(current, deadline)
        done: concurrent.futures.Future[None] | None = None
        with self._idle_lock:
            if not self._ended.done():
                if cleanup is not None and not self._idled:
                    done = concurrent.futures.Future()
                    self._requests.put((cleanup, done, None))
                self._requests.put(None)
        if done is not None:
            cancelled |= await _wait(done, deadline)
        cancelled |= await _wait(self._ended, deadline)
        if not self._ended.done():
            self._carrier.retire()  # it ends once this refit does; the engine starts another
            message = (
                f"the refit thread {self._carrier.name!r} did not stop within {self.stop_s:g}s "
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
    if future.done():  # awaiting it would still cost a turn of the loop
        if not future.cancelled():
            future.exception()
        return cancelled
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
