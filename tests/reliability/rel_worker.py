"""``ReliabilityWorker``: a ``RefitWorker`` that a test can re-purpose, and that leaves a trail.

One process can serve as a gloo_cpu policy rank in one test and as a cuda_ipc rollout rank in
the next (:meth:`ReliabilityWorker.configure`), because starting a Python process with torch
costs several CPU-seconds on the CI machine. A rollout also appends the digest of every tensor
it is handed to ``trail_path`` the moment it is yielded, so a test can check, after a refit
failed, that whatever was yielded before the failure was whole and bit-exact.

Test tooling: lives under ``tests/reliability`` and reaches workers through ``PYTHONPATH``.
"""

from __future__ import annotations

import gc
import os
from typing import Any

import torch

from ckpt_core.orchestration.worker import RefitWorker
from ckpt_core.orchestration.workload import load_target, tensor_digest
from ckpt_core.stats import Role


class ReliabilityWorker(RefitWorker):
    """Starts as an idle gloo_cpu rollout; :meth:`configure` gives it its real part."""

    def __init__(self, **kwargs: Any) -> None:
        defaults: dict[str, Any] = {"role": "rollout", "rank": 0, "backend": "gloo_cpu", "bucket_size": 4096}
        super().__init__(**{**defaults, **kwargs})
        self.trail_path: str | None = None

    def configure(
        self,
        *,
        role: Role,
        rank: int,
        backend: str,
        bucket_size: int,
        engine_kwargs: dict[str, Any] | None = None,
        weights: str | None = None,
        weights_params: dict[str, Any] | None = None,
        verify: bool = True,
        trail_path: str | None = None,
    ) -> int:
        """Drop the current engine (finalizing it) and build a new one; returns this pid.

        Collects garbage after finalizing, so that what an earlier test's failed refit left
        for the cyclic collector (see ``test_rel_faults``) does not show up in the next test's
        descriptor counts."""
        try:
            self.engine.finalize()
            gc.collect()
        finally:
            self.role, self.rank, self.backend, self.bucket_size = role, rank, backend, bucket_size
            self.engine_kwargs = dict(engine_kwargs or {})
            self.weights = load_target(weights) if weights else None
            self.weights_params = dict(weights_params or {})
            self.verify = verify
            self.trail_path = trail_path
            self.engine = self._new_engine()
        return os.getpid()

    async def _receive(self) -> dict[str, torch.Tensor]:
        if self.trail_path is None:
            return await super()._receive()
        received: dict[str, torch.Tensor] = {}
        with open(self.trail_path, "a") as trail:
            async for batch in self.engine.receive_weight_batches():
                for name, tensor in batch:
                    trail.write(f"{name} {tensor_digest(tensor)}\n")
                    trail.flush()
                    received[name] = tensor
        return received

    def socket_count(self) -> int:
        """Open socket descriptors of this process (the launcher's own channel is pipes)."""
        return sum(1 for fd in os.listdir("/proc/self/fd") if _is_socket(fd))

    def listening_sockets(self) -> list[str]:
        """``address:port`` of every TCP socket this process is listening on (IPv4 and IPv6)."""
        from tests.reliability.rel_net import listening_sockets

        return listening_sockets(os.getpid())


def _is_socket(fd: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:
        return False
