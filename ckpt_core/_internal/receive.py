"""The receiving half of the refit pipeline (:mod:`ckpt_core._internal.pipeline` tells the whole).

Receiver: each header is planned by a :class:`~ckpt_core._internal.assembly.ChunkAssembler` as soon as it
arrives: output tensors are allocated, and direct chunks are received straight into them. While
bucket ``k`` arrives, bucket ``k - 1`` is verified, its packed chunks are copied out of their
slot, the slot is released to the sender, and the tensors it completed are yielded (a transport
whose payloads are readable as soon as their header arrives has each bucket finished at once,
and so has a bucket its sender posted *paced*, early, its next weights being slow to come).

A receiver given a :class:`ReceiveMemo` reuses the checked decoding of a chunk list byte-equal to
the one it had for that bucket, and the runs it planned for a bucket of small whole tensors.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Generator

import torch

from ckpt_core._internal.assembly import ChunkAssembler, Landing, SmallRun, SmallTensorLander, plan_small_runs
from ckpt_core._internal.bucket_io import BucketReceiver
from ckpt_core._internal.checksum import payload_checksum
from ckpt_core._internal.host_alloc import prefault
from ckpt_core._internal.pipeline import Checksum, RefitRun, bucket_digest, timed
from ckpt_core._internal.wire import BucketHeader, HeaderMemo, decode_header
from ckpt_core.contract import TensorMeta
from ckpt_core.errors import (
    IntegrityError,
    RemoteRefitError,
    WireFormatError,
)
from ckpt_core.hooks import RefitNotifier
from ckpt_core.stats import RefitContext, RefitStats


def receive_refit(
    receiver: BucketReceiver,
    *,
    bucket_size: int,
    context: RefitContext,
    notifier: RefitNotifier,
    timeout_s: float,
    checksum: Checksum | None = payload_checksum,
    merge_device: torch.device | str | None = None,
    stats: RefitStats | None = None,
    borrow: bool = False,
    memo: ReceiveMemo | None = None,
    cancel: threading.Event | None = None,
    progress: ReceiveProgress | None = None,
) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
    """Yield the ``(name, tensor)`` batches of one refit, one batch per bucket that completes
    tensors, in the sender's order. Tensors own their memory (never a transport's buffer;
    small ones of a bucket may share one storage of at most 1 MiB, see
    :class:`~ckpt_core._internal.assembly.SmallTensorLander`) and live on ``merge_device`` (or the
    receiver's buffers' device). ``checksum`` (the sender's function) verifies every
    bucket whose header carries a digest, before any tensor it completes is yielded; ``None``
    skips verification. ``stats`` (if given) is filled in as the refit runs. ``borrow``:
    tensors carried whole by one bucket are views of the receiver's buffer, valid until the
    caller asks for the next batch (the buffer's slot is released to the transport only then).
    ``memo``: this receiver's memory of earlier refits' buckets; a bucket whose chunk list
    repeats is not decoded, checked or planned again. ``progress`` (if given) tells the caller,
    between batches, when the last bucket's bytes have arrived.

    Blocking: each ``next()`` waits for the transport on the calling thread (the engine runs
    it on a thread of its own). ``cancel``: once set, the refit stops with ``RefitCancelled``
    before the next bucket is received."""
    stats = stats if stats is not None else RefitStats()
    refit = RefitRun(bucket_size, context, notifier, stats, timeout_s, checksum, cancel)
    start = time.perf_counter()
    notifier.started(context)
    device = torch.device(merge_device) if merge_device is not None else None
    buckets = _BucketStream(
        receiver,
        refit,
        ChunkAssembler(device),
        borrow=borrow,
        memo=memo or ReceiveMemo(),
        progress=progress or ReceiveProgress(),
    )
    try:
        for batch in buckets.tensor_batches():
            refit.stats.tensors += len(batch)
            yield batch
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit):
            notifier.failed(context, exc)
        raise
    refit.stats.seconds = time.perf_counter() - start
    notifier.finished(context, refit.stats)


class ReceiveProgress:
    """Where a running :func:`receive_refit` stands, for the thread that drives it to read
    between two batches."""

    __slots__ = ("received_all",)

    def __init__(self) -> None:
        self.received_all = False
        """The refit's last bucket has arrived: what is left of it (copying out, checking,
        the batches' hand-over) waits on no peer."""


class ReceiveMemo:
    """What a receiver keeps from one refit for the next: each bucket's checked chunk list
    (:class:`~ckpt_core._internal.wire.HeaderMemo`) and, for a bucket of small whole tensors
    only, the runs they land in (planned once per chunk list)."""

    def __init__(self) -> None:
        self.headers = HeaderMemo()
        self.runs: dict[int, tuple[tuple[TensorMeta, ...], list[SmallRun] | None]] = {}

    def small_runs(self, header: BucketHeader) -> list[SmallRun] | None:
        planned = self.runs.get(header.bucket_index)
        if planned is None or planned[0] is not header.chunks:
            planned = self.runs[header.bucket_index] = (header.chunks, plan_small_runs(header.chunks))
        return planned[1]

    def clear(self) -> None:
        self.headers.clear()
        self.runs.clear()


@dataclasses.dataclass
class _PlannedBucket:
    header: BucketHeader
    slot: int
    landings: list[Landing]
    received: list[torch.Tensor | None]
    """Per chunk: where a direct chunk is received (its landing's target, or a staging tensor
    when outputs live on another device); ``None`` for a packed chunk."""
    direct: list[torch.Tensor]
    small_runs: list[SmallRun] | None = None
    """Set for a bucket of small whole tensors only: the runs they land in (no landings)."""


class _BucketStream:
    """Turns a receiver's headers and payloads into verified tensor batches, one per bucket."""

    def __init__(
        self,
        receiver: BucketReceiver,
        refit: RefitRun,
        assembler: ChunkAssembler,
        *,
        borrow: bool,
        memo: ReceiveMemo,
        progress: ReceiveProgress,
    ) -> None:
        self.receiver = receiver
        self.memo = memo
        self.progress = progress
        self.refit = refit
        self.stats = refit.stats
        self.assembler = assembler
        self.borrow = borrow
        self._lent_slot: int | None = None  # a slot whose bytes the last batch's views show

    def _take_back(self) -> None:
        """The caller asked for the next batch (or stopped): a lent slot may be refilled."""
        if self._lent_slot is not None:
            slot, self._lent_slot = self._lent_slot, None
            self.receiver.release(slot)

    def tensor_batches(self) -> Generator[list[tuple[str, torch.Tensor]], None, None]:
        eager = self.receiver.payload_ready_with_header
        previous: _PlannedBucket | None = None
        bucket_index = 0
        while True:
            self.refit.check_cancel()
            bucket = self._plan(self._next_header(bucket_index))
            with timed(self.stats, "transfer_seconds"):
                if bucket.direct:
                    self.receiver.post_payload(
                        bucket.slot, bucket.header.payload_nbytes, self.refit.timeout_s, bucket.direct
                    )
                else:
                    self.receiver.post_payload(bucket.slot, bucket.header.payload_nbytes, self.refit.timeout_s)
                if not bucket.header.last:
                    self.receiver.expect_header()
            with timed(self.stats, "unpack_seconds"):
                for target in bucket.direct:  # fresh pages are zeroed here, beside the transfer
                    prefault(target)
            if previous is not None:  # finish bucket k-1 while bucket k arrives
                batch, previous = self._finish(previous), None
                if batch:
                    yield batch
                self._take_back()
            with timed(self.stats, "transfer_seconds"):
                self.receiver.wait_payload(bucket.slot, self.refit.timeout_s)
            self.progress.received_all = bucket.header.last
            if eager or bucket.header.paced:  # paced: the next bucket is a while away
                batch = self._finish(bucket)
                if batch:
                    yield batch
                self._take_back()
            else:
                previous = bucket
            bucket_index += 1
            if bucket.header.last:
                break
        batch = self._finish(previous) if previous is not None else []
        self.assembler.finish()
        if batch:
            yield batch
        self._take_back()
        self.receiver.expect_refit()

    def _next_header(self, bucket_index: int) -> BucketHeader:
        refit = self.refit
        with timed(self.stats, "transfer_seconds"):
            raw = self.receiver.recv_header(refit.timeout_s)
        header = decode_header(raw, bucket_size=refit.bucket_size, memo=self.memo.headers)
        if header.abort is not None:
            raise RemoteRefitError(
                f"the sender aborted refit {header.refit_index} at bucket {header.bucket_index}: {header.abort}"
            )
        if (header.refit_index, header.bucket_index) != (refit.context.refit_index, bucket_index):
            raise WireFormatError(
                f"expected bucket {bucket_index} of refit {refit.context.refit_index}, got bucket "
                f"{header.bucket_index} of refit {header.refit_index}: the stream is out of step"
            )
        return header

    def _plan(self, header: BucketHeader) -> _PlannedBucket:
        """Place every chunk of the bucket before its bytes arrive; a direct chunk is received
        straight into its output tensor when that lives on the transport's device."""
        start = time.perf_counter()
        slot = header.bucket_index % self.receiver.num_slots
        device = self.receiver.buffer(slot).device
        outputs_here = self.assembler.device in (None, device)
        if device.type == "cpu" and outputs_here and self.assembler.idle:
            runs = self.memo.small_runs(header)
            if runs is not None:
                self.stats.unpack_seconds += time.perf_counter() - start
                return _PlannedBucket(header, slot, [], [], [], runs)
        landings = []
        received: list[torch.Tensor | None] = []
        for meta in header.chunks:
            if meta.offset is None:
                if not self.receiver.direct_chunks:
                    raise WireFormatError(
                        f"tensor {meta.name!r} arrives as a direct chunk, which this receiver "
                        f"({type(self.receiver).__name__}) cannot take: sender and receiver run "
                        "different transports"
                    )
                landing = self.assembler.plan(meta, device, in_place=outputs_here)
                if outputs_here:
                    assert landing.target is not None
                    received.append(landing.target)
                else:
                    received.append(torch.empty(meta.chunk_size, dtype=torch.uint8, device=device))
            else:
                landing = self.assembler.plan(meta, device, borrow=self.borrow)
                received.append(None)
            landings.append(landing)
        self.stats.unpack_seconds += time.perf_counter() - start
        direct = [tensor for tensor in received if tensor is not None]
        self.stats.direct_chunks += len(direct)
        return _PlannedBucket(header, slot, landings, received, direct)

    def _finish(self, bucket: _PlannedBucket) -> list[tuple[str, torch.Tensor]]:
        """Verify a bucket whose bytes have all arrived, copy out its packed chunks and
        release its slot; returns the tensors it completed."""
        header = bucket.header
        payload = self.receiver.buffer(bucket.slot)[: header.payload_nbytes]
        checksum = self.refit.checksum
        if checksum is not None and header.checksum is not None:
            with timed(self.stats, "checksum_seconds"):
                actual = bucket_digest(checksum, [payload, *bucket.direct])
            if actual != header.checksum:
                raise IntegrityError(
                    f"bucket {header.bucket_index} of refit {header.refit_index} is corrupt: "
                    f"checksum {actual:#018x} != header's {header.checksum:#018x} "
                    f"({header.payload_nbytes} packed bytes, {len(bucket.direct)} direct chunks); "
                    "the refit is void"
                )
        start = time.perf_counter()
        if bucket.small_runs is not None:
            return self._finish_small(bucket, payload, start)
        done: list[tuple[str, torch.Tensor]] = []
        small = SmallTensorLander(payload)
        for landing, received in zip(bucket.landings, bucket.received):
            meta = landing.meta
            offset = meta.offset
            if landing.borrowed:
                assert offset is not None
                done += small.flush()
                done.append((meta.name, landing.borrow_from(payload, offset)))
                continue
            if received is None and offset is not None and small.add(landing, offset):
                continue
            done += small.flush()  # landed before this chunk's tensor: keeps the stream's order
            if received is None:
                assert offset is not None  # a packed chunk (checked when the header was planned)
                tensor = landing.fill_from(payload, offset)
            elif received is landing.target:
                tensor = landing.landed()
            else:
                tensor = landing.fill(received)
            if tensor is not None:
                done.append((meta.name, tensor))
        done += small.flush()
        return self._finished(bucket, done, any(landing.borrowed for landing in bucket.landings), start)

    def _finish_small(
        self, bucket: _PlannedBucket, payload: torch.Tensor, start: float
    ) -> list[tuple[str, torch.Tensor]]:
        """:meth:`_finish` for a bucket of small whole tensors: lent run by run, or owned, in
        the memory the transport hands over (:meth:`BucketReceiver.hand_over`) or copied out."""
        assert bucket.small_runs is not None
        done: list[tuple[str, torch.Tensor]] = []
        if self.borrow:
            for run in bucket.small_runs:
                done += run.lend(payload)
            return self._finished(bucket, done, bool(done), start)
        if payload.data_ptr() % 64 == 0 and self.receiver.hand_over(bucket.slot, bucket.header.payload_nbytes):
            self.stats.handed_over_buckets += 1
            for run in bucket.small_runs:
                done += run.adopt(payload)
        else:
            for run in bucket.small_runs:
                done += run.land(payload)
        return self._finished(bucket, done, False, start)

    def _finished(
        self, bucket: _PlannedBucket, done: list[tuple[str, torch.Tensor]], lent: bool, start: float
    ) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors are out: its slot is released (or, if ``lent``, kept until the
        caller asks for the next batch), and it is counted."""
        if lent:
            self._lent_slot = bucket.slot
        else:
            self.receiver.release(bucket.slot)
        self.stats.unpack_seconds += time.perf_counter() - start
        header = bucket.header
        self.stats.payload_bytes += sum(m.chunk_size for m in header.chunks)
        self.stats.buckets += 1
        nbytes = header.payload_nbytes + sum(t.numel() for t in bucket.direct)
        self.refit.notifier.bucket_received(self.refit.context, header.bucket_index, nbytes, len(header.chunks))
        return done
