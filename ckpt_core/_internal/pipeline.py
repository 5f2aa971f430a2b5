"""The refit pipeline every transport shares: pack, describe, move, verify, reassemble.

Sender: a :class:`~ckpt_core.chunking.BucketPlan` lays chunks out in buckets (closing one early
at ``MAX_CHUNKS_PER_BUCKET`` chunks, so many small tensors stream instead of waiting for a full
bucket, and after a weight that took ``SLOW_WEIGHT_S`` to come, so the wire works while the
generator does; a tensor of at most ``KEEP_WHOLE_BYTES``, or any that fits a bucket when a
receiver borrows, opens a new bucket rather than being split over two). A chunk of at least
``direct_min_bytes`` goes *direct* when the transport allows it (``direct_chunks``): it is sent
from the caller's tensor as a message of its own. Every other chunk is copied into the
transport's slot buffer, packed at the next offset aligned to its element size (its place in
the plan, unless direct chunks left room before it). Each bucket is checksummed and posted
with its header; packing then continues in the other slot while the first is in flight
(double buffering). The last bucket carries ``last=True``, so a refit of no tensors is one
empty bucket.

Receiver: each header is planned by a :class:`~ckpt_core._internal.assembly.ChunkAssembler` as soon as it
arrives: output tensors are allocated, and direct chunks are received straight into them. While
bucket ``k`` arrives, bucket ``k - 1`` is verified, its packed chunks are copied out of their
slot, the slot is released to the sender, and the tensors it completed are yielded (a transport
whose payloads are readable as soon as their header arrives has each bucket finished at once).

Refits of one run repeat their packing. A sender given a
:class:`~ckpt_core._internal.replay.PackingRecord` replays the last refit's buckets while the
weights repeat its tensors (each chunk moved as last time, no chunking or metadata built, the
encoded chunk list reused), and plans afresh from the first tensor that differs. A receiver
given a :class:`ReceiveMemo` reuses the checked decoding of a chunk list byte-equal to the one
it had for that bucket, and the runs it planned for a bucket of small whole tensors.

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

The sender is :mod:`ckpt_core._internal.send` (:func:`~ckpt_core._internal.send.send_refit`), the
receiver :mod:`ckpt_core._internal.receive` (:func:`~ckpt_core._internal.receive.receive_refit`);
this module holds what both directions share: one refit's settings (:class:`RefitRun`), bucket
digests and cancellation.
"""

from __future__ import annotations

import dataclasses
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
import xxhash

from ckpt_core.hooks import RefitNotifier
from ckpt_core.stats import RefitContext, RefitStats

Checksum = Callable[[torch.Tensor], int]
"""A digest of one 1-D ``uint8`` tensor's bytes."""


def bucket_digest(checksum: Checksum, parts: Sequence[torch.Tensor]) -> int:
    """One digest for a bucket's parts: its packed payload, then each direct chunk."""
    return combined_digest([(part.numel(), checksum(part)) for part in parts])


def combined_digest(parts: Sequence[tuple[int, int]]) -> int:
    """One digest for a bucket's parts given as ``(length, digest)``: the packed payload, then
    each direct chunk. A bucket without direct chunks is digested as its payload alone;
    otherwise the digest is xxh3_64 over every part's length and digest, so a part moved,
    resized or swapped changes it."""
    if len(parts) == 1:
        return parts[0][1]
    words = [value for part in parts for value in part]
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(words)}Q", *words))


@contextmanager
def timed(stats: RefitStats, field: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        setattr(stats, field, getattr(stats, field) + time.perf_counter() - start)


class RefitCancelled(Exception):
    """The caller cancelled the refit (the task awaiting it was cancelled, or the consumer of
    the batches stopped): raised where the pipeline next checks, before a weight is taken and
    before each bucket is posted or received. Not a ``TransferError``: a sender then posts an
    abort header, so its receivers fail with ``RemoteRefitError``."""


@dataclasses.dataclass
class RefitRun:
    """What both sides of one refit share."""

    bucket_size: int
    context: RefitContext
    notifier: RefitNotifier
    stats: RefitStats
    timeout_s: float
    checksum: Checksum | None
    cancel: threading.Event | None = None

    def check_cancel(self) -> None:
        """``RefitCancelled`` once the caller set ``cancel``."""
        if self.cancel is not None and self.cancel.is_set():
            raise RefitCancelled(f"refit {self.context.refit_index} was cancelled by its caller")
