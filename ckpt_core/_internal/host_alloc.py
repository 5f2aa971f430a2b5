"""Host allocations for received tensors: huge pages, a pool of freed blocks, prefaulting.

A receiver hands out tensors that own their memory, so every refit fills fresh allocations,
and fresh memory is slow: the first touch of each page faults, and the kernel zeroes it, so a
copy into fresh 4 KiB pages runs several times slower than into warm memory
(docs/benchmarks.md has the figures). Three things keep that off a refit's critical path:

* Tensors of ``POOLED_MIN_BYTES`` and up are anonymous mappings; from
  ``HUGE_PAGE_THRESHOLD`` up they are advised ``MADV_HUGEPAGE``: one fault per 2 MiB.
* When such a tensor is freed (its last view gone), its mapping goes back to a per-process
  pool, and the next tensor of the same size (rounded up to a page, or to 2 MiB with huge
  pages) reuses it, already faulted in. A full pool makes room for a newly freed block by
  dropping its oldest ones. Memory use is also steadier than through the C
  allocator, whose heap kept a few MiB more or less from one refit to the next. The pool keeps
  at most ``CKPT_CORE_HOST_POOL_BYTES`` (default 1 GiB; 0 turns it off);
  :func:`release_host_pool` empties it, and so does ``finalize()`` of an engine built with
  ``release_after_refit=True``. A loader that
  drops each batch after loading it keeps only a few buckets' worth in the pool. A receiver
  that holds a whole refit larger than the limit pushes some blocks out at every refit, which
  the next refit faults in again: raise the limit above what it holds at once.
* A receiver that knows where bytes will land calls :func:`prefault` on that range beside the
  transfer, so the zeroing of fresh pages runs there instead of inside the transfer.

Smaller tensors use ``torch.empty`` (the C allocator already reuses small blocks). Storages
shared by many small received tensors (:func:`empty_host_storage`) are mappings too, pooled
apart (at most ``STORAGE_POOL_BYTES``). A receiver's slot that hands its memory over with the
tensors in it keeps blocks of its own, outside both pools (:mod:`ckpt_core._internal.slot_memory`).
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import mmap
import os
import threading
from typing import Any

import torch

POOLED_MIN_BYTES = 64 << 10
"""Tensors at least this large (bytes) are anonymous mappings, pooled when freed. (The C heap
gave the pages of smaller freed blocks back to the system between refits: a receiver faulted
in 900 pages for each 5 MB refit of 56 tensors, two thirds of its time.)"""

HUGE_PAGE_THRESHOLD = 4 << 20
"""Tensors at least this large (bytes) are also advised to use huge pages."""

_HUGE_PAGE = 2 << 20


def _pool_limit() -> int:
    raw = os.environ.get("CKPT_CORE_HOST_POOL_BYTES", str(1 << 30))
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"CKPT_CORE_HOST_POOL_BYTES must be a number of bytes, got {raw!r}") from None


class _Pool:
    """Freed mappings by size, up to ``limit`` bytes in all, keeping the most recently freed:
    a block given back to a full pool evicts the oldest ones, so memory of sizes a workload no
    longer uses does not stay. Thread-safe: a tensor may be freed on any thread."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.pooled_bytes = 0
        self._free: dict[int, list[mmap.mmap]] = {}
        self._age: collections.OrderedDict[int, tuple[int, mmap.mmap]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def take(self, size: int) -> mmap.mmap | None:
        """The most recently freed block of ``size`` bytes; ``None`` if there is none."""
        with self._lock:
            free = self._free.get(size)
            if not free:
                return None
            mapping = free.pop()
            del self._age[id(mapping)]
            self.pooled_bytes -= size
            return mapping

    def give(self, mapping: mmap.mmap, size: int) -> None:
        if size > self.limit:
            return
        with self._lock:
            while self.pooled_bytes + size > self.limit:
                old_size, old = self._age.popitem(last=False)[1]
                self._free[old_size].remove(old)
                self.pooled_bytes -= old_size
            self._free.setdefault(size, []).append(mapping)
            self._age[id(mapping)] = (size, mapping)
            self.pooled_bytes += size

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._age.clear()
            self.pooled_bytes = 0

    def set_limit(self, limit: int) -> None:
        """Keep at most ``limit`` bytes from now on, evicting the oldest blocks over it."""
        with self._lock:
            self.limit = limit
            while self.pooled_bytes > limit:
                old_size, old = self._age.popitem(last=False)[1]
                self._free[old_size].remove(old)
                self.pooled_bytes -= old_size


_POOL = _Pool(_pool_limit())


def set_host_pool_limit(limit: int) -> None:
    """Change this process's pool limit (``CKPT_CORE_HOST_POOL_BYTES`` at start); 0 turns it off."""
    if limit < 0:
        raise ValueError(f"a host pool limit is a number of bytes >= 0, got {limit}")
    _POOL.set_limit(limit)


STORAGE_POOL_BYTES = 64 << 20
"""Limit of the pool behind :func:`empty_host_storage`, kept apart from the tensors' pool so
that neither pushes the other's blocks out."""

_STORAGE_POOL = _Pool(STORAGE_POOL_BYTES)
_BLOCK_TYPES: dict[tuple[int, int], type] = {}


def _block_type(size: int, pool: _Pool) -> Any:
    """A ctypes byte array of ``size`` whose instances hand their mapping back to ``pool``
    when they die. A tensor made with ``torch.frombuffer`` holds its block until the tensor's
    storage (every view of it) is freed, so the block's death is the memory's release."""
    key = (size, id(pool))
    block_type = _BLOCK_TYPES.get(key)
    if block_type is None:

        def release(block: Any) -> None:
            pool.give(block.mapping, size)

        block_type = _BLOCK_TYPES[key] = type("HostBlock", (ctypes.c_ubyte * size,), {"__del__": release})
    return block_type


def _mapped_bytes(nbytes: int, pool: _Pool) -> torch.Tensor:
    """A 1-D ``uint8`` tensor of ``nbytes`` on an anonymous mapping taken from ``pool`` (or
    new), which goes back to ``pool`` when the tensor's storage is freed."""
    size = mapping_size(nbytes)
    mapping = pool.take(size)
    if mapping is None:
        mapping = new_mapping(size)
    block = _block_type(size, pool).from_buffer(mapping)
    block.mapping = mapping
    return torch.frombuffer(block, dtype=torch.uint8, count=nbytes)


def mapping_size(nbytes: int) -> int:
    """The size of a mapping made for ``nbytes``: rounded up to a page, or to a huge page from
    ``HUGE_PAGE_THRESHOLD`` up (where the system has them)."""
    unit = _HUGE_PAGE if nbytes >= HUGE_PAGE_THRESHOLD and hasattr(mmap, "MADV_HUGEPAGE") else mmap.PAGESIZE
    return -(-nbytes // unit) * unit


def new_mapping(size: int) -> mmap.mmap:
    """A new private anonymous mapping of ``size`` bytes (from :func:`mapping_size`), advised
    to use huge pages from ``HUGE_PAGE_THRESHOLD`` up. Nothing is faulted in yet."""
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if size >= HUGE_PAGE_THRESHOLD and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP unsupported here: the mapping still works with small pages
            pass
    return mapping


def empty_host(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor; huge-page backed and pooled when it is large enough to
    gain from it (see the module docstring).

    It cannot be resized in place (``resize_``), like any tensor made from a buffer.
    """
    nbytes = shape.numel() * dtype.itemsize
    if nbytes < POOLED_MIN_BYTES:
        return torch.empty(shape, dtype=dtype)
    return _mapped_bytes(nbytes, _POOL).view(dtype).reshape(shape)


def empty_host_storage(nbytes: int) -> torch.Tensor:
    """An uninitialized 1-D ``uint8`` CPU tensor to hold many small tensors as views, from a
    pool of its own (``STORAGE_POOL_BYTES``): warm after the first refit, its resident size
    steady from refit to refit (the C heap's was not), and never pushing a large tensor's
    block out of the main pool, which a receiver holding a whole refit may fill."""
    return _mapped_bytes(nbytes, _STORAGE_POOL)


def range_storage(buffer: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """Bytes ``[offset, offset + nbytes)`` of ``buffer`` (a contiguous 1-D ``uint8`` host
    tensor) as a 1-D ``uint8`` tensor on a storage of exactly ``nbytes``, which keeps all of
    ``buffer``'s memory alive (no copy). For memory a transport has handed over for good: its
    views then own what they show, and a caller saving one saves ``nbytes`` at most."""
    if offset < 0 or nbytes < 0 or offset + nbytes > buffer.numel():
        raise ValueError(f"bytes [{offset}, {offset + nbytes}) lie outside a {buffer.numel()}-byte buffer")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buffer.numpy(), dtype=torch.uint8, count=nbytes, offset=offset)


def release_pages_past(buffer: torch.Tensor, nbytes: int) -> None:
    """Give the whole pages of a contiguous host ``buffer`` that lie past its first ``nbytes``
    back to the system (they read as zeros when touched again): memory handed over with a small
    payload keeps only what holds it resident. Best effort, like :func:`prefault`."""
    if _libc is None or buffer.device.type != "cpu":
        return
    start = buffer.data_ptr()
    first = -(-(start + nbytes) // _PAGE) * _PAGE
    end = (start + buffer.numel() * buffer.element_size()) // _PAGE * _PAGE
    if end > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_DONTNEED)


SMALL_COPY_BYTES = 256 << 10
"""Host copies up to this size go through ``memmove``: for small chunks torch's per-op cost
is most of the copy's."""


def copy_into(buffer: torch.Tensor, offset: int, chunk: torch.Tensor) -> None:
    """Copy ``chunk`` (1-D ``uint8``) into the 1-D ``uint8`` ``buffer`` at byte ``offset``."""
    nbytes = chunk.numel()
    if offset < 0 or offset + nbytes > buffer.numel():
        raise ValueError(f"a {nbytes}-byte copy at offset {offset} does not fit a {buffer.numel()}-byte buffer")
    if (
        nbytes <= SMALL_COPY_BYTES
        and buffer.dtype == torch.uint8
        and chunk.dtype == torch.uint8
        and buffer.device.type == "cpu"
        and chunk.device.type == "cpu"
        and buffer.is_contiguous()
        and chunk.is_contiguous()
    ):
        if nbytes:
            ctypes.memmove(buffer.data_ptr() + offset, chunk.data_ptr(), nbytes)
        return
    buffer[offset : offset + nbytes].copy_(chunk)


def host_address(buffer: torch.Tensor, nbytes: int) -> int | None:
    """The address of ``buffer`` if it is a contiguous 1-D ``uint8`` host buffer of at least
    ``nbytes`` bytes, into which chunks may be ``memmove``d directly; ``None`` otherwise."""
    if buffer.is_cpu and buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous():
        if buffer.numel() >= nbytes:
            return buffer.data_ptr()
    return None


def release_host_pool() -> None:
    """Return the pooled memory of freed tensors (and shared storages) to the system."""
    _POOL.clear()
    _STORAGE_POOL.clear()


def pooled_bytes() -> int:
    """Bytes the pools hold now."""
    return _POOL.pooled_bytes + _STORAGE_POOL.pooled_bytes


_MADV_DONTNEED = 4
_MADV_POPULATE_WRITE = 23
"""Linux 5.14+: fault pages in, writable, without changing what they hold."""
_PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True) if os.name == "posix" else None


def prefault(region: torch.Tensor) -> None:
    """Fault in the pages under a contiguous CPU tensor's bytes, leaving their contents as
    they are: safe while another thread writes into the same range. Best effort: does
    nothing where the kernel cannot (older than Linux 5.14, or not Linux)."""
    if _libc is None or region.device.type != "cpu" or region.numel() == 0:
        return
    start = region.data_ptr()
    end = start + region.numel() * region.element_size()
    aligned = start - start % _PAGE
    _libc.madvise(ctypes.c_void_p(aligned), ctypes.c_size_t(end - aligned), _MADV_POPULATE_WRITE)
