"""Test helpers for the cuda_ipc tests: worker pools made of subsets, /proc probes, and a
worker service that also reports CUDA memory.

This folder is on ``sys.path`` for the test modules (pytest's rootdir-relative import) and is
put on ``PYTHONPATH`` for worker processes that host :class:`CudaProbeWorker`.
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt_core.chunking import tensor_bytes
from ckpt_core.orchestration.coordinator import CallResult, RefitCoordinator
from ckpt_core.orchestration.local import LocalProcessPool
from ckpt_core.orchestration.worker import RefitWorker
from ckpt_core.testing.weights import every_dtype

HERE = Path(__file__).resolve().parent
SLOT_FILE = "memfd:ckpt-cuda-ipc-slots"


class Subset:
    """Some workers of a pool, in a given order, as a ``WorkerPool`` of their own: one set of
    processes serves 1->1, 1->2 and 2->2 coordinators (worker start-up dominates test time)."""

    def __init__(self, pool: LocalProcessPool, indices: list[int]) -> None:
        self.pool = pool
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def call(self, calls: Sequence[tuple[int, str, dict[str, Any]]], timeout_s: float) -> list[CallResult]:
        return self.pool.call([(self.indices[i], method, kwargs) for i, method, kwargs in calls], timeout_s)


def coordinator_for(
    pool: LocalProcessPool, policy: list[int], rollout: list[int], timeout_s: float
) -> RefitCoordinator:
    """A coordinator over the given workers of ``pool`` (policy ranks first, by rank)."""
    return RefitCoordinator(
        Subset(pool, policy + rollout), num_policy=len(policy), num_rollout=len(rollout), timeout_s=timeout_s
    )


def descriptors(pid: int) -> list[str]:
    """What each open descriptor of process ``pid`` refers to."""
    targets = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return targets


def slot_mappings(pid: int) -> list[str]:
    """Lines of ``/proc/<pid>/maps`` that map the slot file or anything in /dev/shm."""
    with open(f"/proc/{pid}/maps") as maps:
        return [line for line in maps if SLOT_FILE in line or "/dev/shm/" in line]


def transport_descriptors(pid: int) -> list[str]:
    """Sockets and memfds: a worker holds none of either outside an initialized engine (the
    local launcher talks to it over pipes)."""
    return [t for t in descriptors(pid) if t.startswith("socket:") or t.startswith("/memfd:")]


def env_with_helpers() -> dict[str, str]:
    """This process's environment with this folder on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


class CudaProbeWorker(RefitWorker):
    """A ``RefitWorker`` that can also report its CUDA memory, and keep a borrowed tensor past
    ``finalize()`` (engines with ``borrow_received_tensors``)."""

    _kept: torch.Tensor | None = None

    def cuda_memory(self) -> dict[str, int]:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return {
            "device_free": int(free),
            "device_total": int(total),
            "reserved": int(torch.cuda.memory_reserved()),
            "allocated": int(torch.cuda.memory_allocated()),
        }


def every_dtype_on_gpu(params: dict[str, Any], *, refit_index: int, rank: int) -> Any:
    """``ckpt_core.testing.weights.every_dtype``, with every tensor on the current CUDA device."""
    for name, tensor in every_dtype(params, refit_index=refit_index, rank=rank):
        # Move bytes, not values: exotic dtypes (bits8, uint3, ...) have no CUDA copy kernels.
        yield name, tensor_bytes(tensor).to("cuda").view(tensor.dtype).reshape(tensor.shape)

    def receive_keeping_a_borrowed_tensor(self) -> dict[str, Any]:
        """This rollout's side of one refit, keeping the last tensor the engine lent out of its
        slots (a loader that wrongly holds on to one); how many tensors arrived."""
        engine = self.engine

        async def receive() -> int:
            count = 0
            async for batch in engine.receive_weight_batches():
                for _, tensor in batch:
                    count += 1
                    if engine.lends(tensor):  # type: ignore[attr-defined]  # a BucketedEngine
                        self._kept = tensor
            return count

        count = asyncio.run(receive())
        if self._kept is None:
            raise AssertionError("no received tensor was a view of the slots: is borrow_received_tensors on?")
        return {"tensors": count}

    def finalize_then_read_the_kept_tensor(self) -> dict[str, Any]:
        """``finalize()`` while the kept borrowed tensor is alive, read it, then drop it: what
        the slots' mapping did at each step, and whether CUDA still works in this process."""
        assert self._kept is not None
        slots = self.engine._receiver.slots  # type: ignore[attr-defined]  # the CudaSlots it maps
        before = int(tensor_bytes(self._kept).sum(dtype=torch.int64))
        self.engine.finalize()
        mapped_after_finalize = bool(slots.mapped)
        after = int(tensor_bytes(self._kept).sum(dtype=torch.int64))  # an illegal address if unmapped
        torch.cuda.synchronize()
        self._kept = None
        gc.collect()
        mapped_after_drop = bool(slots.mapped)
        healthy = int(torch.arange(1000, device="cuda").sum())
        return {
            "sum_before": before,
            "sum_after": after,
            "mapped_after_finalize": mapped_after_finalize,
            "mapped_after_drop": mapped_after_drop,
            "healthy": healthy == 999 * 1000 // 2,
        }
