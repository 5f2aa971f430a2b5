"""The sender's record of a refit's layout, so the next refit of the same weights replays it.

Refits of one training run repeat the same names, shapes and dtypes in the same order, so
their bucket layouts are equal. What the pipeline works out per tensor (its chunks and their
metadata, its place in a bucket, the header's chunk list) is then what it was last time:
:class:`LayoutRecord` keeps it, bucket by bucket, and the next refit moves each chunk of a
tensor that matches its recorded entry exactly as it moved last time (the same offset, packed
or direct), with no chunking, no metadata built and no placement.

Only host tensors are replayed (a bucket holding a chunk of a device tensor ends the replay).
A tensor that differs in any way (name, shape, dtype, not a plain contiguous host tensor, a
storage that does not hold its bytes) ends it too: that tensor and every later one are laid
out afresh from the open bucket on, by the general path and with all of its checks, and the
record is rewritten from what was sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ckpt_core.contract import TensorMeta

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


class RecordedBucket:
    """One bucket of a recorded refit: its chunks, where the layout ended after each of them,
    whether the next refit may replay it (every chunk came from a host tensor), and its
    encoded chunk list."""

    __slots__ = ("chunks", "layout_ends", "replayable", "encoded")

    def __init__(
        self, chunks: Sequence[TensorMeta], layout_ends: Sequence[int], replayable: bool, encoded: bytes
    ) -> None:
        self.chunks = tuple(chunks)
        self.layout_ends = tuple(layout_ends)
        self.replayable = replayable
        self.encoded = encoded
        """The chunk list as the header carried it (:func:`~ckpt_core._internal.wire.encode_chunks`)."""


class LayoutRecord:
    """The buckets one sender posted in its last complete refit, under the settings that
    shaped them (a record made under other settings is never replayed)."""

    def __init__(self) -> None:
        self.settings: tuple[Any, ...] | None = None
        self.buckets: list[RecordedBucket] = []
        self._recording: list[RecordedBucket] = []

    def replayable_for(self, settings: tuple[Any, ...]) -> list[RecordedBucket]:
        """The recorded buckets, if recorded under ``settings``; else none."""
        return self.buckets if settings == self.settings else []

    def start(self) -> None:
        """A refit begins: record what it sends (the last record stays until it completes)."""
        self._recording = []

    def add(self, bucket: RecordedBucket) -> None:
        self._recording.append(bucket)

    def complete(self, settings: tuple[Any, ...]) -> None:
        """The refit sent its last bucket: its record replaces the last one."""
        self.buckets, self._recording = self._recording, []
        self.settings = settings

    def clear(self) -> None:
        """Forget every record: a refit failed, so the one it was writing is incomplete, and the
        sender's peers may have seen only part of it."""
        self.settings = None
        self.buckets = []
        self._recording = []


def replays(item: Any, meta: TensorMeta) -> int | None:
    """The address of ``item``'s tensor if it is ``meta``'s recorded tensor again: the same
    name, dtype and shape, a plain contiguous dense host tensor whose storage holds its bytes.
    ``None`` for anything else (the general path then checks it and raises where it must).
    This runs once per tensor of a replayed refit, so it asks each property once."""
    try:
        name, tensor = item
        if type(tensor) not in _PLAIN or name != meta.name or type(name) is not str:
            return None
        if tensor.dtype is not meta.dtype or tensor.shape != meta.shape or tensor.layout is not _STRIDED:
            return None
        if not (tensor.is_cpu and tensor.is_contiguous()) or tensor.is_neg() or tensor.is_conj():
            return None
        address: int = tensor.data_ptr()
        storage = tensor.untyped_storage()  # FSDP frees a storage and keeps its tensor
        if address + tensor.nbytes > storage.data_ptr() + storage.nbytes():
            return None
    except Exception:  # noqa: BLE001 - a tensor without sizes or storage (nested, a wrapper subclass)
        return None
    return address
