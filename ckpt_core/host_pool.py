"""Host memory the library keeps between refits, for callers that want it back.

Received host tensors of 64 KiB and up live in mappings that, once freed, wait in a per-process
pool for the next tensor of their size (see ``docs/benchmarks.md``): a refit then reuses memory
that is already faulted in, at the price of keeping that memory resident between refits. (The
shared storages behind small tensors have a pool of their own, at most 64 MiB, which
:func:`limit_host_pool` leaves as it is and :func:`release_host_memory` empties too.) A loader
that copies each batch into a model and lets it go (an inference engine's) can hand the pool
back after each refit, or turn the pool off; ``finalize()`` of an engine built with
``release_after_refit=True`` also empties it. A Gloo receiver that hands a slot's memory over
with the small tensors it holds rotates the slot among blocks of its own, outside this pool:
neither function touches them; they go when the engine is finalized and no tensor holds them.
"""

from __future__ import annotations

from ckpt_core._internal.host_alloc import pooled_bytes, release_host_pool, set_host_pool_limit
from ckpt_core.errors import InvalidArgumentError


def pooled_host_bytes() -> int:
    """Bytes of freed received-tensor memory the pool keeps now."""
    return pooled_bytes()


def release_host_memory() -> int:
    """Return the pool's memory to the system; the bytes it held."""
    held = pooled_bytes()
    release_host_pool()
    return held


def limit_host_pool(nbytes: int) -> None:
    """Let the pool of large tensors keep at most ``nbytes`` from now on (0: none, their freed
    memory goes straight back to the system); the process-wide default is
    ``CKPT_CORE_HOST_POOL_BYTES`` (1 GiB)."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise InvalidArgumentError(f"limit_host_pool() takes a number of bytes >= 0, got {nbytes!r}")
    set_host_pool_limit(nbytes)
