"""The compiled loops of :mod:`ckpt_core._internal.bitdiff` (numba, no GIL held while they run).

Imported only when a host delta refit first runs (importing numba takes a fifth of a second);
each kernel is compiled once per combination of array types it meets and cached on disk
(numba's ``cache=True``), so later processes load it instead of compiling it again.

Arrays are 1-D and C-contiguous; "elements" are a tensor's elements viewed as integers of
their width, "words" the same bytes as ``int64`` (``lanes`` elements each, the first starting
``head`` elements in). No bounds are checked here: the callers size every array.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit
from numba.cpython.unsafe.numbers import trailing_zeros

_BLOCK = 64  # words whose inequality is gathered into one 64-bit mask before any branch
# The word digest's keys (the golden ratio's and murmur3's constants) and its 32-bit mask.
_LOW_KEY = np.uint64(0x9E3779B9)
_HIGH_KEY = np.uint64(0x85EBCA6B)
_LOW_32 = np.uint64(0xFFFFFFFF)


@njit(inline="always", nogil=True, cache=True)
def word_term(index: Any, word: Any) -> Any:  # pragma: no cover - compiled
    """One 64-bit word's term of the word digest (:mod:`ckpt_core._internal.bitdiff`): the
    product of its two halves, each keyed by the word's index, plus the word (so that a change
    the product does not show, where a keyed half is 0, still moves the term). 32 x 32-bit
    products: xxh3's accumulation step, at the speed of a hash on every SIMD width."""
    w = np.uint64(word)
    i = np.uint64(index)
    low = (w ^ (i + _LOW_KEY)) & _LOW_32
    high = ((w >> np.uint64(32)) ^ (i ^ _HIGH_KEY)) & _LOW_32
    return low * high + w


@njit(nogil=True, cache=True, boundscheck=False)
def word_sum(words: Any, first: int) -> Any:  # pragma: no cover - compiled
    """The sum (mod 2**64) of the word digest's terms of ``words``, the first of index
    ``first`` (a branch-free loop: it vectorizes, and runs at the memory's read speed)."""
    total = np.uint64(0)
    for j in range(words.shape[0]):
        total += word_term(first + j, words[j])
    return total


@njit(nogil=True, cache=True, boundscheck=False)
def find_changes(
    old: Any,
    new: Any,
    old_words: Any,
    new_words: Any,
    head: int,
    lanes: int,
    start: int,
    stop: int,
    positions: Any,
    values: Any,
    saved: Any,
    count: int,
    capacity: int,
    change: Any,
) -> int:  # pragma: no cover - compiled; run by tests/refit_kinds/test_delta.py
    """Append each element of ``[start, stop)`` whose bits differ between ``old`` and ``new``:
    its index to ``positions`` and its new bits to ``values``, from entry ``count`` on, in
    ascending order. Returns the new count; once it would pass ``capacity``, ``-1 - n`` for
    the ``n`` entries it holds then (the arrays hold ``capacity + 8`` entries: a changed word
    writes all its lanes before counting them).
    Where ``saved`` is not empty, ``old`` is updated too: each changed element's old bits go
    to ``saved`` (entry for entry with ``positions``) and its new bits into ``old``, so that
    ``old`` ends equal to ``new`` over the range (writing ``saved`` back undoes it).

    Where ``change`` is not empty (the words are the array's own: ``head`` is 0), each changed
    whole word's change to the word digest (its new term less its old) is added to
    ``change[0]``: the digest of ``new`` is then the digest of ``old`` plus it, in time that
    follows the changed words (the elements past the last whole word are the caller's).

    Words are compared a block of 64 at a time into one mask whose set bits are then visited
    (no branch per word, so the cost follows the changed words, not the unchanged ones); a
    changed word's lanes are written without branching and counted where they differ."""
    n = count
    update = saved.shape[0] > 0
    track = change.shape[0] > 0
    moved = np.uint64(0)
    if start < head:
        first_word_element = head
    else:
        first_word_element = head + ((start - head + lanes - 1) // lanes) * lanes
    first_word_element = min(first_word_element, stop)
    for x in range(start, first_word_element):  # the elements before the first whole word
        if old[x] != new[x]:
            if n >= capacity:
                return -1 - n
            positions[n] = x
            values[n] = new[x]
            if update:
                saved[n] = old[x]
                old[x] = new[x]
            n += 1
    word = (first_word_element - head) // lanes
    end_word = max(word, (stop - head) // lanes) if stop >= head else word
    end_word = min(end_word, old_words.shape[0])
    # Indexed from 0: an index the compiler cannot prove non-negative gets a wraparound
    # check, which keeps the mask loop from vectorizing (measured: 3x slower).
    old_block, new_block = old_words[word:end_word], new_words[word:end_word]
    words = end_word - word
    i = 0
    while i + _BLOCK <= words:
        mask = np.uint64(0)
        for k in range(_BLOCK):
            mask |= np.uint64(old_block[i + k] != new_block[i + k]) << np.uint64(k)
        while mask:
            at = i + trailing_zeros(mask)
            element = head + (word + at) * lanes
            mask &= mask - np.uint64(1)
            if track:  # the same branch every time: predicted
                moved += word_term(word + at, new_block[at]) - word_term(word + at, old_block[at])
            for lane in range(lanes):
                e = element + lane
                was, now = old[e], new[e]
                positions[n] = e
                values[n] = now
                if update:  # the same branch every time: predicted
                    saved[n] = was
                    old[e] = now
                n += was != now
            if n > capacity:
                return -1 - n
        i += _BLOCK
    for j in range(i, words):
        if old_block[j] != new_block[j]:
            element = head + (word + j) * lanes
            if track:
                moved += word_term(word + j, new_block[j]) - word_term(word + j, old_block[j])
            for lane in range(lanes):
                e = element + lane
                was, now = old[e], new[e]
                positions[n] = e
                values[n] = now
                if update:  # the same branch every time: predicted
                    saved[n] = was
                    old[e] = now
                n += was != now
            if n > capacity:
                return -1 - n
    for x in range(max(head + end_word * lanes, first_word_element), stop):  # after the last whole word
        if old[x] != new[x]:
            if n >= capacity:
                return -1 - n
            positions[n] = x
            values[n] = new[x]
            if update:
                saved[n] = old[x]
                old[x] = new[x]
            n += 1
    if track:
        change[0] += moved
    return n


@njit(nogil=True, cache=True, boundscheck=False)
def write_patch(held: Any, positions: Any, values: Any, saved: Any, after: int) -> int:  # pragma: no cover
    """``held[positions[k]] = values[k]`` for each ``k`` in order, first copying the value it
    overwrites to ``saved[k]`` where ``saved`` is not empty. Each position must be above the
    one before it (the first above ``after``) and below ``len(held)``: returns -1 when all
    were, else the index of the first that was not (nothing from it on was written)."""
    size = held.shape[0]
    previous = after
    keep = saved.shape[0] > 0
    for k in range(positions.shape[0]):
        p = positions[k]
        if p <= previous or p >= size:
            return k
        if keep:
            saved[k] = held[p]
        held[p] = values[k]
        previous = p
    return -1


@njit(nogil=True, cache=True, boundscheck=False)
def write_patch_followed(
    held: Any,
    words: Any,
    positions: Any,
    values: Any,
    saved: Any,
    firsts: Any,
    first_leaf: int,
    width: int,
    change: Any,
) -> int:  # pragma: no cover - compiled; run by tests/refit_kinds/test_delta.py
    """:func:`write_patch` of the entries of consecutive leaves, leaf by leaf (``firsts[i]``
    to ``firsts[i + 1]``: the entries of leaf ``first_leaf + i``), with the word digest
    followed: before a leaf's entries are written, the change they make to its words' terms
    (:func:`word_changes`) is added to ``change[leaf % len(change)]`` (a power of two long).
    ``words``: ``held``'s whole 64-bit words, its own; its elements ``width`` bytes each.
    Returns -1, or the index of the first entry out of order or out of range (nothing from
    it on was written; a leaf whose entries were not all written still had its change added)."""
    mask = change.shape[0] - 1
    for i in range(firsts.shape[0] - 1):
        lo, hi = firsts[i], firsts[i + 1]
        if hi <= lo:
            continue
        change[(first_leaf + i) & mask] += word_changes(words, positions, values, lo, hi, width)
        after = positions[lo - 1] if lo > 0 else -1
        bad = write_patch(held, positions[lo:hi], values[lo:hi], saved[lo:hi] if saved.shape[0] else saved, after)
        if bad >= 0:
            return lo + bad
    return -1


@njit(inline="always", nogil=True, cache=True)
def _word_of(positions: Any, k: int, width: int) -> Any:  # pragma: no cover - compiled
    return (np.int64(positions[k]) * width) >> 3


@njit(nogil=True, cache=True, boundscheck=False)
def word_changes(words: Any, positions: Any, values: Any, lo: int, hi: int, width: int) -> Any:  # pragma: no cover
    """The change to the word digest's terms (new less old, mod 2**64) that writing entries
    ``lo`` to ``hi`` (one leaf's, ascending) would make, read before any is written; entries
    past the whole words (or out of range: the write refuses them) count nothing.

    A word only one entry writes, nearly every word of a sparse patch, is handled by a loop
    with no branch and no store, so its reads overlap (a loop that stores, or carries a value
    read from memory to the next entry, waits on each read in turn: measured 3-4x slower); the
    few words several entries write are handled after, one at a time."""
    whole = words.shape[0]
    lane = np.uint64(0xFFFFFFFFFFFFFFFF) if width == 8 else (np.uint64(1) << np.uint64(8 * width)) - np.uint64(1)
    total = np.uint64(0)
    previous = np.int64(-1)
    for k in range(lo, hi):
        at = np.int64(positions[k]) * width
        w = at >> 3
        following = _word_of(positions, k + 1, width) if k + 1 < hi else np.int64(-1)
        inside = (w >= 0) & (w < whole)
        before = words[w if inside else 0]
        shift = np.uint64(at & 7) * np.uint64(8)
        now = (before & ~(lane << shift)) | ((np.uint64(values[k]) & lane) << shift)
        alone = inside & (w != previous) & (w != following)
        total += (word_term(w, now) - word_term(w, before)) & (np.uint64(0) - np.uint64(alone))
        previous = w
    k = lo
    while k < hi:  # the words several entries write
        w = _word_of(positions, k, width)
        if w < 0 or w >= whole or k + 1 >= hi or _word_of(positions, k + 1, width) != w:
            k += 1
            continue
        before = words[w]
        now = before
        while k < hi and _word_of(positions, k, width) == w:
            shift = np.uint64((np.int64(positions[k]) * width) & 7) * np.uint64(8)
            now = (now & ~(lane << shift)) | ((np.uint64(values[k]) & lane) << shift)
            k += 1
        total += word_term(w, now) - word_term(w, before)
    return total


@njit(nogil=True, cache=True, boundscheck=False)
def scatter(held: Any, positions: Any, values: Any) -> None:  # pragma: no cover - compiled
    """``held[positions[k]] = values[k]`` for each ``k``: putting back values a kernel here
    overwrote, at positions it found (trusted: no check)."""
    for k in range(positions.shape[0]):
        held[positions[k]] = values[k]


@njit(nogil=True, cache=True, boundscheck=False)
def count_ranges(old: Any, new: Any, starts: Any, length: int) -> int:  # pragma: no cover - compiled
    """How many elements differ between ``old`` and ``new`` in the ranges ``[start, start +
    length)`` of ``starts`` (read only; the loop has no branch, so it vectorizes)."""
    n = 0
    for r in range(starts.shape[0]):
        start = starts[r]
        a, b = old[start : start + length], new[start : start + length]
        for i in range(length):
            n += a[i] != b[i]
    return n


@njit(nogil=True, cache=True, boundscheck=False)
def count_refresh(sample: Any, new: Any, starts: Any, length: int) -> int:  # pragma: no cover - compiled
    """:func:`count_ranges` of ``sample`` (the ranges of an older ``new``, one after the other)
    against ``new``, writing ``new``'s ranges into ``sample`` as it goes."""
    n = 0
    for r in range(starts.shape[0]):
        start = starts[r]
        held, now = sample[r * length : (r + 1) * length], new[start : start + length]
        for i in range(length):
            value = now[i]
            n += held[i] != value
            held[i] = value
    return n
