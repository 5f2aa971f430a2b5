"""Bitwise diffs, patches and digests of host memory at memory speed: delta refits' inner loops.

:mod:`ckpt_core.refit.delta` views a host tensor's elements as integers of their width and hands
them here as 1-D numpy arrays. Each function reads or writes every byte it must once, in
parallel parts over the usable cores (:mod:`ckpt_core._internal.parallel`; the parts claim
leaves one at a time, so a part slowed by a shared core does fewer), with loops compiled by
numba (:mod:`ckpt_core._internal.bitdiff_kernels`, imported on first use):

* :func:`find`: the elements whose bits differ between two versions, laid out as a patch's
  wire form, and the new version's digest: from the old version's digest, in time that
  follows the changed words, or hashed whole in the same pass (each leaf while the comparison
  has it in cache);
* :func:`patch`: a patch written into a tensor in place (the overwritten values kept on
  request), its positions checked as it goes, and the patched tensor's digest: from its
  terms before the patch and the words it wrote, or hashed whole in the same pass;
* :func:`class_terms`: one class of a tensor's leaves hashed (an audit of a copy whose
  digest was made from patches);
* :func:`count` and :func:`count_and_refresh`: the changed elements in a few ranges (a
  screening sample), read only, or against a kept copy of them, which is refreshed;
* :func:`digest`: the word digest of a tensor's bytes.

**Word digest.** The bytes are read as little-endian 64-bit words (the last one padded with
zero bytes); the digest is the sum, mod 2**64, of one term per word (the product of its two
32-bit halves, each keyed by the word's index, plus the word) and a term of the byte count. A sum can be hashed in
parts on every core, and it moves by each changed word's new term less its old one: a sender
that knows its copy's digest has the new version's from the words it found changed, and a
receiver that knows its copy's terms by leaf class has its patched copy's from the words the
patch wrote, each without hashing the rest (the receiver then reads one class of leaves
whole, a different one each patch: :func:`class_terms`). Work runs in leaves of
:data:`LEAF_BYTES`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from types import ModuleType
from typing import Any

import numpy as np

from ckpt_core._internal.parallel import Claims, run_parts, usable_cores

LEAF_BYTES = 1 << 20
"""The leaf digest's leaf size, and the unit of work of every function here (a power of two)."""
AUDIT_CLASSES = 16
"""Leaves fall into this many classes, a leaf's index modulo it (a power of two). A copy's
digest terms kept by class (:attr:`Patched.terms`) let its holder make its digest after a patch
from the words the patch wrote alone, and still read all of it in turn, one class per patch
(:func:`class_terms`)."""
TERMS_BYTES_PER_ENTRY = 128
"""A patch with more entries than one per this many bytes of its array is hashed whole, terms
given or not. Measured on a 2-core host (128 MiB of bf16, one thread): following an entry's
word costs 9 ns beyond its write, hashing the array 0.05 ns a byte, an even cost at about one
entry per 180 bytes (1.1% of bf16 elements). Following reads only the lines the patch writes,
hashing reads every byte, which slows whatever shares the memory meanwhile (a sender on the
same host), so the bound sits past the even point."""
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
            for update, old_digest in ((False, None), (True, None), (True, 0)):
                find(
                    old.copy(),
                    new,
                    max_changed=8,
                    position_dtype=np.dtype(np.int32),
                    prefix=8,
                    with_digest=True,
                    update=update,
                    old_digest=old_digest,
                )
            patched = patch(old.copy(), np.array([3], dtype=np.int32), new[3:4], keep=True, with_digest=True)
            patch(old.copy(), np.array([3], dtype=np.int32), new[3:4], keep=True, with_digest=True, terms=patched.terms)
            class_terms(old, 0)
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
    when asked for, the new version's word ``digest``, and with ``update``, ``saved``: the old
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
    old_digest: int | None = None,
) -> Found:
    """The elements of ``new`` whose bits differ from ``old`` (1-D integer arrays of one dtype
    and length), unless more than ``max_changed`` do; with ``with_digest``, ``new``'s word
    digest too: from ``old_digest`` (``old``'s, if given and both arrays' words are their own,
    8-byte aligned) and the changed words alone, else hashed whole, leaf by leaf, in the same
    pass. With ``update``, ``old`` is made equal to ``new`` as it is compared (the
    changed elements written in, their old values kept in ``Found.saved``), unless the count
    is over, when ``old`` is left as it was. Stops early (every part) once over."""
    compiled = kernels()
    numel = new.shape[0]
    width = new.itemsize
    lanes, head, old_words, new_words = _words(old, new)
    own_words = _own_words(new) and (lanes > 1 or width == 8)  # then head is 0
    incremental = with_digest and old_digest is not None and own_words
    hashed = with_digest and not incremental and own_words  # hashed whole beside the comparison
    leaf = LEAF_BYTES // width
    leaves = -(-numel // leaf)
    parts = _parts(numel * width, leaves)
    counts = [0] * parts
    claims = Claims(leaves)  # each part compares the next leaf no part has taken
    no_saved = np.empty(0, dtype=new.dtype)
    no_change = np.empty(0, dtype=np.uint64)
    tail_before = _tail_term(old) if incremental else 0  # before an update overwrites it

    def part(index: int) -> _Part:
        result = _Part(_Scratch.take(position_dtype, new.dtype, saved=update))
        change = np.zeros(1 if incremental else 0, dtype=np.uint64)
        scratch = result.scratch
        try:
            for number in claims:
                start = number * leaf
                stop = min(numel, start + leaf)
                begin = result.count
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
                        change if incremental else no_change,
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
                result.leaves.append((number, begin, found))
                result.compared += stop - start
                if sum(counts) > max_changed:  # with the other parts' counts so far: over already
                    result.over = True
                    return result
                if hashed:
                    words = new_words[start // lanes : stop // lanes].view(np.uint64)
                    result.terms += int(compiled.word_sum(words, start // lanes))
        except BaseException:
            if update:
                result.undo(old, 0, result.count)
            scratch.give_back()
            raise
        result.terms += int(change[0]) if incremental else 0
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
    # The parts' leaves go into the patch in leaf order, each part copying its own at once.
    claimed = sorted((number, index, first, end) for index, r in enumerate(results) for number, first, end in r.leaves)
    moves: list[list[tuple[int, int, int]]] = [[] for _ in results]  # per part: (first, end, to)
    at = 0
    for _, index, first, end in claimed:
        moves[index].append((first, end, at))
        at += end - first

    def place(index: int) -> None:
        scratch = results[index].scratch
        for first, end, to in moves[index]:
            positions[to : to + end - first] = scratch.positions[first:end]
            values[to : to + end - first] = scratch.values[first:end]
            if update:
                saved[to : to + end - first] = scratch.saved[first:end]
        scratch.give_back()

    run_parts(place, len(results))
    digest_value = None
    terms = sum(result.terms for result in results)
    if incremental:
        assert old_digest is not None
        digest_value = (old_digest + terms + _tail_term(new) - tail_before) & _MASK
    elif hashed:
        digest_value = (terms + _tail_term(new) + _length_term(numel * width)) & _MASK
    elif with_digest:  # words not its own: hashed apart
        digest_value = digest(new.view(np.uint8))
    return Found(
        count=total, over=False, compared=numel, blob=blob, digest=digest_value, saved=saved if update else None
    )


@dataclasses.dataclass(frozen=True)
class Patched:
    """What :func:`patch` did: ``saved``, the values it overwrote (when kept); ``digest``, the
    patched array's word digest (when asked for); ``terms``, its digest terms summed by leaf
    class (:data:`AUDIT_CLASSES`; where its words are its own), from which its next patch
    makes the digest without hashing it and :func:`class_terms` audits it one class at a time."""

    saved: np.ndarray | None
    digest: int | None
    terms: np.ndarray | None
    hashed: bool = False
    """Whether the array was hashed whole (every byte read; not where the digest was made
    from the terms given and the words the patch wrote)."""


def patch(
    held: np.ndarray,
    positions: np.ndarray,
    values: np.ndarray,
    *,
    keep: bool,
    with_digest: bool,
    terms: np.ndarray | None = None,
) -> Patched:
    """``held[positions] = values`` in place (1-D arrays; ``values`` of ``held``'s dtype), the
    positions strictly ascending and inside ``held``; with ``keep``, the values it overwrote
    are returned (writing them back undoes it). With ``with_digest``, ``held``'s word digest
    after the write, and where ``held``'s words are its own (8-byte aligned) its terms by leaf
    class: given ``terms`` (``held``'s before the write, as a :class:`Patched` gave them; not
    changed) and a patch of at most one entry per :data:`TERMS_BYTES_PER_ENTRY` bytes, from
    them and the words the patch writes alone, in time that follows the patch; else hashed
    whole, each leaf as soon as it is patched. A position out of order or out of
    range is a ``ValueError``, raised after whatever was written was put back (with ``keep``;
    without, the positions are the caller's own, made by :func:`find`)."""
    compiled = kernels()
    count, size, width = positions.shape[0], held.shape[0], held.itemsize
    saved = np.empty(count if keep else 0, dtype=held.dtype)
    words = _word_view(held) if with_digest else None  # None: hashed apart, once patched
    incremental = words is not None and terms is not None and count * TERMS_BYTES_PER_ENTRY <= held.nbytes
    if words is not None:  # leaf by leaf: each hashed as soon as it is patched, or followed before
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

    claims = Claims(leaves)  # each part patches the next leaf no part has taken
    failed: list[int] = []  # the first bad entry each part met (a part that meets one stops the rest)

    def part(index: int) -> tuple[list[tuple[int, int]], np.ndarray]:
        """Patches the leaves it claims, hashing or following their words; returns the ranges
        of entries it wrote (the last short of its leaf's end where an entry was bad) and its
        digest terms by class: its leaves', or the changes the patch made to them."""
        ranges: list[tuple[int, int]] = []
        sums = np.zeros(AUDIT_CLASSES if words is not None else 0, dtype=np.uint64)
        for number in claims:
            if failed:
                break
            lo, hi = int(firsts[number]), int(firsts[number + 1])
            if incremental:
                assert words is not None
                bad = compiled.write_patch_followed(
                    held, words, positions, values, saved, firsts[number : number + 2], number, width, sums
                )
            elif hi > lo:
                after = int(positions[lo - 1]) if lo else -1
                bad = compiled.write_patch(
                    held, positions[lo:hi], values[lo:hi], saved[lo:hi] if keep else saved, after
                )
                bad = bad if bad < 0 else lo + bad
            else:
                bad = -1
            if bad >= 0:
                ranges.append((lo, bad))
                failed.append(bad)
                break
            ranges.append((lo, hi))
            if words is not None and not incremental:
                first = number * leaf * width // 8
                stop = min(size, (number + 1) * leaf) * width // 8
                at = number % AUDIT_CLASSES
                sums[at : at + 1] += np.uint64(compiled.word_sum(words[first:stop], first))  # an array's sum wraps
        return ranges, sums

    results = run_parts(part, parts) if leaves else [([], np.zeros(AUDIT_CLASSES, dtype=np.uint64))]
    if failed or (not leaves and count):
        first = min(failed, default=0)
        if keep:
            for ranges, _ in results:
                for lo, written in ranges:
                    compiled.scatter(held, positions[lo:written], saved[lo:written])
        raise ValueError(
            f"patch entry {first} holds position {int(positions[first])}: positions must ascend strictly, within "
            f"the {size} elements"
        )
    digest_value, after_terms = None, None
    if words is not None:
        after_terms = terms.copy() if incremental and terms is not None else np.zeros(AUDIT_CLASSES, dtype=np.uint64)
        for _, sums in results:
            after_terms += sums  # uint64: wraps, mod 2**64 as the digest is
        digest_value = (_sum(after_terms) + _tail_term(held) + _length_term(size * width)) & _MASK
    elif with_digest:
        digest_value = digest(held.view(np.uint8))
    return Patched(saved if keep else None, digest_value, after_terms, hashed=with_digest and not incremental)


def class_terms(elements: np.ndarray, number: int) -> int:
    """The sum of the word digest's terms of ``elements``' leaves of class ``number`` (the
    leaves whose index modulo :data:`AUDIT_CLASSES` is ``number``; ``elements``' words its
    own), read in parallel parts: what :attr:`Patched.terms` holds for that class while
    nothing but patches wrote to ``elements``."""
    words = _word_view(elements)
    if words is None:
        raise ValueError("class terms are of an array whose words are its own (8-byte aligned)")
    leaf_words = LEAF_BYTES // 8
    leaves = list(range(number, -(-words.shape[0] // leaf_words), AUDIT_CLASSES))
    parts = _parts(len(leaves) * LEAF_BYTES, len(leaves))
    compiled = kernels()
    claims = Claims(len(leaves))

    def part(_index: int) -> int:  # every part claims leaves alike
        total = 0
        for leaf in (leaves[claimed] for claimed in claims):
            first = leaf * leaf_words
            total += int(compiled.word_sum(words[first : first + leaf_words], first))
        return total

    return sum(run_parts(part, parts)) & _MASK if leaves else 0


def audit_classes(elements: np.ndarray) -> int:
    """How many leaf classes ``elements``' whole words fill (at most :data:`AUDIT_CLASSES`;
    at least 1)."""
    return max(1, min(AUDIT_CLASSES, -(-(elements.nbytes // 8) // (LEAF_BYTES // 8))))


def _sum(terms: np.ndarray) -> int:
    return sum(int(value) for value in terms) & _MASK


def count(old: np.ndarray, new: np.ndarray, starts: np.ndarray, length: int) -> int:
    """The elements whose bits differ between ``old`` and ``new`` (1-D integer arrays of one
    dtype) in the ranges of ``length`` elements at each of ``starts`` (``int64``), summed: a
    screening sample, read on the calling thread in one call."""
    return int(kernels().count_ranges(old, new, starts, length))


def count_and_refresh(sample: np.ndarray, new: np.ndarray, starts: np.ndarray, length: int) -> int:
    """:func:`count` of ``sample`` (those ranges of an earlier ``new``, one after the other)
    against ``new``; ``sample`` then holds ``new``'s ranges."""
    return int(kernels().count_refresh(sample, new, starts, length))


_MASK = (1 << 64) - 1
_LOW_32 = (1 << 32) - 1
_LOW_KEY, _HIGH_KEY = 0x9E3779B9, 0x85EBCA6B
_LENGTH_INDEX = _MASK  # the byte count's term is keyed by an index no word has


def _term(index: int, word: int) -> int:
    """One word's term (:func:`ckpt_core._internal.bitdiff_kernels.word_term`, in Python)."""
    low = (word ^ ((index + _LOW_KEY) & _MASK)) & _LOW_32
    high = ((word >> 32) ^ (index ^ _HIGH_KEY)) & _LOW_32
    return (low * high + word) & _MASK


def _length_term(nbytes: int) -> int:
    return _term(_LENGTH_INDEX, nbytes)


def _tail_term(elements: np.ndarray) -> int:
    """The term of the word that the last ``nbytes % 8`` bytes of ``elements`` start (zero
    bytes pad it); 0 where there are none."""
    data = elements.view(np.uint8)
    whole = data.shape[0] // 8 * 8
    if whole == data.shape[0]:
        return 0
    return _term(whole // 8, int.from_bytes(data[whole:].tobytes().ljust(8, b"\0"), "little"))


def _own_words(elements: np.ndarray) -> bool:
    """Whether ``elements``' whole 64-bit words start at its first byte (8-byte aligned)."""
    return elements.ctypes.data % 8 == 0


def _word_view(elements: np.ndarray) -> np.ndarray | None:
    """``elements``' whole words as ``uint64`` (a view), or ``None`` where it is not 8-byte
    aligned."""
    if not _own_words(elements):
        return None
    data = elements.view(np.uint8)
    return data[: data.shape[0] // 8 * 8].view(np.uint64)


def digest(data: np.ndarray) -> int:
    """The word digest of ``data``'s bytes (a 1-D ``uint8`` array): its words summed in
    parallel parts, leaf by leaf (an unaligned array's leaves copied to aligned memory first)."""
    size = data.shape[0]
    words = _word_view(data)
    leaf_words = LEAF_BYTES // 8
    count = size // 8
    leaves = -(-count // leaf_words)
    parts = _parts(size, leaves)
    compiled = kernels()
    claims = Claims(leaves)

    def part(_index: int) -> int:  # every part claims leaves alike
        terms = 0
        bounce = np.empty(leaf_words if words is None else 0, dtype=np.uint64)
        for number in claims:
            first, stop = number * leaf_words, min(count, (number + 1) * leaf_words)
            if words is not None:
                chunk = words[first:stop]
            else:
                chunk = bounce[: stop - first]
                chunk.view(np.uint8)[:] = data[first * 8 : stop * 8]
            terms += int(compiled.word_sum(chunk, first))
        return terms

    terms = sum(run_parts(part, parts)) if leaves else 0
    return (terms + _tail_term(data) + _length_term(size)) & _MASK


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
    """One part of a :func:`find`: its scratch, the entries it holds, the leaves it claimed
    (each with the range of its entries), the digest terms it summed (its leaves', or its words'
    changes), and whether the count was over when it stopped."""

    scratch: _Scratch
    count: int = 0
    leaves: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (leaf, first entry, end)
    compared: int = 0  # elements of the leaves it finished
    terms: int = 0
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
