"""A ``RefitWorker`` that also reports the CPU time its process spent inside each transfer.

``time.process_time`` counts every thread of the process (Gloo's included) and excludes the
digests the worker computes for verification afterwards, so the figure is the transfer's own
cost, whatever share of the CPU the scheduler gave it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch

from ckpt_core.contract import CheckpointEngine
from ckpt_core.orchestration.worker import RefitWorker


class _TimedEngine:
    """Delegates to an engine, adding up the CPU seconds of its transfers."""

    def __init__(self, engine: CheckpointEngine) -> None:
        self._engine = engine
        self.cpu_seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        start = time.process_time()
        try:
            await self._engine.send_weights(weights)
        finally:
            self.cpu_seconds = time.process_time() - start

    async def receive_weight_batches(self) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        start = time.process_time()
        try:
            async for batch in self._engine.receive_weight_batches():
                yield batch
        finally:
            self.cpu_seconds = time.process_time() - start


class CpuTimedWorker(RefitWorker):
    def _new_engine(self) -> Any:
        return _TimedEngine(super()._new_engine())

    def refit(self, **kwargs: Any) -> dict[str, Any]:
        result = super().refit(**kwargs)
        result["transfer_cpu_seconds"] = self.engine.cpu_seconds  # type: ignore[attr-defined]
        return result
