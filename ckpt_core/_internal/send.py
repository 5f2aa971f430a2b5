"""The sending half of the refit pipeline (:mod:`ckpt_core._internal.pipeline` tells the whole).

Sender: a :class:`~ckpt_core._internal.bucket_plan.BucketPlan` lays chunks out in buckets (closing one early
at ``MAX_CHUNKS_PER_BUCKET`` chunks, so many small tensors stream instead of waiting for a full
bucket, and after slow weights that took ``SLOW_BUCKET_S`` in all to come, so the wire works
while the generator does; a tensor of at most ``KEEP_WHOLE_BYTES``, or any that fits a bucket when a
receiver borrows, opens a new bucket rather than being split over two). A chunk of at least
``direct_min_bytes`` goes *direct* when the transport allows it (``direct_chunks``): it is sent
from the caller's tensor as a message of its own. Every other chunk is copied into the
transport's slot buffer, packed at the next offset aligned to its element size (its place in
the plan, unless direct chunks left room before it). Each bucket is checksummed and posted
with its header; packing then continues in the other slot while the first is in flight
(double buffering). The last bucket carries ``last=True``, so a refit of no tensors is one
empty bucket.

Refits of one run repeat their packing. A sender given a
:class:`~ckpt_core._internal.replay.PackingRecord` replays the last refit's buckets while the
weights repeat its tensors (each chunk moved as last time, no chunking or metadata built, the
encoded chunk list reused), and plans afresh from the first tensor that differs.

A sender whose weights fail mid-stream (its generator raises, a weight is not a tensor, a name
repeats) posts an ``abort`` header, so receivers fail at once with ``RemoteRefitError`` instead
of timing out.

What the sender reads of a yielded tensor, and until when (the generator's contract, in
docs/reliability.md): a packed chunk is copied before the next weight is asked for; a direct
chunk is read until its bucket's slot is waited on again, i.e. until the weights yielded after
the tensor hold more than ``num_slots * bucket_size`` bytes, or the refit ends. A direct chunk's
storage is checked when its bucket is posted (a generator that freed it is refused, where Gloo
would abort on it), and with a checksum its digest is taken as it is yielded. Replays read no
tensor later than the first refit did (:mod:`ckpt_core._internal.replay`).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ckpt_core._internal.bucket_io import BucketSender
from ckpt_core._internal.bucket_plan import BucketPlan
from ckpt_core._internal.checksum import payload_checksum
from ckpt_core._internal.host_alloc import SMALL_COPY_BYTES, host_address
from ckpt_core._internal.pipeline import Checksum, RefitRun, combined_digest, timed
from ckpt_core._internal.replay import PackingRecord, RecordedBucket, held_apart, replays
from ckpt_core._internal.wire import BucketHeader, encode_chunks, encode_header
from ckpt_core.contract import TensorMeta
from ckpt_core.errors import (
    TransferError,
    UnsupportedTensorError,
)
from ckpt_core.hooks import RefitNotifier
from ckpt_core.stats import RefitContext, RefitStats
from ckpt_core.tensors import check_still_held, tensor_bytes

DIRECT_MIN_BYTES = 1 << 20
"""Chunks this large go direct: one more message costs less than copying them in and out."""

MAX_CHUNKS_PER_BUCKET = 512
"""A bucket of many small tensors is posted at this many chunks, so the receiver unpacks one
while the sender packs the next instead of waiting for a whole bucket of them."""


SLOW_WEIGHT_S = 1e-3
"""A weight that took this long or longer to come from the generator (a stage comparing it,
quantizing it, a trainer gathering it), half of it working on the refit's thread, is *slow*.
(The thread's own time tells work from a thread the machine merely paused.)"""

SLOW_BUCKET_S = 8e-3
"""Once the slow weights packed in the open bucket took this long in all to come, the bucket
is posted as soon as the last of them is packed, so the wire and the receivers work while the
next ones come. Not at every slow weight: each bucket costs both sides a header, a hand-off
and the transport's wake-ups (on two cores, that time is the comparisons'), and the receiver
is at most this far behind the generator."""


_THREAD_SAMPLE_S = SLOW_WEIGHT_S / 4
# The thread's CPU clock is a system call (about 0.6 us here, a third of a small tensor's whole
# cost), so it is read at most this often; the CPU time it then counts before a weight was
# asked for stays under half of what a slow weight must show, so a paused thread is never
# taken for a slow weight.


class _Clock:
    """Whether the weight asked for since :meth:`ask` was slow to come: ``SLOW_WEIGHT_S`` of
    wall time, half of it on this thread's CPU (a thread the machine paused is not slow)."""

    __slots__ = ("_wall", "_sampled", "_thread")

    def __init__(self) -> None:
        self._wall = self._thread = 0.0
        self._sampled = -math.inf

    def ask(self) -> None:
        self._wall = time.perf_counter()
        if self._wall - self._sampled >= _THREAD_SAMPLE_S:
            self._sampled, self._thread = self._wall, time.thread_time()

    def slow(self) -> float:
        """The weight's wall time to come if it was slow, else 0."""
        wall = time.perf_counter() - self._wall
        return wall if wall >= SLOW_WEIGHT_S and time.thread_time() - self._thread >= SLOW_WEIGHT_S / 2 else 0.0


KEEP_WHOLE_BYTES = 64 << 10
"""A tensor this small that does not fit in the room left in a bucket opens the next one
(wasting at most this much of a bucket) instead of being split, so a receiver lands it from one
bucket with the other small tensors there, not as a tensor assembled from two."""


def direct_min_bytes(bucket_size: int) -> int:
    """The smallest chunk sent direct: ``DIRECT_MIN_BYTES``, or a quarter of a smaller bucket
    (so small test buckets exercise both paths)."""
    return min(DIRECT_MIN_BYTES, max(1, bucket_size // 4))


def send_refit(
    weights: Iterable[tuple[str, torch.Tensor]],
    sender: BucketSender,
    *,
    bucket_size: int,
    context: RefitContext,
    notifier: RefitNotifier,
    timeout_s: float,
    checksum: Checksum | None = payload_checksum,
    direct: bool = True,
    record: PackingRecord | None = None,
    cancel: threading.Event | None = None,
    stats: RefitStats | None = None,
) -> RefitStats:
    """Send every weight of one refit through ``sender``; returns this sender's statistics.
    ``direct=False`` packs every chunk into the slot buffers even where the transport takes
    direct chunks (for receivers that lend out their buffers: a direct chunk lands in fresh
    memory instead). ``record``: this sender's record of its last refit, replayed where the
    weights repeat it and rewritten from this one (:mod:`ckpt_core._internal.replay`).
    ``stats`` (if given) is filled in as the refit runs (a stage over ``weights`` may count
    into it too) and returned.

    Blocking: runs on the calling thread (the engine gives it a thread of its own) and returns
    once every bucket was delivered. ``cancel``: once set, the refit stops with
    ``RefitCancelled`` before the next weight or bucket, and its receivers are sent an abort."""
    stats = stats if stats is not None else RefitStats()
    refit = RefitRun(bucket_size, context, notifier, stats, timeout_s, checksum, cancel)
    start = time.perf_counter()
    notifier.started(context)
    packer = _BucketPacker(sender, refit, direct=direct, record=record)
    try:
        rest, open_bucket = packer.replay(iter(weights))
        seen: set[str] | None = None
        plan = BucketPlan(
            bucket_size, max_chunks=MAX_CHUNKS_PER_BUCKET, keep_whole=packer.keep_whole, open_bucket=open_bucket
        )
        chunks = plan.chunks(rest)
        slow = 0.0  # the weight being packed took this long to come (0: less than SLOW_WEIGHT_S)
        slow_in_bucket = 0.0  # the open bucket's slow weights took this long to come
        clock = _Clock()
        while True:
            clock.ask()
            meta, chunk = next(chunks, (None, None))
            if meta is None or chunk is None:
                break
            if meta.chunk_offset == 0:
                slow = clock.slow() or packer.slow_first
                packer.slow_first = 0.0
                refit.check_cancel()
                if seen is None:
                    seen = packer.replayed_names()
                if meta.name in seen:
                    raise UnsupportedTensorError(
                        f"weight name {meta.name!r} appears twice in one refit; names must be unique"
                    )
                seen.add(meta.name)
                stats.tensors += 1
            if packer.opens_bucket(meta):
                packer.post(last=False)
                slow_in_bucket = 0.0
            packer.add(meta, chunk)
            if slow and meta.chunk_offset + meta.chunk_size == meta.nbytes:
                slow_in_bucket += slow
                if slow_in_bucket >= SLOW_BUCKET_S:
                    # The next weights will likely be as slow to come: the receivers take these
                    # meanwhile, instead of waiting for a full bucket.
                    packer.post(last=False, paced=True)
                    plan.close_bucket()
                    slow_in_bucket = 0.0
        packer.finish()
    except TransferError as exc:
        packer.forget()
        notifier.failed(context, exc)
        raise
    except BaseException as exc:
        packer.forget()
        packer.abort(f"{type(exc).__name__}: {exc}")
        notifier.failed(context, exc)
        raise
    stats.seconds = time.perf_counter() - start
    notifier.finished(context, stats)
    return stats


_END = object()


class _BucketPacker:
    """Fills slot buffers in turn and posts each bucket as it closes."""

    def __init__(self, sender: BucketSender, refit: RefitRun, *, direct: bool, record: PackingRecord | None) -> None:
        self.sender = sender
        self.refit = refit
        self.stats = refit.stats
        self.direct_min = direct_min_bytes(refit.bucket_size) if sender.direct_chunks and direct else None
        # With the default pack into a host buffer, small chunks are copied here, without the
        # per-call checks that cost more than a 4 KiB copy (the buffer is checked once per slot).
        self.packs_itself = type(sender).pack is BucketSender.pack
        # Tensors this small are never split over two buckets, so receivers take them from one
        # (all of them, for receivers that lend their buffers out: direct=False).
        self.keep_whole = refit.bucket_size if not direct else min(KEEP_WHOLE_BYTES, refit.bucket_size)
        self.record = record
        # With a record, the small tensors each bucket copies are kept until it is posted, to
        # learn whether their memory outlived the weights yielded after them (see post()).
        self.tracks_sources = record is not None and self.packs_itself
        self.settings = (
            refit.bucket_size,
            self.direct_min,
            self.keep_whole,
            self.packs_itself,
            sender.num_slots,
            str(sender.buffer(0).device),
        )
        if record is not None:
            record.start()
        self.replayed: list[RecordedBucket] = []  # buckets of the record this refit repeated
        self.slow_first = 0.0  # replay stopped at a weight this slow to come (0: none)
        self.host_base: int | None = None
        self.bucket_index = 0
        self.chunks: list[TensorMeta] = []
        self.direct: list[torch.Tensor] = []
        self.direct_names: list[str] = []  # per direct chunk: its weight, for messages
        self.direct_digests: list[tuple[int, int]] = []  # per direct chunk: (length, digest)
        self.sources: list[tuple[int, int, torch.Tensor]] = []  # small whole tensors copied: (address, bytes, tensor)
        self.plan_ends: list[int] = []  # per chunk of the open bucket: the plan's end after it
        self.repeated: RecordedBucket | None = None  # the recorded bucket the open one repeats whole
        self.replayable = True  # every chunk of the open bucket is from a host tensor
        self.plan_end = 0  # end of the last chunk in split_weight_chunks' plan of this bucket
        self.packed_end = 0  # end of the last chunk packed into the slot
        self.slot = 0
        self.buffer = self._acquire_slot()

    def _acquire_slot(self) -> torch.Tensor:
        self.slot = self.bucket_index % self.sender.num_slots
        with timed(self.stats, "transfer_seconds"):
            self.sender.wait_slot(self.slot, self.refit.timeout_s)
        buffer = self.sender.buffer(self.slot)
        self.host_base = host_address(buffer, self.refit.bucket_size) if self.packs_itself else None
        return buffer

    def opens_bucket(self, meta: TensorMeta) -> bool:
        """Whether ``meta`` starts a new bucket in the plan (or, for a zero-size chunk the
        plan cannot tell apart, the open bucket is full of chunks): post the open one first."""
        assert meta.offset is not None
        return meta.offset < self.plan_end or len(self.chunks) >= MAX_CHUNKS_PER_BUCKET

    def add(self, meta: TensorMeta, chunk: torch.Tensor) -> None:
        """Pack (or queue as direct) one chunk of the open bucket."""
        assert meta.offset is not None
        self.plan_end = meta.offset + meta.chunk_size
        self.stats.payload_bytes += meta.chunk_size
        self.repeated = None  # the chunk list differs from the replayed one now
        if self.direct_min is not None and meta.chunk_size >= self.direct_min and chunk.device == self.buffer.device:
            self.chunks.append(TensorMeta(meta.name, meta.shape, meta.dtype, meta.chunk_offset, meta.chunk_size, None))
            self._add_direct(meta.name, chunk)
            self.plan_ends.append(self.plan_end)
            self.replayable = self.replayable and chunk.is_cpu
            return
        # Packed chunks close up the room direct chunks left, keeping their alignment; they
        # never move past their place in the plan, so the slot cannot overflow.
        itemsize = meta.dtype.itemsize
        align = itemsize if itemsize <= self.refit.bucket_size else 1
        offset = -(-self.packed_end // align) * align
        if meta.chunk_size:
            start = time.perf_counter()  # inline, not _timed: this runs once per chunk
            if self.host_base is not None and meta.chunk_size <= SMALL_COPY_BYTES and chunk.is_cpu:
                ctypes.memmove(self.host_base + offset, chunk.data_ptr(), meta.chunk_size)
                if self.tracks_sources and meta.chunk_offset == 0 and meta.chunk_size == meta.nbytes:
                    self.sources.append((chunk.data_ptr(), meta.chunk_size, chunk))
            else:
                self.sender.pack(self.slot, offset, chunk)
            self.stats.pack_seconds += time.perf_counter() - start
        if offset != meta.offset:
            meta = TensorMeta(meta.name, meta.shape, meta.dtype, meta.chunk_offset, meta.chunk_size, offset)
        self.chunks.append(meta)
        self.packed_end = offset + meta.chunk_size
        self.plan_ends.append(self.plan_end)
        if not chunk.is_cpu:
            self.replayable = False

    def _add_direct(self, name: str, chunk: torch.Tensor) -> None:
        """Queue a direct chunk of weight ``name`` for the open bucket. Its digest (with
        checksums on) is taken now, as the weight is yielded: bytes the generator changes
        before the transfer reads them then fail the receiver's check."""
        self.direct.append(chunk)
        self.direct_names.append(name)
        if self.refit.checksum is not None:
            start = time.perf_counter()  # inline, not _timed: this runs once per direct chunk
            self.direct_digests.append((chunk.numel(), self.refit.checksum(chunk)))
            self.stats.checksum_seconds += time.perf_counter() - start
        self.stats.direct_chunks += 1

    def replay(self, weights: Iterator[Any]) -> tuple[Iterator[Any], tuple[int, int]]:
        """Repeat the record's buckets while ``weights`` repeat their tensors: each chunk is
        copied (or queued direct) as it was last time, each bucket posted with its recorded
        chunk list. The record's last bucket, or the one a differing tensor (or one that took
        ``SLOW_WEIGHT_S`` to come, which the general path then posts once packed) arrives in,
        stays open. Returns the weights left for the general path (the differing one first) and the
        open bucket's ``(bytes laid out, chunks)``."""
        buckets = self.record.replayable_for(self.settings) if self.record is not None else []
        clock = _Clock()
        address = 0  # of the tensor whose chunks are being replayed, its item in `item`
        item: Any = None
        memmove = ctypes.memmove
        for number, bucket in enumerate(buckets):
            if not bucket.replayable:
                break
            start = time.perf_counter()
            base = self.host_base
            spans = bucket.spans if base is not None else {}
            chunks = bucket.chunks
            tensors = 0
            index = 0
            while index < len(chunks):
                span = spans.get(index)
                if span is not None and span.copies:
                    count = span.stop - index
                    items = list(itertools.islice(weights, count))
                    repeated = span.repeats(items) if len(items) == count else None
                    if repeated is not None and span.copy(repeated, self.buffer):
                        tensors += count
                        index = span.stop
                        continue
                    weights = itertools.chain(items, weights)  # one by one: they find what differs
                meta = chunks[index]
                index += 1
                if meta.chunk_offset == 0:  # a tensor's first chunk: the next weight must repeat it
                    clock.ask()
                    item = next(weights, _END)
                    found = replays(item, meta) if item is not _END else None
                    took = clock.slow() if found is not None else 0.0
                    if took:
                        found, self.slow_first = None, took  # the general path counts it once packed
                    if found is None:
                        self._replayed(tensors, start)
                        self._adopt(bucket, index - 1)
                        rest = weights if item is _END else itertools.chain((item,), weights)
                        return rest, self.open_bucket()
                    address = found
                    tensors += 1
                offset, size = meta.offset, meta.chunk_size
                if offset is not None and base is not None and size <= SMALL_COPY_BYTES:
                    if size:
                        memmove(base + offset, address + meta.chunk_offset, size)
                        if meta.chunk_offset == 0 and size == meta.nbytes:
                            self.sources.append((address, size, item[1]))
                else:
                    self._replay_chunk(meta, item[1])
            self._replayed(tensors, start)
            self._adopt(bucket, len(bucket.chunks))
            if number == len(buckets) - 1:
                break  # the recorded stream's end: later weights, or none, decide
            self.replayed.append(bucket)
            self.post(last=False)
        return weights, self.open_bucket()

    def _replayed(self, tensors: int, start: float) -> None:
        self.stats.tensors += tensors
        self.stats.replayed_tensors += tensors
        self.stats.pack_seconds += time.perf_counter() - start

    def _replay_chunk(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        """Move a recorded chunk of ``tensor`` that the packer does not copy itself (a direct
        chunk, or one the transport packs) as it moved last time."""
        data = tensor_bytes(tensor)[meta.chunk_offset : meta.chunk_offset + meta.chunk_size]
        if meta.offset is None:
            self._add_direct(meta.name, data)
        else:
            self.sender.pack(self.slot, meta.offset, data)

    def _adopt(self, bucket: RecordedBucket, count: int) -> None:
        """The open bucket holds the first ``count`` chunks of ``bucket``, replayed."""
        chunks = bucket.chunks[:count]
        self.chunks = list(chunks)
        self.repeated = bucket if count == len(bucket.chunks) else None
        self.stats.payload_bytes += sum(meta.chunk_size for meta in chunks)
        packed = [meta.offset + meta.chunk_size for meta in chunks if meta.offset is not None]
        self.packed_end = max(packed, default=0)
        self.plan_ends = list(bucket.plan_ends[:count])
        self.plan_end = self.plan_ends[-1] if count else 0

    def open_bucket(self) -> tuple[int, int]:
        """``(bytes laid out, chunks)`` of the open bucket, where the general plan resumes."""
        return self.plan_end, len(self.chunks)

    def replayed_names(self) -> set[str]:
        """Names of the tensors sent so far by replay (a later one must not repeat them)."""
        names = {meta.name for bucket in self.replayed for meta in bucket.chunks}
        names.update(meta.name for meta in self.chunks)
        return names

    def forget(self) -> None:
        """The refit failed: its record is incomplete, and the last one may not be replayed."""
        if self.record is not None:
            self.record.clear()

    def finish(self) -> None:
        self.post(last=True)
        for slot in range(self.sender.num_slots):
            with timed(self.stats, "transfer_seconds"):
                self.sender.wait_slot(slot, self.refit.timeout_s)
        if self.record is not None:
            self.record.complete(self.settings)

    def post(self, *, last: bool, paced: bool = False) -> None:
        """Post the open bucket: the slot's packed bytes, then its direct chunks (``paced``:
        early, the next weights being slow to come; see ``BucketHeader``)."""
        refit = self.refit
        refit.check_cancel()
        for name, chunk in zip(self.direct_names, self.direct):  # their bytes are read from now on
            check_still_held(name, chunk)
        digest = None
        if refit.checksum is not None:
            with timed(self.stats, "checksum_seconds"):
                payload = (self.packed_end, refit.checksum(self.buffer[: self.packed_end]))
                digest = combined_digest([payload, *self.direct_digests])
        chunks = tuple(self.chunks)
        header = BucketHeader(
            refit_index=refit.context.refit_index,
            bucket_index=self.bucket_index,
            payload_nbytes=self.packed_end,
            last=last,
            chunks=chunks,
            checksum=digest,
            paced=paced,
        )
        encoded = self.repeated.encoded if self.repeated is not None else encode_chunks(chunks)
        raw = encode_header(header, encoded_chunks=encoded)
        with timed(self.stats, "transfer_seconds"):
            if self.direct:
                self.sender.post(self.slot, raw, self.packed_end, refit.timeout_s, self.direct)
            else:
                self.sender.post(self.slot, raw, self.packed_end, refit.timeout_s)
        nbytes = self.packed_end + sum(chunk.numel() for chunk in self.direct)
        refit.notifier.bucket_sent(refit.context, self.bucket_index, nbytes, len(chunks))
        if self.record is not None:
            self._record(chunks, encoded)
        self.stats.buckets += 1
        self.bucket_index += 1
        self.chunks = []
        self.direct = []
        self.direct_names = []
        self.direct_digests = []
        self.sources = []
        self.repeated = None
        self.plan_ends = []
        self.replayable = True
        self.plan_end = self.packed_end = 0
        if not last:
            self.buffer = self._acquire_slot()

    def _record(self, chunks: tuple[TensorMeta, ...], encoded: bytes) -> None:
        """Record the bucket just posted. Its small tensors may be replayed in spans (several
        taken from the generator before the first is copied) only if they could have been
        here: each still had its memory, apart from the others', when the bucket closed, after
        the generator had yielded every later tensor of the bucket and the next one. A
        generator that frees or refills a weight once it yields the next is then replayed one
        tensor at a time, as this refit read it. A bucket repeated whole keeps its record
        while that answer stays the same."""
        assert self.record is not None
        spans_safe = self.host_base is not None and held_apart(self.sources)
        repeated = self.repeated
        if repeated is None or repeated.spans_safe != spans_safe:
            small = SMALL_COPY_BYTES if spans_safe else None
            repeated = RecordedBucket(
                chunks, self.plan_ends, self.replayable, encoded, small_bytes=small, spans_safe=spans_safe
            )
        self.record.add(repeated)

    def abort(self, message: str) -> None:
        """Tell receivers this refit is void. Best effort: the refit is failing anyway."""
        header = BucketHeader(
            refit_index=self.refit.context.refit_index,
            bucket_index=self.bucket_index,
            payload_nbytes=0,
            last=True,
            abort=message[:4000],
        )
        slot = self.bucket_index % self.sender.num_slots
        timeout_s = self.refit.timeout_s
        try:
            self.sender.wait_slot(slot, timeout_s)
            self.sender.post(slot, encode_header(header), 0, timeout_s)
            for other in range(self.sender.num_slots):
                self.sender.wait_slot(other, timeout_s)
        except Exception:  # noqa: BLE001 - the original error is what the caller needs
            pass
