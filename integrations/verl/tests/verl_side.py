"""One verl worker in a process of its own: a checkpoint engine built the way verl builds it
(``import verl`` loads the ``verl.plugins`` entry points, then ``CheckpointEngineRegistry.new``
with verl's arguments), driven by the test as verl's ``CheckpointEngineManager`` drives it."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Generator
from typing import Any

import torch

SHAPES = [(256, 96), (96,), (512, 64), (3,), (0, 4), (2048,)]


def weights(global_steps: int, delay_s: float = 0.0) -> Generator[tuple[str, torch.Tensor], None, None]:
    """The trainer's full weights at ``global_steps`` (every trainer rank yields the same, as
    verl's collective generators do), several dtypes; ``delay_s`` before each (a slow trainer)."""
    generator = torch.Generator().manual_seed(global_steps)
    for index, shape in enumerate(SHAPES * (8 if delay_s else 1)):
        time.sleep(delay_s)
        dtype = (torch.bfloat16, torch.float32, torch.float16)[index % 3]
        yield f"model.layers.{index}.weight", torch.randn(shape, generator=generator).to(dtype)


def digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tuple(tensor.shape)}/{tensor.dtype}/{hashlib.sha256(data).hexdigest()}"


class VerlSide:
    def __init__(self, *, backend: str, role: str, bucket_size: int, engine_kwargs: dict[str, Any], rank: int) -> None:
        import verl  # noqa: F401 - loads the verl.plugins entry points, ckpt-verl's among them
        from verl.checkpoint_engine.base import CheckpointEngineRegistry

        self.role = role
        kwargs: dict[str, Any] = {"bucket_size": bucket_size, **engine_kwargs}
        if role == "trainer":  # as verl's actor worker: is_master on trainer rank 0 only
            kwargs["is_master"] = rank == 0
        self.registry = CheckpointEngineRegistry
        self.backend = backend
        self.engine = CheckpointEngineRegistry.new(backend, **kwargs)

    def prepare(self) -> dict[str, Any]:
        return self.engine.prepare()

    def build_topology(self, *, trainers: int, rollouts: int, metadata: list[dict[str, Any]]) -> list[Any]:
        """As the manager does, on the registered class."""
        trainer_kwargs, rollout_kwargs = self.registry.get(self.backend).build_topology(trainers, rollouts, metadata)
        return [trainer_kwargs, rollout_kwargs]

    def init_process_group(self, **kwargs: Any) -> float:
        start = time.perf_counter()
        self.engine.init_process_group(**kwargs)
        return time.perf_counter() - start

    def sync(self, *, global_steps: int | None, told: int | None = None, delay_s: float = 0.0) -> dict[str, Any]:
        """This side of one sync: the trainer sends ``weights(global_steps, delay_s)`` stamped
        with it; a rollout (told ``told`` by verl, default the same) reports each tensor's
        digest. An error is reported with the time it was raised (``time.monotonic()``)."""
        if self.role == "trainer":
            try:
                sent = weights(global_steps or 0, delay_s)
                metrics = asyncio.run(self.engine.send_weights(sent, global_steps=global_steps))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                return {"error": type(exc).__name__, "message": str(exc), "at": time.monotonic()}
            return {"metrics": metrics}

        async def receive() -> dict[str, str]:
            return {
                name: digest(tensor)
                async for name, tensor in self.engine.receive_weights(
                    global_steps=global_steps if told is None else told
                )
            }

        try:
            return {"received": asyncio.run(receive())}
        except Exception as exc:  # noqa: BLE001 - reported to the test
            return {"error": type(exc).__name__, "message": str(exc), "at": time.monotonic()}

    def expected(self, *, global_steps: int) -> dict[str, str]:
        return {name: digest(tensor) for name, tensor in weights(global_steps)}

    def finalize(self) -> float:
        start = time.perf_counter()
        self.engine.finalize()
        return time.perf_counter() - start
