"""Rebuilding whole tensors from their chunks, in stream order.

:class:`ChunkAssembler` is the one place that decides where each chunk's bytes belong and
checks that a chunk stream is well formed. It works in two steps, so a transport can receive
a chunk straight into the tensor it belongs to:

1. :meth:`ChunkAssembler.plan` takes a chunk's ``TensorMeta`` (before its bytes exist),
   checks it against the tensor being assembled, allocates that tensor at its first chunk,
   and returns a :class:`Landing`: the byte range of the output tensor the chunk fills.
2. :meth:`Landing.fill` copies the chunk's bytes there, unless they were received there
   already, and returns the finished tensor when the chunk was its last.

``merge_weight_chunk_batches`` runs both steps per chunk; the refit pipeline plans a whole
bucket when its header arrives and fills it once its payload has been verified.

Small tensors, landed together: a receiver of many small tensors spends most of its time
creating them (an allocation each), not copying them. :class:`SmallTensorLander` lands a run of
small whole tensors that lie next to each other in a host buffer with one allocation and one
copy, as views of one shared storage of ``SHARED_STORAGE_BYTES``. They never alias the
buffer; keeping one of them alive keeps that storage (``clone()`` it to keep it alone). Where
the transport hands the buffer's memory over for good (:meth:`SmallRun.adopt`), a run's
tensors are views of its own bytes there instead, on a storage of the run's span alone, with
nothing copied; keeping one of them alive then keeps the bucket's memory resident.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from ckpt_core._internal.host_alloc import empty_host, empty_host_storage, range_storage
from ckpt_core.contract import TensorMeta
from ckpt_core.errors import ChunkStreamError, OutOfMemoryError
from ckpt_core.tensors import dtype_name


class Landing:
    """Where one planned chunk goes: ``target``, a 1-D ``uint8`` view of its bytes in the
    output tensor, or ``None`` for a small tensor carried whole by this chunk (it is cloned
    from the chunk, one allocation and copy instead of two steps)."""

    __slots__ = ("meta", "target", "borrowed", "_output", "_device")

    def __init__(
        self,
        meta: TensorMeta,
        target: torch.Tensor | None,
        output: torch.Tensor | None,
        device: torch.device | None,
        *,
        borrowed: bool = False,
    ) -> None:
        self.meta = meta
        self.target = target
        self.borrowed = borrowed
        """A whole tensor to hand out as a view of the bucket (:meth:`borrow_from`)."""
        self._output = output  # set when this chunk completes an allocated tensor
        self._device = device

    def borrow_from(self, buffer: torch.Tensor, offset: int) -> torch.Tensor:
        """The whole tensor as a view of ``buffer``'s bytes ``[offset, offset + chunk_size)``:
        no copy, valid as long as those bytes are (the sender packs each chunk at an offset
        aligned to its dtype)."""
        meta = self.meta
        end = offset + meta.chunk_size
        if end > buffer.numel():
            raise ChunkStreamError(
                f"tensor {meta.name!r}: chunk [{offset}, {end}) lies outside the {buffer.numel()}-byte buffer"
            )
        if offset % meta.dtype.itemsize:
            raise ChunkStreamError(
                f"tensor {meta.name!r}: a {dtype_name(meta.dtype)} chunk at byte {offset} is not aligned to its "
                f"{meta.dtype.itemsize}-byte elements; the sender does not pack as this library does"
            )
        return buffer[offset:end].view(meta.dtype).reshape(meta.shape)

    def fill(self, chunk: torch.Tensor) -> torch.Tensor | None:
        """Copy ``chunk`` (1-D ``uint8``, ``meta.chunk_size`` bytes) into place; returns the
        whole tensor if this chunk completes it. ``ChunkStreamError`` for a malformed chunk."""
        meta = self.meta
        if chunk.dtype != torch.uint8 or chunk.dim() != 1 or chunk.numel() != meta.chunk_size:
            raise ChunkStreamError(
                f"tensor {meta.name!r}: chunk at byte {meta.chunk_offset} must be a 1-D uint8 "
                f"tensor of {meta.chunk_size} bytes, got {chunk.dtype} of shape {list(chunk.shape)}"
            )
        if self.target is None:
            whole = chunk.clone() if self._device is None else chunk.to(self._device, copy=True)
            return whole.view(meta.dtype).reshape(meta.shape)
        if meta.chunk_size:
            self.target.copy_(chunk)
        return self._output

    def fill_from(self, buffer: torch.Tensor, offset: int) -> torch.Tensor | None:
        """:meth:`fill` from the chunk's place in a received bucket: bytes ``[offset, offset +
        chunk_size)`` of ``buffer``, a contiguous 1-D ``uint8`` tensor. A small whole tensor
        on the host is built with one allocation and one ``memmove``, no intermediate views:
        this runs once per tensor, and torch's per-op cost dominates for small ones."""
        meta = self.meta
        end = offset + meta.chunk_size
        if end > buffer.numel():
            raise ChunkStreamError(
                f"tensor {meta.name!r}: chunk [{offset}, {end}) lies outside the {buffer.numel()}-byte buffer"
            )
        if self.target is None and self._device is None and buffer.device.type == "cpu":
            whole = empty_host(meta.shape, meta.dtype)
            if meta.chunk_size:
                ctypes.memmove(whole.data_ptr(), buffer.data_ptr() + offset, meta.chunk_size)
            return whole
        return self.fill(buffer[offset:end])

    @property
    def shares_storage(self) -> bool:
        """Whether :class:`SmallTensorLander` may land this chunk: a whole tensor of at most
        ``SMALL_TENSOR_BYTES``, staying on the host."""
        return self.target is None and self._device is None and self.meta.chunk_size <= SMALL_TENSOR_BYTES

    def landed(self) -> torch.Tensor | None:
        """The chunk's bytes were received into ``target`` directly: the whole tensor if
        this chunk completes it."""
        return self._output


COPIED_WHOLE_BYTES = 1 << 20
"""A whole tensor smaller than this, arriving packed in one bucket, is copied out of it when
its bucket is finished (:meth:`Landing.fill_from`); a larger one is planned a target of its own
(where a direct chunk lands in place)."""

SMALL_TENSOR_BYTES = 256 << 10
"""Whole tensors up to this size may be landed as views of a shared storage."""

SHARED_STORAGE_BYTES = 1 << 20
"""Size of one shared storage (from :func:`~ckpt_core._internal.host_alloc.empty_host_storage`)."""


class SmallTensorLander:
    """Lands small whole tensors of one host buffer in runs: each run (tensors lying in
    increasing order within ``SHARED_STORAGE_BYTES`` from a 64-byte boundary) is copied into
    one new storage with one ``memmove``, and each tensor is a view of it at its own offset.

    Offer chunks in stream order with :meth:`add`; :meth:`flush` returns the landed
    ``(name, tensor)`` pairs in that order (flush before landing any other chunk, to keep it).
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer
        self._usable = buffer.device.type == "cpu" and buffer.is_contiguous() and buffer.dtype == torch.uint8
        self._landed: list[tuple[str, torch.Tensor]] = []
        self._run: list[Landing] = []
        self._offsets: list[int] = []
        self._start = self._end = 0

    def add(self, landing: Landing, offset: int) -> bool:
        """Take ``landing``, whose bytes lie at ``offset`` in the buffer, into the current run
        (or a new one). ``False``: not a small whole host tensor, or not aligned to its element
        size; the caller lands it itself."""
        meta = landing.meta
        if not (self._usable and landing.shares_storage and offset % meta.dtype.itemsize == 0):
            return False
        end = offset + meta.chunk_size
        if end > self._buffer.numel():
            raise ChunkStreamError(
                f"tensor {meta.name!r}: chunk [{offset}, {end}) lies outside the {self._buffer.numel()}-byte buffer"
            )
        if self._run and (offset < self._end or end - self._start > SHARED_STORAGE_BYTES):
            self._land_run()
        if not self._run:
            self._start = offset - offset % 64  # 64 is a multiple of every element size
        self._run.append(landing)
        self._offsets.append(offset)
        self._end = end
        return True

    def flush(self) -> list[tuple[str, torch.Tensor]]:
        """Every tensor taken so far, landed, in the order taken."""
        if self._run:
            self._land_run()
        landed, self._landed = self._landed, []
        return landed

    def _land_run(self) -> None:
        run = SmallRun(
            self._start, self._end, [(landing.meta, offset) for landing, offset in zip(self._run, self._offsets)]
        )
        self._landed += run.land(self._buffer)
        self._run, self._offsets = [], []


class SmallRun:
    """Small whole tensors lying in bytes ``[start, end)`` of a host buffer (``start`` a
    multiple of 64, the span at most ``SHARED_STORAGE_BYTES``), each given as its chunk's
    metadata and its offset in the buffer: landed as views of one new storage, or lent.

    Views are cut in groups: tensors of one dtype lying back to back whose shapes differ only
    in their first dimension (the rows of a model's layers, its 1-D norms and biases) come
    from one ``split_with_sizes`` of the group's bytes, which costs half what a view apiece
    does; any other tensor is one ``as_strided`` view.
    """

    __slots__ = ("start", "end", "groups", "_last_name")

    def __init__(self, start: int, end: int, tensors: list[tuple[TensorMeta, int]]) -> None:
        self.start = start
        self.end = end
        self.groups: list[_ViewGroup] = []
        for meta, offset in tensors:
            group = self.groups[-1] if self.groups else None
            if group is None or not group.extend(meta, offset):
                self.groups.append(_ViewGroup(meta, offset))
        self._last_name = tensors[-1][0].name if tensors else ""

    def land(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors, copied out of ``buffer`` (a contiguous host ``uint8`` tensor holding
        the run's bytes) with one ``memmove`` into one new storage, as views of it."""
        self._check_inside(buffer)
        storage = empty_host_storage(SHARED_STORAGE_BYTES)
        ctypes.memmove(storage.data_ptr(), buffer.data_ptr() + self.start, self.end - self.start)
        return self._views(storage, -self.start)

    def adopt(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors as views of the run's own bytes of ``buffer`` (memory its transport
        handed over for good, its address 64-byte aligned), on a storage of the run's span
        alone: owned, and nothing copied."""
        self._check_inside(buffer)
        return self._views(range_storage(buffer, self.start, self.end - self.start), -self.start)

    def lend(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The tensors as views of ``buffer`` itself (borrowed: valid while its bytes are)."""
        self._check_inside(buffer)
        if buffer.storage_offset() % 64:
            raise ChunkStreamError(
                f"a bucket buffer at byte {buffer.storage_offset()} of its storage cannot be lent as "
                "tensors of every dtype; the transport's buffers must start 64-byte aligned"
            )
        return self._views(buffer, 0)

    def _check_inside(self, buffer: torch.Tensor) -> None:
        if self.end > buffer.numel():
            raise ChunkStreamError(
                f"tensor {self._last_name!r}: chunk ending at byte {self.end} lies outside the "
                f"{buffer.numel()}-byte buffer"
            )

    def _views(self, source: torch.Tensor, shift: int) -> list[tuple[str, torch.Tensor]]:
        """Views of ``source`` (1-D ``uint8``, its first byte 64-byte aligned in its storage),
        each tensor at its buffer offset plus ``shift``."""
        typed: dict[torch.dtype, torch.Tensor] = {}  # source as each dtype
        views: list[tuple[str, torch.Tensor]] = []
        for group in self.groups:
            dtype = group.dtype
            elements = typed.get(dtype)
            if elements is None:
                size = source.numel()
                elements = typed[dtype] = source[: size - size % dtype.itemsize].view(dtype)
            views += group.cut(elements, shift)
        return views


class _ViewGroup:
    """Tensors of one dtype, back to back, whose shapes share all but their first dimension
    (a tensor that cannot join one is a group of its own)."""

    __slots__ = ("dtype", "names", "rows", "trailing", "offset", "end", "_single")

    def __init__(self, meta: TensorMeta, offset: int) -> None:
        self.dtype = meta.dtype
        self.names = [meta.name]
        shape = meta.shape
        self.rows = [shape[0]] if len(shape) and meta.chunk_size else []  # empty: it cannot group
        self.trailing = tuple(shape[1:])
        self.offset = offset
        self.end = offset + meta.chunk_size
        self._single = (shape, _contiguous_strides(shape))

    def extend(self, meta: TensorMeta, offset: int) -> bool:
        """Take ``meta`` (at ``offset``) into the group if it can be cut with the others."""
        shape = meta.shape
        if not (self.rows and meta.dtype is self.dtype and offset == self.end and meta.chunk_size and len(shape)):
            return False
        if tuple(shape[1:]) != self.trailing:
            return False
        self.names.append(meta.name)
        self.rows.append(shape[0])
        self.end = offset + meta.chunk_size
        return True

    def cut(self, elements: torch.Tensor, shift: int) -> list[tuple[str, torch.Tensor]]:
        """The group's tensors as views of ``elements`` (the buffer as this dtype; a tensor at
        buffer byte ``b`` starts at element ``(b + shift) // itemsize``)."""
        itemsize = self.dtype.itemsize
        first = (self.offset + shift) // itemsize
        if len(self.names) == 1:
            shape, strides = self._single
            return [(self.names[0], elements.as_strided(shape, strides, elements.storage_offset() + first))]
        span = elements[first : first + (self.end - self.offset) // itemsize]
        if self.trailing:
            span = span.view(-1, *self.trailing)
        return list(zip(self.names, span.split_with_sizes(self.rows)))


def plan_small_runs(chunks: Sequence[TensorMeta]) -> list[SmallRun] | None:
    """A bucket's chunks as runs of small whole tensors to land together, if every chunk is a
    packed whole tensor of at most ``SMALL_TENSOR_BYTES`` aligned to its element size (a
    bucket's runs depend on its chunk list alone, so a receiver plans them once per list);
    ``None`` otherwise."""
    runs: list[SmallRun] = []
    members: list[tuple[TensorMeta, int]] = []
    start = end = 0
    for meta in chunks:
        offset = meta.offset
        if (
            offset is None
            or meta.chunk_offset
            or meta.chunk_size > SMALL_TENSOR_BYTES
            or meta.chunk_size != meta.nbytes
        ):
            return None
        if offset % meta.dtype.itemsize:
            return None
        chunk_end = offset + meta.chunk_size
        if members and (offset < end or chunk_end - start > SHARED_STORAGE_BYTES):
            runs.append(SmallRun(start, end, members))
            members = []
        if not members:
            start = offset - offset % 64  # 64 is a multiple of every element size
        members.append((meta, offset))
        end = chunk_end
    if members:
        runs.append(SmallRun(start, end, members))
    return runs


@functools.lru_cache(maxsize=4096)  # a model has few distinct shapes
def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    if len(shape) <= 1:
        return (1,) * len(shape)
    strides = [1]
    for size in reversed(shape[1:]):
        strides.append(strides[-1] * max(size, 1))
    return tuple(reversed(strides))


class _Partial:
    """A tensor whose chunks are being planned: bytes ``[0, planned)`` have a place."""

    __slots__ = ("meta", "tensor", "bytes", "planned")

    def __init__(self, meta: TensorMeta, tensor: torch.Tensor) -> None:
        self.meta = meta
        self.tensor = tensor
        self.bytes = tensor.reshape(-1).view(torch.uint8)
        self.planned = 0


class ChunkAssembler:
    """Plans the chunks of one stream; outputs live on ``device`` (``None``: each tensor on
    the device its first chunk is on, given to :meth:`plan` as ``chunk_device``).

    ``split_only``: ``device`` applies only to tensors that arrive in several chunks; a tensor
    carried whole by one chunk stays on that chunk's device (NeMo RL's ``merge_device``).
    """

    def __init__(self, device: torch.device | None = None, *, split_only: bool = False) -> None:
        self._device = device
        self._split_only = split_only
        self._pending: _Partial | None = None

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def idle(self) -> bool:
        """Whether no tensor is partly planned (the next chunk must start a tensor)."""
        return self._pending is None

    def plan(
        self, meta: TensorMeta, chunk_device: torch.device, *, in_place: bool = False, borrow: bool = False
    ) -> Landing:
        """Place the next chunk of the stream. ``in_place``: the caller will receive the bytes
        into ``Landing.target`` itself, so the chunk always gets a target. ``borrow``: a chunk
        carrying a whole tensor that stays on ``chunk_device`` gets a borrowed landing (no
        allocation: the caller hands out a view of the chunk).

        Raises ``ChunkStreamError`` for a chunk that disagrees with the tensor being assembled
        (name, shape or dtype), leaves a gap, overlaps, or runs past the tensor's end.
        """
        pending = self._pending
        if pending is None:
            if meta.chunk_offset != 0:
                raise ChunkStreamError(
                    f"tensor {meta.name!r} starts at byte {meta.chunk_offset} instead of 0: "
                    f"bytes [0, {meta.chunk_offset}) are missing or arrived out of order"
                )
            nbytes = meta.nbytes
            whole = meta.chunk_size == nbytes
            device = chunk_device if self._device is None or (whole and self._split_only) else self._device
            if borrow and whole and not in_place and device == chunk_device:
                return Landing(meta, None, None, None, borrowed=True)
            if not in_place and whole and nbytes < COPIED_WHOLE_BYTES:
                move_to = None if device == chunk_device else device
                return Landing(meta, None, None, move_to)
            pending = self._pending = _Partial(meta, _allocate(meta, device))
        first = pending.meta
        if (meta.name, meta.shape, meta.dtype) != (first.name, first.shape, first.dtype):
            raise ChunkStreamError(
                f"tensor {first.name!r} ({list(first.shape)}, {dtype_name(first.dtype)}) is "
                f"incomplete at byte {pending.planned} of {first.nbytes}, but the next chunk is "
                f"for {meta.name!r} ({list(meta.shape)}, {dtype_name(meta.dtype)}) at byte "
                f"{meta.chunk_offset}"
            )
        if meta.chunk_offset != pending.planned:
            kind = "gap" if meta.chunk_offset > pending.planned else "overlap"
            raise ChunkStreamError(
                f"tensor {first.name!r}: {kind} in chunk stream, expected a chunk at byte "
                f"{pending.planned}, got one at byte {meta.chunk_offset} "
                f"(size {meta.chunk_size}, tensor size {first.nbytes})"
            )
        end = meta.chunk_offset + meta.chunk_size
        if end > first.nbytes:
            raise ChunkStreamError(
                f"tensor {first.name!r}: chunk [{meta.chunk_offset}, {end}) runs past the tensor's {first.nbytes} bytes"
            )
        pending.planned = end
        output = None
        if end == first.nbytes:
            output = pending.tensor
            self._pending = None
        return Landing(meta, pending.bytes[meta.chunk_offset : end], output, None)

    def finish(self) -> None:
        """The stream ended: ``ChunkStreamError`` if a tensor is still incomplete."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            raise ChunkStreamError(
                f"chunk stream ended in the middle of tensor {pending.meta.name!r}: received bytes "
                f"[0, {pending.planned}) of {pending.meta.nbytes}"
            )


def _allocate(meta: TensorMeta, device: torch.device) -> torch.Tensor:
    try:
        if device.type == "cpu":
            return empty_host(meta.shape, meta.dtype)
        return torch.empty(meta.shape, dtype=meta.dtype, device=device)
    except (OSError, RuntimeError, MemoryError) as exc:  # ENOMEM from mmap; torch's allocators
        raise OutOfMemoryError(
            f"tensor {meta.name!r} ({list(meta.shape)}, {dtype_name(meta.dtype)}, {meta.nbytes} bytes) "
            f"announced by the sender cannot be allocated on {device} ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); free memory here, or check the sender "
            "(a header this large may be corrupt or forged)"
        ) from exc
