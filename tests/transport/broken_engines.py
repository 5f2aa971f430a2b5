"""Deliberately broken engines: each breaks one rule of the contract, so a test can show that
the conformance kit catches it (tests/transport/test_conformance_kit.py).

They subclass the real gloo_cpu engine and are selected as ``"tests.transport.broken_engines:ClassName"``;
worker processes import this module through ``PYTHONPATH``. Test tooling only: nothing in
``ckpt_core`` or the plugins imports it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Generator
from typing import Any

import torch

from ckpt_gloo_cpu.engine import GlooCpuCheckpointEngine

Batch = list[tuple[str, torch.Tensor]]


class DropsEmptyTensors(GlooCpuCheckpointEngine):
    """Rollouts silently drop zero-element tensors."""

    async def receive_weight_batches(self, *, owned: bool = False) -> AsyncGenerator[Batch, None]:
        async for batch in super().receive_weight_batches(owned=owned):
            yield [(name, tensor) for name, tensor in batch if tensor.numel()]


class ReordersBatches(GlooCpuCheckpointEngine):
    """Rollouts yield a refit's batches last to first: every tensor arrives, out of order."""

    async def receive_weight_batches(self, *, owned: bool = False) -> AsyncGenerator[Batch, None]:
        batches = [batch async for batch in super().receive_weight_batches(owned=owned)]
        for batch in reversed(batches):
            yield batch


class SkipsDrain(GlooCpuCheckpointEngine):
    """A policy rank with no receiver returns without running its weights generator."""

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None]) -> None:
        if self._sender is None and self._life.phase.name == "POLICY":
            return
        await super().send_weights(weights)


class NonJsonMetadata(GlooCpuCheckpointEngine):
    """``prepare()`` metadata holds a tuple, which a JSON round trip turns into a list."""

    def _prepare_transport(self) -> dict[str, Any]:
        return {**super()._prepare_transport(), "port_range": (0, 65535)}


class NoLifecycleChecks(GlooCpuCheckpointEngine):
    """Skips the state machine: out-of-order calls run (or fail obscurely) instead of raising
    ``LifecycleError``."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._life.require = lambda phase, call: None  # type: ignore[method-assign]


class HangsOutOfOrder(GlooCpuCheckpointEngine):
    """An out-of-order call blocks (as if waiting for a peer) instead of raising."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        life = self._life

        def require(phase: Any, call: str) -> None:
            if life.phase is not phase:
                time.sleep(3600)

        life.require = require  # type: ignore[method-assign]
