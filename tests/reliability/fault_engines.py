"""Fault-injecting engines, selected as ``"tests.reliability.fault_engines:ClassName"`` backends in tests.

Test tooling only: this module lives under ``tests/reliability`` and reaches worker processes
through ``PYTHONPATH``; nothing in ``ckpt_core`` or a plugin imports it. Each class is the real
``gloo_cpu`` engine with one deliberate defect, and keeps ``backend_name = "gloo_cpu"`` so it
interoperates with plain ``gloo_cpu`` peers.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

import torch

from ckpt_core._internal.wire import decode_header
from ckpt_core.errors import EngineOptionError
from ckpt_core.transport import BucketReceiver, Option
from ckpt_gloo_cpu.engine import GlooCpuCheckpointEngine


class _CorruptingReceiver(BucketReceiver):
    """Flips one bit in the middle of bucket ``bucket_index``'s bytes once they have arrived
    (after ``wait_payload``, before the pipeline verifies them), in every refit: in the packed
    payload, or in its first direct chunk when it has no packed bytes."""

    def __init__(self, inner: BucketReceiver, bucket_size: int, bucket_index: int) -> None:
        self.inner = inner
        self.num_slots = inner.num_slots
        self.direct_chunks = inner.direct_chunks
        self.payload_ready_with_header = inner.payload_ready_with_header
        self.bucket_size = bucket_size
        self.bucket_index = bucket_index
        self._posted: dict[int, tuple[int, torch.Tensor | None]] = {}  # slot -> (bucket, bytes to corrupt)
        self._last_bucket = -1
        self.flipped = 0

    def buffer(self, slot: int) -> torch.Tensor:
        return self.inner.buffer(slot)

    def recv_header(self, timeout_s: float) -> bytes:
        raw = self.inner.recv_header(timeout_s)
        self._last_bucket = decode_header(raw, bucket_size=self.bucket_size).bucket_index
        return raw

    def expect_header(self) -> None:
        self.inner.expect_header()

    def expect_refit(self) -> None:
        self.inner.expect_refit()

    def post_payload(self, slot: int, nbytes: int, timeout_s: float, direct: Sequence[torch.Tensor] = ()) -> None:
        target = self.inner.buffer(slot)[:nbytes] if nbytes else (direct[0] if direct else None)
        self._posted[slot] = (self._last_bucket, target)
        self.inner.post_payload(slot, nbytes, timeout_s, direct)

    def wait_payload(self, slot: int, timeout_s: float) -> None:
        self.inner.wait_payload(slot, timeout_s)
        bucket, target = self._posted.pop(slot, (-1, None))
        if bucket == self.bucket_index and target is not None:
            target[target.numel() // 2] ^= 0x01
            self.flipped += 1

    def release(self, slot: int) -> None:
        self.inner.release(slot)

    def hand_over(self, slot: int, nbytes: int) -> bool:
        return self.inner.hand_over(slot, nbytes)

    def close(self) -> None:
        self.inner.close()


def _bucket_index(option: Option, owner: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EngineOptionError(f"{owner}: {option.name} must be an int >= 0, got {value!r}")
    return value


class CorruptingGlooEngine(GlooCpuCheckpointEngine):
    """gloo_cpu whose rollout side corrupts one bit of bucket ``corrupt_bucket`` (default 1)
    in flight, as a bad NIC, DMA engine or memory would."""

    options = GlooCpuCheckpointEngine.options.extend(
        Option.custom(
            "corrupt_bucket",
            1,
            "the bucket index whose bytes are corrupted on receipt",
            parse=_bucket_index,
            kind="int >= 0",
        )
    )

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.corrupt_bucket: int = self.option_values.corrupt_bucket

    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        inner = super()._connect_rollout(rollout_rank, train_world_size, rollout_world_size, metadata)
        return _CorruptingReceiver(inner, self.bucket_size, self.corrupt_bucket)


class TruncatingGlooEngine(GlooCpuCheckpointEngine):
    """gloo_cpu whose rollout side silently drops the last batch of every refit and reports
    the refit as finished: a buggy receiver the coordinator must not trust."""

    async def receive_weight_batches(
        self, *, owned: bool = False
    ) -> AsyncGenerator[list[tuple[str, torch.Tensor]], None]:
        previous = None
        async for batch in super().receive_weight_batches(owned=owned):
            if previous is not None:
                yield previous
            previous = batch
