"""``JoinedPool``: several worker pools seen by a coordinator as one.

Policy workers in local processes and rollout workers inside an inference engine (the vLLM
adapter's pool), say: the joined pool numbers them one after another, in the order given, and
runs the calls for each part at the same time (a refit needs senders and receivers at once).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ckpt_core.orchestration.coordinator import CallResult, WorkerPool

Call = tuple[int, str, dict[str, Any]]


class JoinedPool:
    """Workers ``0..len(pools[0])-1`` are ``pools[0]``'s, the next ones ``pools[1]``'s, and so on."""

    def __init__(self, *pools: WorkerPool) -> None:
        self.pools = pools
        self._starts = []
        start = 0
        for pool in pools:
            self._starts.append(start)
            start += len(pool)
        self._size = start

    def __len__(self) -> int:
        return self._size

    def _locate(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self._size:
            raise IndexError(f"worker {index} is not in a joined pool of {self._size} workers")
        part = max(p for p, start in enumerate(self._starts) if start <= index and len(self.pools[p]))
        return part, index - self._starts[part]

    def call(self, calls: Sequence[Call], timeout_s: float) -> list[CallResult]:
        """Each part's calls in a thread of its own, all within ``timeout_s``; one result per
        call, in order. A part whose ``call`` raises fails each of its calls with that error."""
        by_part: dict[int, list[tuple[int, Call]]] = {}
        for position, (index, method, kwargs) in enumerate(calls):
            part, local = self._locate(index)
            by_part.setdefault(part, []).append((position, (local, method, kwargs)))
        results: list[CallResult | None] = [None] * len(calls)

        def run(part: int, entries: list[tuple[int, Call]]) -> None:
            try:
                answers = self.pools[part].call([call for _, call in entries], timeout_s)
            except Exception as exc:  # noqa: BLE001 - a part that fails fails its own calls
                answers = [
                    CallResult.failure(f"worker {calls[p][0]}", type(exc).__name__, str(exc)) for p, _ in entries
                ]
            for (position, _), answer in zip(entries, answers):
                results[position] = answer

        threads = [threading.Thread(target=run, args=item, daemon=True) for item in by_part.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        missing = [calls[p][0] for p, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"joined pool: no result for workers {missing}")
        return [r for r in results if r is not None]
