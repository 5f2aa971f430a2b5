"""Worker services of the conformance kit (``"ckpt_core.testing.services:ProbeWorker"``).

:class:`ProbeWorker` is a :class:`ckpt_core.orchestration.worker.RefitWorker` whose policy side watches the
weights generator it hands to ``send_weights``: how many items the engine pulled, and whether
it ran the generator to its end before ``send_weights`` returned. The seed contract needs both:
a policy rank's generator may run collectives with the other ranks (gathering shards), so
every rank, including one with no receiver, must drain it exactly once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Generator, Iterable
from typing import Any

import torch

from ckpt_core.orchestration.worker import RefitWorker
from ckpt_core.orchestration.workload import digests, load_target
from ckpt_core.rss import lifetime_peak_rss_bytes


@dataclasses.dataclass
class Consumption:
    """What an engine did with one weights generator."""

    pulled: int = 0
    exhausted: bool = False

    def watch(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Generator[tuple[str, torch.Tensor], None, None]:
        """A generator over ``weights`` that counts each item pulled and notes exhaustion."""
        for item in weights:
            self.pulled += 1
            yield item
        self.exhausted = True


class ProbeWorker(RefitWorker):
    """A ``RefitWorker`` whose policy refits also report ``"consumption"``.

    ``"consumption"`` is ``{"pulled": int, "exhausted": bool, "expected": int}``, taken the
    moment ``send_weights`` returned; ``expected`` is the number of tensors the factory yields.
    Rollout refits are the plain ``RefitWorker``'s.
    """

    def refit(
        self, *, refit_index: int, weights: str | None = None, weights_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        if self.role != "policy":
            return super().refit(refit_index=refit_index)
        factory = load_target(weights) if weights else self.weights
        params = self.weights_params if weights_params is None else weights_params
        if factory is None:
            raise ValueError("a policy worker needs a weights factory ('module:function')")
        consumption = Consumption()
        start = time.perf_counter()
        source = consumption.watch(factory(params, refit_index=refit_index, rank=self.rank))
        self._send_refit(source)
        wall = time.perf_counter() - start
        seen = dataclasses.replace(consumption)  # what the engine had done when it returned
        expected = digests(factory(params, refit_index=refit_index, rank=self.rank))
        stats = getattr(self.engine, "last_stats", None)
        return {
            "role": self.role,
            "rank": self.rank,
            "wall_seconds": wall,
            "stats": stats.to_dict() if stats is not None else None,
            "tensors": len(expected),
            "digests": expected,
            "lifetime_peak_rss_bytes": lifetime_peak_rss_bytes(),
            "consumption": {"pulled": seen.pulled, "exhausted": seen.exhausted, "expected": len(expected)},
        }

    def _send_refit(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        asyncio.run(self.engine.send_weights(weights))


class BlockingProbeWorker(ProbeWorker):
    """A ``ProbeWorker`` that drives its engine through the calls for callers that block:
    ``send_weights_blocking`` on a policy rank, ``receive_weight_batches_blocking`` on a
    rollout rank, which digests each batch as it arrives (a borrowed batch is valid only
    until the next). No event loop runs in its process's calling thread."""

    def refit(
        self, *, refit_index: int, weights: str | None = None, weights_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        if self.role == "policy":
            return super().refit(refit_index=refit_index, weights=weights, weights_params=weights_params)
        self._uncommitted = None
        start = time.perf_counter()
        seen: dict[str, str] = {}
        for batch in self.engine.receive_weight_batches_blocking():
            self._take_batch(batch, seen)
        wall = time.perf_counter() - start
        return self._refitted(refit_index, wall, seen if self.verify else {}, len(seen), {})

    def _send_refit(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        self.engine.send_weights_blocking(weights)
