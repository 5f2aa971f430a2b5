"""The sender's record of a refit's packing, so the next refit of the same weights replays it.

Refits of one training run repeat the same names, shapes and dtypes in the same order, so
their buckets are packed alike. What the pipeline works out per tensor (its chunks and their
metadata, its place in a bucket, the header's chunk list) is then what it was last time:
:class:`PackingRecord` keeps it, bucket by bucket, and the next refit moves each chunk of a
tensor that matches its recorded entry exactly as it moved last time (the same offset, packed
or direct), with no chunking, no metadata built and no placement.

Runs of small whole tensors are replayed a span at a time (:class:`ReplaySpan`): the span's
items are taken from the weights together, each property is asked of all of them at once, and
their bytes are copied into the slot by one ``torch.cat`` per group of tensors of one dtype and
trailing shape. That is half the per-tensor cost of checking and copying them one by one,
which is most of a refit of many small tensors.

A span takes its tensors from the generator before it copies the first, so it reads a tensor
later than the first refit did (which copied each small tensor before asking for the next).
A bucket has spans only where that is safe for this generator: where its refit saw every small
tensor of the bucket still in its own memory, apart from the others', once the generator had
gone past them (:func:`held_apart`; a generator that frees or refills a weight as it yields the
next fails that, and its buckets are replayed one tensor at a time, reading each tensor when
the first refit did). A span checks the same of its own tensors again, and refuses a tensor
whose memory another span tensor shares (:meth:`ReplaySpan.repeats`): its bytes may already be
another weight's, and the refit must fail rather than send them.

Only host tensors are replayed (a bucket holding a chunk of a device tensor ends the replay).
A tensor that differs in any way (name, shape, dtype, not a plain contiguous host tensor, a
storage that does not hold its bytes) ends it too: that tensor and every later one are laid
out afresh from the open bucket on, by the general path and with all of its checks, and the
record is rewritten from what was sent.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from ckpt_core.contract import TensorMeta
from ckpt_core.errors import UnsupportedTensorError

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_TYPES = frozenset(_PLAIN)
_STRIDED = torch.strided

SPAN_BYTES = 4 << 20
"""A span holds at most this many bytes of tensors: the weights it takes at once stay alive
together (a producing generator's outputs), so a span is kept well below a bucket."""

MIN_SPAN_TENSORS = 8
"""Fewer small tensors in a row are replayed one by one (a span's set-up costs a few)."""

MIN_GROUP_TENSORS = 4
"""A ``torch.cat`` of fewer tensors costs more than copying each (its views cost a few)."""


class RecordedBucket:
    """One bucket of a recorded refit: its chunks, where the chunk plan ended after each of them,
    whether the next refit may replay it (every chunk came from a host tensor), its encoded
    chunk list, and its spans of small tensors (:class:`ReplaySpan`, by the index of their
    first chunk; none unless ``small_bytes`` is given, the most a span's tensor may hold).
    ``spans_safe``: whether the refit that sent it found spans safe for its generator (see
    the module docstring); spans are found only then."""

    __slots__ = ("chunks", "plan_ends", "replayable", "encoded", "spans", "spans_safe")

    def __init__(
        self,
        chunks: Sequence[TensorMeta],
        plan_ends: Sequence[int],
        replayable: bool,
        encoded: bytes,
        *,
        small_bytes: int | None = None,
        spans_safe: bool = True,
    ) -> None:
        self.chunks = tuple(chunks)
        self.plan_ends = tuple(plan_ends)
        self.replayable = replayable
        self.encoded = encoded
        """The chunk list as the header carried it (:func:`~ckpt_core._internal.wire.encode_chunks`)."""
        self.spans_safe = spans_safe
        # Worked out here, in the refit that lays the bucket out, so that every replay is alike.
        found = small_bytes is not None and replayable and spans_safe
        self.spans = find_spans(self.chunks, small_bytes) if found and small_bytes is not None else {}


class PackingRecord:
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


def held_apart(sources: Sequence[tuple[int, int, torch.Tensor]]) -> bool:
    """Whether each ``(address, bytes, tensor)`` taken earlier still has its memory where it
    was then (not freed, shrunk or moved), and no two of those byte ranges overlap (a buffer
    the generator refills, or one tensor yielded twice)."""
    for address, nbytes, tensor in sources:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if tensor.data_ptr() != address or not start <= address or address + nbytes > start + storage.nbytes():
            return False
    return _apart(sorted((address, nbytes) for address, nbytes, _ in sources))


def _apart(ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether sorted ``(address, bytes)`` ranges are pairwise disjoint."""
    return all(address + nbytes <= following for (address, nbytes), (following, _) in zip(ranges, ranges[1:]))


class ReplaySpan:
    """Chunks ``[first, stop)`` of a recorded bucket, replayed together: small tensors, each
    whole in one packed chunk, in groups that are each copied by one ``torch.cat``: ``(first,
    stop, start byte, end byte, dtype, trailing shape)``, relative to the span, of tensors of
    one dtype and trailing shape lying back to back in the slot. Kept per tensor: what it
    must repeat (name, dtype, shape) and the bytes its storage must hold past its offset."""

    __slots__ = ("first", "stop", "names", "dtypes", "shapes", "needed", "itemsizes", "groups", "copies")

    def __init__(self, chunks: Sequence[TensorMeta], first: int, groups: Sequence[tuple[int, int]]) -> None:
        self.first = first
        self.stop = groups[-1][1]
        metas = chunks[first : self.stop]
        self.names = [meta.name for meta in metas]
        self.dtypes = [meta.dtype for meta in metas]
        self.shapes = [meta.shape for meta in metas]
        self.needed = [meta.chunk_size for meta in metas]
        self.itemsizes = [dtype.itemsize for dtype in self.dtypes]
        self.groups: list[tuple[int, int, int, int, torch.dtype, tuple[int, ...]]] = []
        for lo, hi in groups:
            head, tail = chunks[lo], chunks[hi - 1]
            assert head.offset is not None and tail.offset is not None
            end = tail.offset + tail.chunk_size
            self.groups.append((lo - first, hi - first, head.offset, end, head.dtype, tuple(head.shape[1:])))
        self.copies = True
        """Whether :meth:`copy` can copy the span (it could, or was not tried yet)."""

    def repeats(self, items: list[Any]) -> list[torch.Tensor] | None:
        """The tensors of ``items`` if they are the span's recorded tensors again, checked as
        :func:`replays` checks one (a conjugate or negative view is fine here: ``torch.cat``
        resolves it); ``None`` for anything else. ``UnsupportedTensorError`` if two of them
        share memory: taken together, the earlier one's bytes may already be the later one's
        (a buffer the generator refills), which this generator's first refit did not show."""
        try:
            names = [name for name, _ in items]
            tensors = [tensor for _, tensor in items]
            if names != self.names or set(map(type, names)) != {str}:
                return None
            if not set(map(type, tensors)) <= _PLAIN_TYPES:
                return None
            if list(map(_dtype, tensors)) != self.dtypes or list(map(_shape, tensors)) != self.shapes:
                return None
            if set(map(_layout, tensors)) != {_STRIDED} or not all(map(_is_cpu, tensors)):
                return None
            if not all(map(_is_contiguous, tensors)):
                return None
            # FSDP frees a storage and keeps its tensor: each storage must hold what its view needs.
            held = [tensor.untyped_storage().nbytes() for tensor in tensors]
            offsets = map(_storage_offset, tensors)
            if any(h < o * i + n for h, o, i, n in zip(held, offsets, self.itemsizes, self.needed)):
                return None
            addresses = list(map(_data_ptr, tensors))
        except Exception:  # noqa: BLE001 - not (name, tensor) pairs, or tensors without storage
            return None
        ranges = sorted(zip(addresses, self.needed, range(len(addresses))))
        for (address, nbytes, first), (following, _, second) in zip(ranges, ranges[1:]):
            if address + nbytes > following:
                raise UnsupportedTensorError(
                    f"weights {self.names[first]!r} and {self.names[second]!r} share memory, which the first "
                    "refit of these weights did not show: the earlier one's bytes may already be the later one's. "
                    "A generator that refills one buffer must do so in every refit, or yield copies; this "
                    "refit is void, and the next one lays its weights out afresh"
                )
        return tensors

    def copy(self, tensors: list[torch.Tensor], buffer: torch.Tensor) -> bool:
        """Copy ``tensors`` (from :meth:`repeats`) to their places in ``buffer`` (the slot, 1-D
        ``uint8``). ``False`` where torch cannot (a slot not aligned to a dtype cannot be viewed
        as it): the span must then be copied tensor by tensor, in this refit and the next ones."""
        try:
            for lo, hi, start, end, dtype, trailing in self.groups:
                torch.cat(tensors[lo:hi], out=buffer[start:end].view(dtype).view(-1, *trailing))
        except (RuntimeError, NotImplementedError):
            self.copies = False
            return False
        return True


_dtype = operator.attrgetter("dtype")
_shape = operator.attrgetter("shape")
_layout = operator.attrgetter("layout")
_is_cpu = operator.attrgetter("is_cpu")
_is_contiguous = operator.methodcaller("is_contiguous")
_storage_offset = operator.methodcaller("storage_offset")
_data_ptr = operator.methodcaller("data_ptr")


def find_spans(chunks: Sequence[TensorMeta], small_bytes: int) -> dict[int, ReplaySpan]:
    """The spans of a bucket's chunks, by their first chunk's index: runs of back-to-back
    groups (:func:`_cat_groups`) of at least ``MIN_GROUP_TENSORS`` tensors each, holding at
    least ``MIN_SPAN_TENSORS`` tensors and at most ``SPAN_BYTES``. Tensors outside them are
    replayed one by one."""
    spans: dict[int, ReplaySpan] = {}
    members: list[tuple[int, int]] = []
    span_bytes = 0
    for lo, hi, nbytes in _cat_groups(chunks, small_bytes):
        joins = members and members[-1][1] == lo and span_bytes + nbytes <= SPAN_BYTES
        if not joins or hi - lo < MIN_GROUP_TENSORS:
            _close(spans, chunks, members)
            members, span_bytes = [], 0
        if hi - lo >= MIN_GROUP_TENSORS:
            members.append((lo, hi))
            span_bytes += nbytes
    _close(spans, chunks, members)
    return spans


def _close(spans: dict[int, ReplaySpan], chunks: Sequence[TensorMeta], members: list[tuple[int, int]]) -> None:
    if members and members[-1][1] - members[0][0] >= MIN_SPAN_TENSORS:
        spans[members[0][0]] = ReplaySpan(chunks, members[0][0], members)


def _cat_groups(chunks: Sequence[TensorMeta], small_bytes: int) -> list[tuple[int, int, int]]:
    """``(first, stop, bytes)`` of each run of chunks one ``torch.cat`` can copy: whole
    tensors of at most ``small_bytes``, packed back to back, of one dtype, with at least one
    dimension and one element, whose shapes differ in their first dimension only; a run holds
    at most ``SPAN_BYTES``. A chunk that cannot join any run is not in one."""
    groups: list[tuple[int, int, int]] = []
    lo = -1  # the open run's first chunk, or -1
    end = run_bytes = 0
    dtype: torch.dtype | None = None
    trailing: tuple[int, ...] = ()
    for index, meta in enumerate(chunks):
        size, offset, shape = meta.chunk_size, meta.offset, meta.shape
        fits = (
            offset is not None
            and meta.chunk_offset == 0
            and 0 < size <= small_bytes
            and len(shape) > 0
            and size == shape.numel() * meta.dtype.itemsize
        )
        if lo >= 0 and fits and offset == end and meta.dtype is dtype and run_bytes + size <= SPAN_BYTES:
            if tuple(shape[1:]) == trailing:
                end += size
                run_bytes += size
                continue
        if lo >= 0:
            groups.append((lo, index, run_bytes))
            lo = -1
        if fits:
            assert offset is not None
            lo, end, run_bytes, dtype, trailing = index, offset + size, size, meta.dtype, tuple(shape[1:])
    if lo >= 0:
        groups.append((lo, len(chunks), run_bytes))
    return groups
