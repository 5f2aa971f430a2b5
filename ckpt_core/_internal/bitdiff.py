"""Bitwise diffs, patches and digests of host memory at memory speed: delta refits' inner loops.

:mod:`ckpt_core.refit.delta` views a host tensor's elements as integers of their width and hands
them here as 1-D numpy arrays. Each function reads or writes every byte it must once, in
parallel parts over the usable cores (:mod:`ckpt_core._internal.parallel`), with loops compiled
by numba (:mod:`ckpt_core._internal.bitdiff_kernels`, imported on first use):

* :func:`find`: the elements whose bits differ between two versions, laid out as a patch's
  wire form, and the new version's digest, in one pass over both (each leaf is hashed while
  the comparison has it in cache);
* :func:`patch`: a patch written into a tensor in place (the overwritten values kept on
  request), its positions checked as it goes;
* :func:`count` and :func:`count_and_refresh`: the changed elements in a few ranges (a
  screening sample), read only, or against a kept copy of them, which is refreshed;
* :func:`digest`: the leaf digest of a tensor's bytes.

**Leaf digest.** The bytes are cut into leaves of :data:`LEAF_BYTES`; the digest is xxh3_64 of
the byte count and each leaf's xxh3_64 (little-endian ``uint64`` each). Leaves let every core
hash a part of one tensor, and let a sender hash what its comparison just read.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from types import ModuleType
from typing import Any

import numpy as np
import xxhash

from ckpt_core._internal.parallel import run_parts, usable_cores

LEAF_BYTES = 1 << 20
"""The leaf digest's leaf size, and the unit of work of every function here."""
PART_MIN_BYTES = 4 << 20
"""Below this much per part, splitting a tensor over cores costs more than it gains."""
_SLACK = 8  # entries past a scratch's capacity that a changed word may write before it is counted


def kernels() -> ModuleType:
    """The compiled kernels (numba is imported, and each kernel compiled or loaded from its
    cache, on first use); an ``ImportError`` that says how to install numba without it."""
    try:
        from ckpt_core._internal import bitdiff_kernels
    except ImportError as exc:
        raise ImportError(
            f"delta refits of host tensors need numba ({exc}): pip install 'numba>=0.60' (ckpt-core depends on it)"
        ) from exc
    return bitdiff_kernels


_warming: threading.Thread | None = None


def warm_up_in_background() -> None:
    """Load (or compile, the first time on a machine) every kernel a host delta refit runs, on
    a daemon thread, once per process: a refit that starts meanwhile waits only for what is
    left (numba's dispatchers serialize the loading). Importing numba and loading each kernel
    from its cache takes a few tenths of a second, which a first refit would otherwise pay."""
    global _warming
    with _warm_lock:
        if _warming is None:
            _warming = threading.Thread(target=_warm_up, name="ckpt-delta-warm-up", daemon=True)
            _warming.start()


def _warm_up() -> None:
    try:
        for value_dtype in (np.uint8, np.int16, np.int32, np.int64):
            old = np.zeros(64, dtype=value_dtype)
            new = old.copy()
            new[3] = 1
            for update in (False, True):
                find(
                    old.copy(),
                    new,
                    max_changed=8,
                    position_dtype=np.dtype(np.int32),
                    prefix=8,
                    with_digest=True,
                    update=update,
                )
            patch(old.copy(), np.array([3], dtype=np.int32), new[3:4], keep=True, with_digest=True)
            patch(old.copy(), np.array([3], dtype=np.int32), new[3:4], keep=False, with_digest=False)
            kernels().scatter(old.copy(), np.array([3], dtype=np.int32), new[3:4])
            starts = np.zeros(1, dtype=np.int64)
            count(old, new, starts, 64)
            count_and_refresh(old.copy(), new, starts, 64)
    except Exception:  # noqa: BLE001 - a refit that needs a kernel reports why it cannot load
        pass


_warm_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class Found:
    """What :func:`find` found: ``count`` changed elements among ``compared`` elements
    (when ``over``: more than it was allowed; it stopped early, having compared only part of
    them); unless over, ``blob`` (``prefix`` bytes left for the caller, the positions, zeros up
    to a multiple of 8 bytes, the values: see :func:`layout`),
    when asked for, the new version's leaf ``digest``, and with ``update``, ``saved``: the old
    version's values at the positions (writing them back at the positions undoes the update)."""

    count: int
    over: bool
    compared: int
    blob: np.ndarray | None = None
    digest: int | None = None
    saved: np.ndarray | None = None


def layout(count: int, prefix: int, position_width: int, value_width: int) -> tuple[int, int]:
    """Where a patch of ``count`` elements sits in its blob: ``(values offset, blob size)``;
    its positions start at ``prefix`` (a multiple of 8)."""
    values_at = prefix + -(-count * position_width // 8) * 8
    return values_at, values_at + count * value_width


def find(
    old: np.ndarray,
    new: np.ndarray,
    *,
    max_changed: int,
    position_dtype: np.dtype[Any],
    prefix: int,
    with_digest: bool,
    update: bool = False,
) -> Found:
    """The elements of ``new`` whose bits differ from ``old`` (1-D integer arrays of one dtype
    and length), unless more than ``max_changed`` do; with ``with_digest``, ``new``'s leaf
    digest too. With ``update``, ``old`` is made equal to ``new`` as it is compared (the
    changed elements written in, their old values kept in ``Found.saved``), unless the count
    is over, when ``old`` is left as it was. Stops early (every part) once over."""
    compiled = kernels()
    numel = new.shape[0]
    width = new.itemsize
    lanes, head, old_words, new_words = _words(old, new)
    leaf = LEAF_BYTES // width
    leaves = -(-numel // leaf)
    parts = _parts(numel * width, leaves)
    counts = [0] * parts
    new_bytes = new.view(np.uint8)
    no_saved = np.empty(0, dtype=new.dtype)

    def part(index: int) -> _Part:
        result = _Part(_Scratch.take(position_dtype, new.dtype, saved=update))
        scratch = result.scratch
        try:
            for number in range(leaves * index // parts, leaves * (index + 1) // parts):
                start = number * leaf
                stop = min(numel, start + leaf)
                while True:
                    found = compiled.find_changes(
                        old,
                        new,
                        old_words,
                        new_words,
                        head,
                        lanes,
                        start,
                        stop,
                        scratch.positions,
                        scratch.values,
                        scratch.saved if update else no_saved,
                        result.count,
                        scratch.capacity,
                    )
                    if found >= 0:
                        break
                    if scratch.capacity >= max_changed:  # over: what it holds (updated too) stays counted
                        result.count, result.compared = -1 - found, result.compared + stop - start
                        result.over = True
                        return result
                    if update:  # the leaf's elements updated so far go back: it is compared again
                        result.undo(old, result.count, -1 - found)
                    scratch.grow(min(max_changed, 2 * scratch.capacity + leaf), keep=result.count)
                result.count = counts[index] = found
                result.compared += stop - start
                if sum(counts) > max_changed:  # with the other parts' counts so far: over already
                    result.over = True
                    return result
                if with_digest:
                    result.digests.append(xxhash.xxh3_64_intdigest(new_bytes[start * width : stop * width].data))
        except BaseException:
            if update:
                result.undo(old, 0, result.count)
            scratch.give_back()
            raise
        return result

    results = run_parts(part, parts)
    total = sum(result.count for result in results)
    if any(result.over for result in results) or total > max_changed:
        for result in results:
            if update:
                result.undo(old, 0, result.count)
            result.scratch.give_back()
        return Found(count=total, over=True, compared=sum(result.compared for result in results))
    values_at, size = layout(total, prefix, position_dtype.itemsize, width)
    blob = np.empty(size, dtype=np.uint8)
    blob[prefix:values_at] = 0  # the padding (and any room the positions leave)
    positions = blob[prefix : prefix + total * position_dtype.itemsize].view(position_dtype)
    values = blob[values_at:].view(new.dtype)
    saved = np.empty(total if update else 0, dtype=new.dtype)
    at = 0
    for result in results:
        count, scratch = result.count, result.scratch
        positions[at : at + count] = scratch.positions[:count]
        values[at : at + count] = scratch.values[:count]
        if update:
            saved[at : at + count] = scratch.saved[:count]
        at += count
        scratch.give_back()
    digest = _combine(numel * width, [d for result in results for d in result.digests]) if with_digest else None
    return Found(count=total, over=False, compared=numel, blob=blob, digest=digest, saved=saved if update else None)


def patch(
    held: np.ndarray, positions: np.ndarray, values: np.ndarray, *, keep: bool, with_digest: bool
) -> tuple[np.ndarray | None, int | None]:
    """``held[positions] = values`` in place (1-D arrays; ``values`` of ``held``'s dtype), the
    positions strictly ascending and inside ``held``; returns, with ``keep``, the values it
    overwrote (writing them back undoes it) and, with ``with_digest``, ``held``'s leaf digest
    after the write, each leaf hashed as soon as it is patched. A position out of order or out
    of range is a ``ValueError``, raised after whatever was written was put back (with
    ``keep``; without, the positions are the caller's own, made by :func:`find`)."""
    compiled = kernels()
    count, size, width = positions.shape[0], held.shape[0], held.itemsize
    saved = np.empty(count if keep else 0, dtype=held.dtype)
    held_bytes = held.view(np.uint8)
    if with_digest:
        leaf = LEAF_BYTES // width
        leaves = -(-size // leaf)
        parts = _parts(size * width, leaves)
    else:  # the work is the patch's entries alone
        leaf, leaves = max(1, size), 1 if size else 0
        parts = 1
    # Each leaf's entries: from the first position at or past its start.
    firsts = np.searchsorted(positions, np.arange(leaves + 1, dtype=np.int64) * leaf) if leaves else np.zeros(1, int)
    firsts[0], firsts[-1] = 0, count  # entries out of range fall to the first or last leaf, which refuses them
    if leaves and bool((firsts[1:] < firsts[:-1]).any()):  # unsorted: the parts would not cover every entry
        raise ValueError(f"the patch's {count} positions do not ascend")

    def part(index: int) -> tuple[int, int, list[int]]:
        """Patches and hashes one part's leaves; returns its entries' range as written (its
        end short of the part's where an entry was bad) and its leaves' digests."""
        lo_leaf, hi_leaf = leaves * index // parts, leaves * (index + 1) // parts
        lo, written = int(firsts[lo_leaf]), int(firsts[lo_leaf])
        digests: list[int] = []
        for number in range(lo_leaf, hi_leaf):
            hi = int(firsts[number + 1])
            if hi > written:
                after = int(positions[written - 1]) if written else -1
                bad = compiled.write_patch(
                    held, positions[written:hi], values[written:hi], saved[written:hi] if keep else saved, after
                )
                if bad >= 0:
                    return lo, written + bad, digests
                written = hi
            if with_digest:
                digests.append(
                    xxhash.xxh3_64_intdigest(
                        held_bytes[number * leaf * width : min(size, (number + 1) * leaf) * width].data
                    )
                )
        return lo, written, digests

    results = run_parts(part, parts) if leaves else [(0, 0, [])]
    ends = [int(firsts[leaves * (index + 1) // parts]) for index in range(len(results))]
    bad = [written for (_, written, _), end in zip(results, ends) if written != end]
    if bad or (not leaves and count):
        first = min(bad, default=0)
        if keep:
            for lo, written, _ in results:
                compiled.scatter(held, positions[lo:written], saved[lo:written])
        raise ValueError(
            f"patch entry {first} holds position {int(positions[first])}: positions must ascend strictly, within "
            f"the {size} elements"
        )
    digest_value = _combine(size * width, [d for _, _, digests in results for d in digests]) if with_digest else None
    return (saved if keep else None), digest_value


def count(old: np.ndarray, new: np.ndarray, starts: np.ndarray, length: int) -> int:
    """The elements whose bits differ between ``old`` and ``new`` (1-D integer arrays of one
    dtype) in the ranges of ``length`` elements at each of ``starts`` (``int64``), summed: a
    screening sample, read on the calling thread in one call."""
    return int(kernels().count_ranges(old, new, starts, length))


def count_and_refresh(sample: np.ndarray, new: np.ndarray, starts: np.ndarray, length: int) -> int:
    """:func:`count` of ``sample`` (those ranges of an earlier ``new``, one after the other)
    against ``new``; ``sample`` then holds ``new``'s ranges."""
    return int(kernels().count_refresh(sample, new, starts, length))


def digest(data: np.ndarray) -> int:
    """The leaf digest of ``data``'s bytes (a 1-D ``uint8`` array), hashed in parallel parts."""
    size = data.shape[0]
    leaves = -(-size // LEAF_BYTES)
    parts = _parts(size, leaves)

    def part(index: int) -> list[int]:
        return [
            xxhash.xxh3_64_intdigest(data[n * LEAF_BYTES : min(size, (n + 1) * LEAF_BYTES)].data)
            for n in range(leaves * index // parts, leaves * (index + 1) // parts)
        ]

    return _combine(size, [d for digests in run_parts(part, parts) for d in digests])


def _combine(nbytes: int, leaf_digests: list[int]) -> int:
    words = np.array([nbytes, *leaf_digests], dtype="<u8")
    return xxhash.xxh3_64_intdigest(words.tobytes())


def _parts(nbytes: int, units: int) -> int:
    """How many parts to split ``nbytes`` of work in ``units`` leaves into (at least 1 where
    there is a unit)."""
    if units <= 0:
        return 1
    return max(1, min(usable_cores(), units, nbytes // PART_MIN_BYTES))


def _words(old: np.ndarray, new: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray]:
    """``(lanes, head, old words, new words)``: the two arrays' elements ``head`` on as
    ``int64`` words of ``lanes`` elements, where both are aligned alike; else the elements
    themselves (one lane each)."""
    width = new.itemsize
    if width == 8:
        return 1, 0, old, new
    lanes = 8 // width
    misaligned = new.ctypes.data % 8
    if old.ctypes.data % 8 != misaligned or misaligned % width:
        return 1, 0, old, new
    head = ((8 - misaligned) % 8) // width
    words = (new.shape[0] - head) // lanes
    if words <= 0:
        return 1, 0, old, new
    stop = head + words * lanes
    return lanes, head, old[head:stop].view(np.int64), new[head:stop].view(np.int64)


@dataclasses.dataclass
class _Part:
    """One part of a :func:`find`: its scratch, the entries it holds, its leaves' digests, and
    whether the count was over when it stopped."""

    scratch: _Scratch
    count: int = 0
    compared: int = 0  # elements of the leaves it finished
    digests: list[int] = dataclasses.field(default_factory=list)
    over: bool = False

    def undo(self, old: np.ndarray, start: int, stop: int) -> None:
        """Write the saved values of entries ``[start, stop)`` back into ``old``."""
        if stop > start:
            written = slice(start, stop)
            kernels().scatter(old, self.scratch.positions[written], self.scratch.saved[written])


class _Scratch:
    """Reused output arrays for one part of a :func:`find`: taken from a small free list (so
    concurrent diffs, one per destination stream, never share one), grown as needed, and
    given back. The memory they keep is bounded by the largest part of a patch found."""

    _free: dict[tuple[str, str, bool], list[_Scratch]] = {}
    _lock = threading.Lock()
    _KEEP = 8  # free scratches kept per dtype pair

    def __init__(self, key: tuple[str, str, bool], capacity: int) -> None:
        self.key = key
        self.capacity = capacity
        self.positions = np.empty(capacity + _SLACK, dtype=key[0])
        self.values = np.empty(capacity + _SLACK, dtype=key[1])
        self.saved = np.empty(capacity + _SLACK if key[2] else 0, dtype=key[1])

    @classmethod
    def take(cls, position_dtype: np.dtype[Any], value_dtype: np.dtype[Any], *, saved: bool) -> _Scratch:
        """A scratch of these dtypes (with room for saved values too, if asked)."""
        key = (position_dtype.str, value_dtype.str, saved)
        with cls._lock:
            free = cls._free.get(key)
            if free:
                return free.pop()
        return cls(key, 1 << 16)

    def grow(self, capacity: int, *, keep: int) -> None:
        """Room for ``capacity`` entries, the first ``keep`` kept."""
        for name in ("positions", "values", "saved"):
            old = getattr(self, name)
            if old.shape[0]:
                grown = np.empty(capacity + _SLACK, dtype=old.dtype)
                grown[:keep] = old[:keep]
                setattr(self, name, grown)
        self.capacity = capacity

    def give_back(self) -> None:
        with self._lock:
            free = self._free.setdefault(self.key, [])
            if len(free) < self._KEEP and self not in free:
                free.append(self)


def _reset_after_fork() -> None:
    global _warm_lock, _warming
    _Scratch._lock = threading.Lock()  # another thread may have held it at the fork
    _warm_lock, _warming = threading.Lock(), None  # the parent's warm-up thread is not the child's


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
