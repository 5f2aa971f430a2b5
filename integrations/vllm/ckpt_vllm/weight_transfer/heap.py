"""Keeping a vLLM worker's heap near what a refit needs: vLLM's reload frees much of what it
allocates, and glibc keeps freed chunks mapped; :class:`HeapGuard` hands them back only past
a budget. Resident memory is read with :mod:`ckpt_core.rss`."""

from __future__ import annotations

import ctypes

from ckpt_core.rss import rss_bytes


def release_free_heap() -> bool:
    """Hand freed heap memory back to the kernel (glibc's ``malloc_trim``); False elsewhere.

    A refit allocates and frees a model's worth of tensors (vLLM's layerwise reload
    materializes each layer anew) and glibc keeps freed chunks mapped. Handing them back costs
    the page faults of mapping them again at their next use, so :class:`HeapGuard` does it
    only past a budget."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    return bool(libc.malloc_trim(0))


GROWTH_ALLOWANCE_BYTES = 64 << 20
"""What a refit may grow a worker's RSS by beyond its two buckets before :class:`HeapGuard` trims."""


class HeapGuard:
    """Keeps a refit's RSS growth near ``budget_bytes`` over the RSS it started from.

    vLLM's reload materializes each layer anew and frees it; glibc keeps much of that freed
    memory mapped, so over a refit the heap grows by a few layers' worth. ``check()``, called
    between batches, hands the free part back (``malloc_trim``) only once the growth passes the
    budget: trimming costs page faults when the memory is used again, so a refit that stays
    within its budget pays nothing.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.start = rss_bytes()
        self.trims = 0

    def check(self) -> None:
        now = rss_bytes()
        if self.start is not None and now is not None and now - self.start > self.budget_bytes:
            if release_free_heap():
                self.trims += 1
                # What is left is in use (a large layer vLLM holds, say): trim again only
                # once the refit grows by another budget's worth.
                after = rss_bytes()
                if after is not None:
                    self.start = max(self.start, after - self.budget_bytes)
