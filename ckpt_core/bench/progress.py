"""A live progress line for refits, as a hook plugin (the CLI registers it in one receiver)."""

from __future__ import annotations

import sys
import time

from ckpt_core.hookspecs import hookimpl
from ckpt_core.stats import RefitContext, RefitStats


class ProgressBar:
    """Writes bytes moved and the running rate to stderr, one line per refit, redrawn in place."""

    def __init__(self) -> None:
        self._bytes = 0
        self._start = time.perf_counter()

    @hookimpl
    def ckpt_core_refit_started(self, context: RefitContext) -> None:
        self._bytes = 0
        self._start = time.perf_counter()

    @hookimpl
    def ckpt_core_bucket_received(self, context: RefitContext, bucket_index: int, nbytes: int, num_chunks: int) -> None:
        self._bytes += nbytes
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        sys.stderr.write(
            f"\r  refit {context.refit_index}: {self._bytes / 2**20:10.1f} MiB received "
            f"({self._bytes / elapsed / 1e9:5.2f} GB/s, bucket {bucket_index})"
        )
        sys.stderr.flush()

    @hookimpl
    def ckpt_core_refit_finished(self, context: RefitContext, stats: RefitStats) -> None:
        sys.stderr.write(
            f"\r  refit {context.refit_index}: {stats.payload_bytes / 2**20:10.1f} MiB received "
            f"in {stats.seconds:.2f} s ({stats.gbps:.2f} GB/s){' ' * 12}\n"
        )
        sys.stderr.flush()
