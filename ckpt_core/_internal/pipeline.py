"""The refit pipeline every transport shares: pack, describe, move, verify, reassemble.

The sender (:mod:`ckpt_core._internal.send`, :func:`~ckpt_core._internal.send.send_refit`) lays
chunks out in buckets, packs them into the transport's slot buffers (or sends large ones
direct), checksums and posts each bucket with its header, double buffered, and replays the last
refit's packing while the weights repeat it. The receiver (:mod:`ckpt_core._internal.receive`,
:func:`~ckpt_core._internal.receive.receive_refit`) plans each header as it arrives, receives
direct chunks straight into their tensors, verifies each bucket and yields the tensors it
completed. Each module's docstring gives its side's rules, the generator's contract included.

This module holds what both directions share: one refit's settings (:class:`RefitRun`),
bucket digests (:func:`bucket_digest`, :func:`combined_digest`), timing into the refit's
statistics (:func:`timed`) and cancellation (:class:`RefitCancelled`).
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
