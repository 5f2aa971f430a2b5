"""The refit pipeline every transport shares: pack, describe, move, verify, reassemble.

Sender: ``split_weight_chunks`` lays chunks out in buckets; each chunk is copied into the
transport's slot buffer at its (dtype-aligned) bucket offset; the full slot is checksummed and
posted with its header; packing then continues in the other slot while the first is in flight
(double buffering). The last bucket carries ``last=True``, so a refit of no tensors is one
empty bucket.

Receiver: for each header, the payload is posted into its slot; while it arrives, the previous
bucket is verified and reassembled by ``merge_weight_chunk_batches``, which copies tensors out
before the slot is released back to the sender.

A sender whose weights fail mid-stream (its generator raises, a weight is not a tensor, a name
repeats) posts an ``abort`` header, so receivers fail at once with ``RemoteRefitError`` instead
of timing out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from contextlib import contextmanager

import torch

from .base import TensorMeta, merge_weight_chunk_batches, split_weight_chunks
from .checksum import payload_checksum
from .errors import (
    IntegrityError,
    RemoteRefitError,
    TransferError,
    UnsupportedTensorError,
    WireFormatError,
)
from .hooks import RefitNotifier
from .stats import RefitContext, RefitStats
from .transport import BucketReceiver, BucketSender
from .wire import BucketHeader, decode_header, encode_header

Checksum = Callable[[torch.Tensor], int]


@contextmanager
def _timed(stats: RefitStats, field: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        setattr(stats, field, getattr(stats, field) + time.perf_counter() - start)


async def send_refit(
    weights: Generator[tuple[str, torch.Tensor], None, None],
    sender: BucketSender,
    *,
    bucket_size: int,
    context: RefitContext,
    notifier: RefitNotifier,
    timeout_s: float,
    checksum: Checksum | None = payload_checksum,
) -> RefitStats:
    """Send every weight of one refit through ``sender``; returns this sender's statistics."""
    stats = RefitStats()
    start = time.perf_counter()
    notifier.started(context)
    packer = _BucketPacker(sender, bucket_size, context, notifier, stats, timeout_s, checksum)
    try:
        seen: set[str] = set()
        for meta, chunk in split_weight_chunks(weights, bucket_size):
            if meta.chunk_offset == 0:
                if meta.name in seen:
                    raise UnsupportedTensorError(
                        f"weight name {meta.name!r} appears twice in one refit; names must be unique"
                    )
                seen.add(meta.name)
                stats.tensors += 1
            await packer.add(meta, chunk)
        await packer.finish()
    except TransferError as exc:
        notifier.failed(context, exc)
        raise
    except BaseException as exc:
        packer.abort(f"{type(exc).__name__}: {exc}")
        notifier.failed(context, exc)
        raise
    stats.seconds = time.perf_counter() - start
    notifier.finished(context, stats)
    return stats


class _BucketPacker:
    """Fills slot buffers in turn and posts each bucket as it closes."""

    def __init__(
        self,
        sender: BucketSender,
        bucket_size: int,
        context: RefitContext,
        notifier: RefitNotifier,
        stats: RefitStats,
        timeout_s: float,
        checksum: Checksum | None,
    ) -> None:
        self.sender = sender
        self.bucket_size = bucket_size
        self.context = context
        self.notifier = notifier
        self.stats = stats
        self.timeout_s = timeout_s
        self.checksum = checksum
        self.bucket_index = 0
        self.chunks: list[TensorMeta] = []
        self.end = 0  # end of the last chunk packed into the open bucket
        self.slot = 0
        self.buffer = self._acquire_slot()

    def _acquire_slot(self) -> torch.Tensor:
        self.slot = self.bucket_index % self.sender.num_slots
        with _timed(self.stats, "transfer_seconds"):
            self.sender.wait_slot(self.slot, self.timeout_s)
        return self.sender.buffer(self.slot)

    async def add(self, meta: TensorMeta, chunk: torch.Tensor) -> None:
        """Pack one chunk, first posting the open bucket if the chunk starts a new one."""
        assert meta.offset is not None
        if meta.offset < self.end:
            await self._post(last=False)
        if self._fills_bucket_alone(meta, chunk):
            self.chunks.append(meta)
            self.end = meta.chunk_size
            self.stats.payload_bytes += meta.chunk_size
            await self._post(last=False, direct=chunk)
            return
        if meta.chunk_size:
            start = time.perf_counter()  # inline, not _timed: this runs once per chunk
            self.sender.pack(self.slot, meta.offset, chunk)
            self.stats.pack_seconds += time.perf_counter() - start
        self.chunks.append(meta)
        self.end = meta.offset + meta.chunk_size
        self.stats.payload_bytes += meta.chunk_size

    def _fills_bucket_alone(self, meta: TensorMeta, chunk: torch.Tensor) -> bool:
        """A chunk that leaves no room for another element in its bucket can be sent from
        where it is, when the transport allows it, instead of being copied into a slot."""
        return (
            self.sender.accepts_external_payload
            and meta.offset == 0
            and self.end == 0
            and self.bucket_size - meta.chunk_size < meta.dtype.itemsize
            and chunk.device == self.buffer.device
        )

    async def finish(self) -> None:
        await self._post(last=True)
        for slot in range(self.sender.num_slots):
            with _timed(self.stats, "transfer_seconds"):
                self.sender.wait_slot(slot, self.timeout_s)

    async def _post(self, *, last: bool, direct: torch.Tensor | None = None) -> None:
        """Post the open bucket: the slot's bytes, or ``direct`` (a chunk sent from its source)."""
        payload = self.buffer[: self.end] if direct is None else direct
        digest = None
        if self.checksum is not None:
            with _timed(self.stats, "checksum_seconds"):
                digest = self.checksum(payload)
        header = BucketHeader(
            refit_index=self.context.refit_index,
            bucket_index=self.bucket_index,
            payload_nbytes=self.end,
            last=last,
            chunks=tuple(self.chunks),
            checksum=digest,
        )
        slot = self.bucket_index % self.sender.num_slots
        with _timed(self.stats, "transfer_seconds"):
            if direct is None:
                self.sender.post(slot, encode_header(header), self.end, self.timeout_s)
            else:
                self.sender.post(slot, encode_header(header), self.end, self.timeout_s, payload=direct)
        self.notifier.bucket_sent(self.context, self.bucket_index, self.end, len(self.chunks))
        self.stats.buckets += 1
        self.bucket_index += 1
        self.chunks = []
        self.end = 0
        if not last:
            self.buffer = self._acquire_slot()
            await asyncio.sleep(0)  # let the caller's event loop breathe between buckets

    def abort(self, message: str) -> None:
        """Tell receivers this refit is void. Best effort: the refit is failing anyway."""
        header = BucketHeader(
            refit_index=self.context.refit_index,
            bucket_index=self.bucket_index,
            payload_nbytes=0,
            last=True,
            abort=message[:4000],
        )
        slot = self.bucket_index % self.sender.num_slots
        try:
            self.sender.wait_slot(slot, self.timeout_s)
            self.sender.post(slot, encode_header(header), 0, self.timeout_s)
            for other in range(self.sender.num_slots):
                self.sender.wait_slot(other, self.timeout_s)
        except Exception:  # noqa: BLE001 - the original error is what the caller needs
            pass


async def receive_refit(
    receiver: BucketReceiver,
    *,
    bucket_size: int,
    context: RefitContext,
    notifier: RefitNotifier,
    timeout_s: float,
    checksum: Checksum | None = payload_checksum,
    merge_device: torch.device | str | None = None,
    stats: RefitStats | None = None,
) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
    """Yield the ``(name, tensor)`` batches of one refit, one batch per bucket that completes
    tensors. Tensors own their memory. ``checksum`` (the sender's function) verifies every
    bucket whose header carries a digest; ``None`` skips verification. ``stats`` (if given)
    is filled in as the refit runs."""
    stats = stats if stats is not None else RefitStats()
    start = time.perf_counter()
    notifier.started(context)
    buckets = _BucketStream(receiver, bucket_size, context, notifier, stats, timeout_s, checksum)
    try:
        async for batch in merge_weight_chunk_batches(buckets.chunk_batches(), merge_device=merge_device):
            stats.unpack_seconds += time.perf_counter() - buckets.handed_out_at
            stats.tensors += len(batch)
            yield batch
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit):
            notifier.failed(context, exc)
        raise
    stats.seconds = time.perf_counter() - start
    notifier.finished(context, stats)


class _BucketStream:
    """Turns headers and payloads from a receiver into verified chunk batches, one per bucket."""

    def __init__(
        self,
        receiver: BucketReceiver,
        bucket_size: int,
        context: RefitContext,
        notifier: RefitNotifier,
        stats: RefitStats,
        timeout_s: float,
        checksum: Checksum | None,
    ) -> None:
        self.receiver = receiver
        self.bucket_size = bucket_size
        self.context = context
        self.notifier = notifier
        self.stats = stats
        self.timeout_s = timeout_s
        self.checksum = checksum
        self.handed_out_at = time.perf_counter()

    def _next_header(self, bucket_index: int) -> BucketHeader:
        with _timed(self.stats, "transfer_seconds"):
            raw = self.receiver.recv_header(self.timeout_s)
        header = decode_header(raw, bucket_size=self.bucket_size)
        if header.abort is not None:
            raise RemoteRefitError(
                f"the sender aborted refit {header.refit_index} at bucket {header.bucket_index}: "
                f"{header.abort}"
            )
        if (header.refit_index, header.bucket_index) != (self.context.refit_index, bucket_index):
            raise WireFormatError(
                f"expected bucket {bucket_index} of refit {self.context.refit_index}, got bucket "
                f"{header.bucket_index} of refit {header.refit_index}: the stream is out of step"
            )
        return header

    def _verified_chunks(self, header: BucketHeader) -> list[tuple[TensorMeta, torch.Tensor]]:
        slot = header.bucket_index % self.receiver.num_slots
        with _timed(self.stats, "transfer_seconds"):
            self.receiver.wait_payload(slot, self.timeout_s)
        payload = self.receiver.buffer(slot)[: header.payload_nbytes]
        if self.checksum is not None and header.checksum is not None:
            with _timed(self.stats, "checksum_seconds"):
                actual = self.checksum(payload)
            if actual != header.checksum:
                raise IntegrityError(
                    f"bucket {header.bucket_index} of refit {header.refit_index} is corrupt: "
                    f"payload checksum {actual:#018x} != header's {header.checksum:#018x} "
                    f"({header.payload_nbytes} bytes); the refit is void"
                )
        self.stats.payload_bytes += sum(m.chunk_size for m in header.chunks)
        self.stats.buckets += 1
        self.notifier.bucket_received(
            self.context, header.bucket_index, header.payload_nbytes, len(header.chunks)
        )
        return [(m, payload[m.offset : m.offset + m.chunk_size]) for m in header.chunks]  # type: ignore[operator]

    async def chunk_batches(self) -> AsyncGenerator[list[tuple[TensorMeta, torch.Tensor]], None]:
        previous: tuple[int, list[tuple[TensorMeta, torch.Tensor]]] | None = None
        bucket_index = 0
        while True:
            header = self._next_header(bucket_index)
            slot = bucket_index % self.receiver.num_slots
            with _timed(self.stats, "transfer_seconds"):
                self.receiver.post_payload(slot, header.payload_nbytes, self.timeout_s)
            if previous is not None:  # reassemble bucket k-1 while bucket k arrives
                await self._handing_out()
                yield previous[1]
                self.receiver.release(previous[0])
            previous = (slot, self._verified_chunks(header))
            bucket_index += 1
            if header.last:
                break
        await self._handing_out()
        yield previous[1]
        self.receiver.release(previous[0])

    async def _handing_out(self) -> None:
        self.handed_out_at = time.perf_counter()
        await asyncio.sleep(0)  # let the caller's event loop breathe between buckets
