"""A rollout worker that keeps every refit's tensors, for tests that a later refit leaves
earlier ones as they were; one that keeps its last two with the host pool off, as vLLM's
workers keep an adapter; one that hands its host pool back before each refit, as a loader
that lets each batch go may; and a weights factory of small tensors only."""

from __future__ import annotations

from typing import Any

import torch

from ckpt_core.host_pool import limit_host_pool, release_host_memory
from ckpt_core.orchestration.worker import RefitWorker
from ckpt_core.orchestration.workload import digests
from ckpt_core.testing.weights import Weights

DTYPES = (torch.bfloat16, torch.float32, torch.int64, torch.bool, torch.float16, torch.uint8)


def small_weights(params: dict[str, Any], *, refit_index: int, rank: int) -> Weights:
    """``params["count"]`` small whole tensors of several dtypes and shapes (a few KiB each,
    none empty), their values set by ``params["seed"]`` and ``refit_index``."""
    generator = torch.Generator().manual_seed(1000 * int(params["seed"]) + refit_index)
    for index in range(int(params["count"])):
        dtype = DTYPES[index % len(DTYPES)]
        shape = (3 + index % 5, 17 + 7 * index) if index % 3 else (129 + index,)
        if dtype is torch.bool:
            tensor = torch.rand(shape, generator=generator) > 0.5
        elif dtype.is_floating_point:
            tensor = torch.randn(shape, generator=generator).to(dtype)
        else:
            tensor = torch.randint(0, 100, shape, generator=generator).to(dtype)
        yield f"small.{index}", tensor


class KeepingWorker(RefitWorker):
    """:class:`RefitWorker` whose rollout keeps the tensors of every refit it received."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.kept: list[dict[str, torch.Tensor]] = []

    async def _receive(self) -> dict[str, torch.Tensor]:
        received = await super()._receive()
        self.kept.append(received)
        return received

    def kept_digests(self) -> list[dict[str, str]]:
        """The digests of each kept refit's tensors, taken now."""
        return [digests(received.items()) for received in self.kept]

    def largest_kept_storage(self) -> int:
        """The bytes of the largest storage behind a kept tensor."""
        return max(t.untyped_storage().nbytes() for received in self.kept for t in received.values())


class KeepingLastTwoWorker(KeepingWorker):
    """:class:`KeepingWorker` that keeps only its last two refits, with the host pool off: as
    a vLLM worker keeps the adapter version it served before beside the one it serves, its
    pool off by default (``host_pool_bytes``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        limit_host_pool(0)

    async def _receive(self) -> dict[str, torch.Tensor]:
        received = await super()._receive()
        del self.kept[:-2]
        return received


class ReleasingWorker(RefitWorker):
    """:class:`RefitWorker` whose rollout returns its host pool to the system before each
    refit (``release_host_memory()``), once the refit before's tensors are freed."""

    async def _receive(self) -> dict[str, torch.Tensor]:
        release_host_memory()
        return await super()._receive()
