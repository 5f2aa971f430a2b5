"""Worker services the benchmark runs in local processes (see :mod:`ckpt_core.orchestration.local`).

Every service reports when its side of a measurement started and ended as
``time.perf_counter()`` stamps: on Linux that is ``CLOCK_MONOTONIC``, one clock for every process
of the machine, so "sender started" and "last receiver finished" of different processes
subtract into an end-to-end time. Every service also reports the CPU time its process spent in
the call (all threads), and its
resident memory: at
construction (``rss_base_bytes``: interpreter and libraries, before any buffer or weight), at
the call's start (``rss_before_bytes``) and its peak during the call (``rss_peak_bytes``: the
peak since a reset at the call's start, :func:`ckpt_core.rss.peak_rss_bytes`; a machine whose
kernel refuses the reset cannot run the benchmark).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import torch

from ckpt_core import hooks
from ckpt_core.bench.baselines import RawGlooWorker
from ckpt_core.hookspecs import hookimpl
from ckpt_core.orchestration.worker import RefitWorker
from ckpt_core.orchestration.workload import load_target
from ckpt_core.rss import peak_rss_bytes, reset_peak_rss, rss_bytes
from ckpt_core.tensors import dtype_from_name, dtype_name

NAIVE_FORMATS = ("torch", "safetensors")


def _weights(weights: str, params: dict[str, Any]) -> Iterable[tuple[str, torch.Tensor]]:
    return load_target(weights)(params, refit_index=0, rank=0)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _Measured:
    """Memory bookkeeping shared by the services: base RSS, and a per-call peak."""

    def __init__(self) -> None:
        self.rss_base_bytes = rss_bytes()

    def _begin(self) -> dict[str, Any]:
        if not reset_peak_rss():
            raise RuntimeError(
                "the benchmark measures each call's peak RSS, and this kernel refuses to reset it "
                "(/proc/self/clear_refs, Linux >= 4.0)"
            )
        return {
            "rss_base_bytes": self.rss_base_bytes,
            "rss_before_bytes": rss_bytes(),
            "cpu_seconds": time.process_time(),
        }

    @staticmethod
    def _end(record: dict[str, Any]) -> dict[str, Any]:
        record["rss_peak_bytes"] = peak_rss_bytes()
        # CPU time of every thread of the process (transport threads included) during the call.
        record["cpu_seconds"] = time.process_time() - record["cpu_seconds"]
        return record


class _BucketPosts:
    """A hook observer: when (``time.perf_counter()``) this process handed each bucket of its
    latest refit to the transport."""

    def __init__(self) -> None:
        self.times: list[float] = []

    @hookimpl
    def ckpt_core_refit_started(self) -> None:
        self.times = []

    @hookimpl
    def ckpt_core_bucket_sent(self) -> None:
        self.times.append(time.perf_counter())


class BenchRefitWorker(RefitWorker, _Measured):
    """A :class:`~ckpt_core.orchestration.worker.RefitWorker` whose refit results also carry ``started_at``,
    ``ended_at`` (this side's transfer, without digests) and the memory fields above.

    ``set_verify`` switches per-tensor digests, so a benchmark verifies its warm-up refit
    bit-exact and times refits that compute none. After ``record_bucket_posts()`` a sender's
    results also carry ``bucket_posts``: when it handed each bucket to the transport (an
    observer of the ``bucket_sent`` hook, left off otherwise so other measurements run with no
    hook implemented).
    """

    def __init__(self, **kwargs: Any) -> None:
        _Measured.__init__(self)
        RefitWorker.__init__(self, **kwargs)
        self._bucket_posts: _BucketPosts | None = None

    def set_verify(self, *, enabled: bool) -> None:
        self.verify = bool(enabled)

    def record_bucket_posts(self) -> None:
        if self._bucket_posts is None:
            self._bucket_posts = _BucketPosts()
            hooks.register(self._bucket_posts, name="benchmarks-bucket-posts")

    def refit(
        self, *, refit_index: int, weights: str | None = None, weights_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        record = self._begin()
        start = time.perf_counter()
        result = super().refit(refit_index=refit_index, weights=weights, weights_params=weights_params)
        # wall_seconds ends when the last tensor is in hand, before digests and before the
        # received tensors are freed.
        record.update(started_at=start, ended_at=start + result["wall_seconds"])
        if self._bucket_posts is not None and self._bucket_posts.times:
            record["bucket_posts"] = list(self._bucket_posts.times)
        result.update(self._end(record))
        return result

    async def _receive(self) -> dict[str, torch.Tensor]:
        received = await super()._receive()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()  # tensors are "received" once their copies have landed
        return received


class RawFloorWorker(RawGlooWorker, _Measured):
    """The transport floor, one measurement per call: raw Gloo moving ``nbytes`` from rank 0 to
    ranks 1..R (one ``send``/``recv`` per receiver, or one ``broadcast``).

    With ``piece_bytes``, the bytes move in pieces of that size with at most two in flight, as
    the bucket pipeline moves them, which shows what splitting alone costs the transport.
    """

    def __init__(self, **kwargs: Any) -> None:
        _Measured.__init__(self)
        RawGlooWorker.__init__(self, **kwargs)

    def transfer_once(self, *, nbytes: int, topology: str, piece_bytes: int | None = None) -> dict[str, Any]:
        if topology not in ("paired", "broadcast"):
            raise ValueError(f"topology must be 'paired' or 'broadcast', got {topology!r}")
        record = self._begin()
        buffer = torch.ones(nbytes, dtype=torch.uint8)  # touched before the clock starts
        step = piece_bytes or nbytes
        pieces = [buffer[offset : offset + step] for offset in range(0, nbytes, step)]
        record["cpu_seconds"] = time.process_time()  # the peak counts the buffer, the CPU time does not
        self._group.barrier().wait(self.timeout)
        start = time.perf_counter()
        in_flight: list[list[Any]] = []
        for piece in pieces:
            if len(in_flight) == 2:
                for work in in_flight.pop(0):
                    work.wait(self.timeout)
            in_flight.append(self._post(piece, topology))
        for works in in_flight:
            for work in works:
                work.wait(self.timeout)
        end = time.perf_counter()
        record.update(started_at=start, ended_at=end, rank=self.rank)
        del buffer, pieces
        return self._end(record)

    def _post(self, piece: torch.Tensor, topology: str) -> list[Any]:
        if topology == "broadcast":
            return [self._group.broadcast(piece, 0)]
        if self.rank == 0:
            return [self._group.send([piece], peer, 0) for peer in range(1, self.size)]
        return [self._group.recv([piece], 0, 0)]


class MemcpyWorker(_Measured):
    """The memory limit: one thread copying every tensor of a payload into one preallocated,
    already-touched buffer the size of the largest tensor (``copy_`` of the raw bytes). Far
    larger than any cache, the buffer makes every copy a trip to memory like a copy into the
    payload's own destination would, and keeps several copying processes within the machine's
    memory beside the other methods' processes."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_num_threads(1)
        self._destination: torch.Tensor | None = None

    def copy(self, *, weights: str, weights_params: dict[str, Any]) -> dict[str, Any]:
        tensors = [t for _, t in _weights(weights, weights_params)]
        total = sum(_nbytes(t) for t in tensors)
        largest = max((_nbytes(t) for t in tensors), default=0)
        if self._destination is None or self._destination.numel() != largest:
            self._destination = None
            self._destination = torch.empty(largest, dtype=torch.uint8)
            self._destination.fill_(0)
        record = self._begin()
        destination = self._destination
        start = time.perf_counter()
        for tensor in tensors:
            destination[: _nbytes(tensor)].copy_(tensor.reshape(-1).view(torch.uint8))
        end = time.perf_counter()
        record.update(started_at=start, ended_at=end, payload_bytes=total, threads=torch.get_num_threads())
        return self._end(record)


class NaiveWorker(_Measured):
    """The refit a user would write without ckpt-engine: the sender writes the whole state dict
    to a file (``torch.save``, or safetensors ``save_file``), another process reads it back
    (``torch.load``, or ``load_file`` followed by a ``clone()`` of each tensor, so the receiver
    owns its memory rather than a view of the file)."""

    def __init__(self, *, fmt: str) -> None:
        if fmt not in NAIVE_FORMATS:
            raise ValueError(f"fmt must be one of {NAIVE_FORMATS}, got {fmt!r}")
        super().__init__()
        self.fmt = fmt

    def save(self, *, weights: str, weights_params: dict[str, Any], path: str) -> dict[str, Any]:
        state = dict(_weights(weights, weights_params))
        record = self._begin()
        start = time.perf_counter()
        if self.fmt == "torch":
            torch.save(state, path)
        else:
            from safetensors.torch import save_file

            save_file(state, path)
        end = time.perf_counter()
        record.update(started_at=start, ended_at=end, file_bytes=os.path.getsize(path))
        return self._end(record)

    def load(self, *, path: str) -> dict[str, Any]:
        record = self._begin()
        start = time.perf_counter()
        if self.fmt == "torch":
            state = torch.load(path, weights_only=True)
        else:
            from safetensors.torch import load_file

            state = {name: tensor.clone() for name, tensor in load_file(path).items()}
        end = time.perf_counter()
        record.update(
            started_at=start, ended_at=end, tensors=len(state), payload_bytes=sum(_nbytes(t) for t in state.values())
        )
        self._end(record)
        del state
        return record


class ProduceWorker(_Measured):
    """Producing alone: run a weights factory to its end, dropping each tensor once made, as
    a sender that had nothing to send would (the "produce alone" side of the overlap check)."""

    def produce(self, *, weights: str, weights_params: dict[str, Any], min_seconds: float = 0.0) -> dict[str, Any]:
        """Run the factory to its end once, and again until ``min_seconds`` have passed (to keep
        producing beside another measurement)."""
        record = self._begin()
        start = time.perf_counter()
        while True:
            layout = []
            for _, tensor in _weights(weights, weights_params):
                layout.append({"shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype)})
            if time.perf_counter() - start >= min_seconds:
                break
        end = time.perf_counter()
        record.update(started_at=start, ended_at=end, layout=layout)
        return self._end(record)


class NaiveLoopWorker(RawGlooWorker, _Measured):
    """The loop a user writes without a pipeline: the sender makes a tensor, ``send``s it and
    waits, then makes the next; the receiver allocates each tensor (``layout``: the shapes and
    dtypes, known in advance) and ``recv``s into it. One tensor in flight, nothing overlapped."""

    def __init__(self, **kwargs: Any) -> None:
        _Measured.__init__(self)
        RawGlooWorker.__init__(self, **kwargs)

    def loop(self, *, weights: str, weights_params: dict[str, Any], layout: list[dict[str, Any]]) -> dict[str, Any]:
        record = self._begin()
        self._group.barrier().wait(self.timeout)
        start = time.perf_counter()
        received = []
        if self.rank == 0:
            for _, tensor in _weights(weights, weights_params):
                data = tensor.contiguous().reshape(-1).view(torch.uint8)
                self._group.send([data], 1, 0).wait(self.timeout)
        else:
            for entry in layout:
                tensor = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"]))
                self._group.recv([tensor.reshape(-1).view(torch.uint8)], 0, 0).wait(self.timeout)
                received.append(tensor)
        end = time.perf_counter()
        record.update(started_at=start, ended_at=end, tensors=len(received))
        del received
        return self._end(record)
