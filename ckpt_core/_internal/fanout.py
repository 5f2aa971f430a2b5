"""One policy rank sending a stream of its own to each of several rollout ranks.

Where a transport reaches each destination separately (``_connect_policy`` returned a sender
per rollout rank), every destination gets its own refit: its own buckets, carrying what its
refit stages make of the weights (what its layout keeps, its patches). The weights generator
is still consumed once, on the calling thread (the engine's refit thread, which carries the
caller's CUDA device): a dispatcher there hands each weight to every destination's stream
through a bounded queue, and each stream runs its stages' wrapping and then the ordinary
(blocking) :func:`~ckpt_core._internal.send.send_refit` on a thread of its own, so the streams
progress together and a slow destination holds back only the dispatcher's next hand-over.

Failure of any part fails all of it, and no stream is told its refit is complete while another
failed: a generator or stage error, or a stream's own failure (a lost rollout), is passed to
every stream still running, which aborts its refit (its receiver sees ``RemoteRefitError``
naming the cause); so does the caller's ``cancel``, checked before each weight is taken. The
end is in two steps: once the weights are exhausted, each stream runs its stages to their end
(a layout's "named but never yielded" check, for one) and then waits at a gate; only when every
stream reached its gate are they let through to post their last bucket.
Every wait is bounded by ``timeout_s``, and every stream's thread is joined before
:func:`send_refit_each` returns or raises (within ``3 * timeout_s``). Observers hear the refit start and
end once, on the caller's thread; bucket events of every stream are passed on there too, with
bucket indices counted within each stream.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import Any

import torch

from ckpt_core._internal.bucket_io import BucketSender
from ckpt_core._internal.pipeline import RefitCancelled
from ckpt_core.errors import TransferTimeoutError
from ckpt_core.hooks import RefitNotifier
from ckpt_core.stats import RefitContext, RefitStats

Weights = Iterable[tuple[str, torch.Tensor]]
Wrap = Callable[[Weights, RefitStats], Weights]
"""A destination's refit stages over its weights, counting into its stream's statistics."""

_DONE = object()
_POLL_S = 0.05


class _RefitAborted(Exception):
    """Raised inside a healthy stream when the refit failed elsewhere (the weights, a layout
    check, another stream). Not a ``TransferError``: ``send_refit`` then posts an abort header,
    so this stream's receiver hears the refit is void (``RemoteRefitError`` naming the cause)."""


class _StreamNotifier(RefitNotifier):
    """A stream's notifier: the refit's start and end are announced once, by the dispatcher on
    the caller's thread; a stream's bucket events are queued for the dispatcher to pass on,
    on that thread too (hooks run on the engine's refit thread, never on a stream's)."""

    def __init__(self, parent: RefitNotifier, events: queue.SimpleQueue[tuple[RefitContext, int, int, int]]) -> None:
        super().__init__(parent.backend, parent.role, parent.rank)
        self._events = events

    def started(self, context: RefitContext) -> None:
        pass

    def finished(self, context: RefitContext, stats: RefitStats) -> None:
        pass

    def failed(self, context: RefitContext, error: BaseException) -> None:
        pass

    def bucket_sent(self, context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
        self._events.put((context, bucket_index, nbytes, num_chunks))


@dataclasses.dataclass
class Destination:
    """One destination stream: its sender, and its refit stages over the weights (run on the
    stream's send thread)."""

    sender: BucketSender
    wrap: Wrap


class _Stream:
    """One destination's send thread and the queue that feeds it."""

    def __init__(self, rank: int, destination: Destination, timeout_s: float) -> None:
        self.rank = rank
        self.destination = destination
        self.timeout_s = timeout_s
        self.queue: queue.Queue[object] = queue.Queue(maxsize=2)
        self.error: BaseException | None = None
        self.stats: RefitStats | None = None
        self.thread: threading.Thread | None = None
        self.at_gate = threading.Event()  # its stages ran to their end
        self.through = threading.Event()  # set by the dispatcher: post the last bucket (or abort)
        self.aborted: BaseException | None = None

    def weights(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        while True:
            try:
                item = self.queue.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TransferTimeoutError(
                    f"rollout rank {self.rank}'s stream: no weight from the dispatcher within "
                    f"timeout_s={self.timeout_s:g}s"
                ) from None
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise _RefitAborted(f"the refit was aborted: {type(item).__name__}: {item}") from item
            assert isinstance(item, tuple)
            yield item

    def hand_over(self, item: object, *, deadline: float) -> None:
        """Queue ``item`` for the stream; raises the stream's own error if it failed."""
        while True:
            if self.error is not None:
                raise self.error
            try:
                self.queue.put(item, timeout=_POLL_S)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    raise TransferTimeoutError(
                        f"rollout rank {self.rank}'s stream took no weight within timeout_s={self.timeout_s:g}s"
                    ) from None

    def gated(self, weights: Weights) -> Generator[tuple[str, torch.Tensor], None, None]:
        """``weights`` (the stream's, through its stages), then the gate: the stream's last
        bucket waits until every stream got there (or the refit failed)."""
        yield from weights
        self.at_gate.set()
        if not self.through.wait(self.timeout_s):
            raise TransferTimeoutError(
                f"rollout rank {self.rank}'s stream: the other streams did not end within timeout_s={self.timeout_s:g}s"
            )
        cause = self.aborted
        if cause is not None:
            raise _RefitAborted(f"the refit was aborted: {type(cause).__name__}: {cause}") from cause

    def reach_gate(self, deadline: float) -> None:
        """Wait until the stream is at its gate; raises its own error if it failed."""
        while not self.at_gate.wait(_POLL_S):
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"rollout rank {self.rank}'s stream did not finish its weights within timeout_s={self.timeout_s:g}s"
                )

    def abort(self, exc: BaseException) -> None:
        """Make the stream fail with ``exc`` (if it still runs): its receiver hears the abort."""
        self.aborted = exc
        self.through.set()
        try:
            self.queue.put_nowait(exc)
        except queue.Full:
            try:  # drop a pending weight: the refit is void anyway
                self.queue.get_nowait()
                self.queue.put_nowait(exc)
            except (queue.Empty, queue.Full):
                pass


def send_refit_each(
    weights: Iterable[tuple[str, torch.Tensor]],
    destinations: Mapping[int, Destination],
    *,
    send: Callable[..., RefitStats],
    context: RefitContext,
    notifier: RefitNotifier,
    timeout_s: float,
    cancel: threading.Event | None = None,
    **send_options: Any,
) -> dict[int, RefitStats]:
    """Send one refit to every destination (rollout rank -> :class:`Destination`), each its
    own stream through ``send`` (:func:`~ckpt_core._internal.send.send_refit`, given
    ``send_options``); returns each destination's statistics. Blocking, like ``send``.
    ``cancel``: once set, the refit stops with ``RefitCancelled`` before the next weight, and
    every stream aborts its receiver's refit."""
    streams = [_Stream(rank, destination, timeout_s) for rank, destination in destinations.items()]
    events: queue.SimpleQueue[tuple[RefitContext, int, int, int]] = queue.SimpleQueue()
    stream_notifier = _StreamNotifier(notifier, events)
    notifier.started(context)
    for stream in streams:
        stream.thread = threading.Thread(
            target=_run_stream,
            args=(stream, send, context, stream_notifier, timeout_s, send_options),
            name=f"ckpt-refit-to-rollout-{stream.rank}",
            daemon=True,
        )
        stream.thread.start()
    try:
        for name, tensor in weights:
            if cancel is not None and cancel.is_set():
                raise RefitCancelled(f"refit {context.refit_index} was cancelled by its caller")
            deadline = time.monotonic() + timeout_s
            for stream in streams:
                stream.hand_over((name, tensor), deadline=deadline)
            _raise_first_error(streams)  # a failed stream fails the refit before the next weight
            _pass_on(events, notifier)
        for stream in streams:
            stream.hand_over(_DONE, deadline=time.monotonic() + timeout_s)
        deadline = time.monotonic() + timeout_s
        for stream in streams:  # no stream is told the refit is complete if one failed
            stream.reach_gate(deadline)
        for stream in streams:
            stream.through.set()
        _join(streams, timeout_s)
        _raise_first_error(streams)
    except BaseException as exc:
        for stream in streams:
            stream.abort(exc)
        # A stream's abort may wait on its slots (each wait bounded by timeout_s) before it
        # posts the abort header: give it that long before the caller drops the transport.
        _join(streams, 3 * timeout_s)
        _pass_on(events, notifier)
        notifier.failed(context, exc)
        raise
    _pass_on(events, notifier)
    per_destination = {stream.rank: stream.stats for stream in streams if stream.stats is not None}
    notifier.finished(context, RefitStats.combined(per_destination.values()))
    return per_destination


def _raise_first_error(streams: list[_Stream]) -> None:
    for stream in streams:
        if stream.error is not None:
            raise stream.error


def _pass_on(events: queue.SimpleQueue[tuple[RefitContext, int, int, int]], notifier: RefitNotifier) -> None:
    while True:
        try:
            context, bucket_index, nbytes, num_chunks = events.get_nowait()
        except queue.Empty:
            return
        notifier.bucket_sent(context, bucket_index, nbytes, num_chunks)


def _run_stream(
    stream: _Stream,
    send: Callable[..., RefitStats],
    context: RefitContext,
    notifier: RefitNotifier,
    timeout_s: float,
    send_options: dict[str, Any],
) -> None:
    try:
        stats = RefitStats()
        stream.stats = send(
            stream.gated(stream.destination.wrap(stream.weights(), stats)),
            stream.destination.sender,
            context=context,
            notifier=notifier,
            timeout_s=timeout_s,
            stats=stats,
            **send_options,
        )
    except BaseException as exc:  # noqa: BLE001 - handed to the dispatcher
        stream.error = exc


def _join(streams: list[_Stream], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s + 5.0
    for stream in streams:
        assert stream.thread is not None
        stream.thread.join(max(0.0, deadline - time.monotonic()))
        if stream.thread.is_alive() and stream.error is None:
            stream.error = TransferTimeoutError(
                f"rollout rank {stream.rank}'s stream did not finish within timeout_s={timeout_s:g}s"
            )
