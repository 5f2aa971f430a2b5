"""What it takes to run verl's own ``CheckpointEngineManager`` and ``CheckpointEngineWorker``
without a GPU: the tests drive them with these.

verl's manager syncs an actor worker group into rollout replicas. Of the actor worker it uses
two registered methods, ``update_weights(global_steps, mode)`` and
``execute_checkpoint_engine(method, ...)``; of a replica, its ``workers`` (actors of verl's
``CheckpointEngineWorker``, each handing what it received to its server adapter) and four calls
that pause generation around the sync. verl's own actor workers train a model on GPUs and its
replicas launch inference servers, so this module gives the same parts over plain weights:

* :class:`WeightsTrainer`: a verl ``Worker`` (run it in verl's ``RayWorkerGroup``) whose
  checkpoint engine is built as verl's actor worker builds it, sending seeded weights or a
  checkpoint per step;
* :class:`RecordingAdapter`: a server adapter that records the digest of every tensor a sync
  delivered, one JSON file per replica and step;
* :class:`StandInReplica`: the part of verl's ``RolloutReplica`` the manager calls (it counts
  the calls).

A real server adapter (:class:`ckpt_verl.vllm_adapter.CkptVllmServerAdapter`) takes the
recording one's place where weights must land in vLLM.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Generator, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs
from verl.workers.rollout.base import BaseRollout

__all__ = [
    "RecordingAdapter",
    "StandInReplica",
    "WeightsTrainer",
    "checkpoint_weights",
    "digest",
    "recorded",
    "seeded_weights",
]

SHAPES = [(256, 96), (96,), (512, 64), (3,), (0, 4), (2048,)]

HOLD_S = 120.0
"""How long a held sync waits for :meth:`WeightsTrainer.release_hold` before it fails."""


def seeded_weights(global_steps: int, *, tensors: int = len(SHAPES)) -> Generator[tuple[str, torch.Tensor], None, None]:
    """A trainer's full weights at ``global_steps`` (the same on every trainer rank, as verl's
    collective generators yield them): ``tensors`` of them, in ``SHAPES`` over and over and in
    bf16, fp32 and fp16 in turn."""
    generator = torch.Generator().manual_seed(global_steps)
    for index in range(tensors):
        shape = SHAPES[index % len(SHAPES)]
        dtype = (torch.bfloat16, torch.float32, torch.float16)[index % 3]
        yield f"model.layers.{index}.weight", torch.randn(shape, generator=generator).to(dtype)


def checkpoint_weights(path: str | Path) -> Generator[tuple[str, torch.Tensor], None, None]:
    """The tensors of the safetensors files in the directory ``path`` (a saved Hugging Face
    model), file by file in name order, each file's in its own order."""
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {path}")
    for file in files:
        with safe_open(str(file), framework="pt") as opened:
            for name in opened.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, opened.get_tensor(name)


def digest(tensor: torch.Tensor) -> str:
    """Shape, dtype and a hash of the bytes: equal digests are bit-for-bit equal tensors."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return f"{tuple(tensor.shape)}/{tensor.dtype}/{hashlib.sha256(data).hexdigest()}"


class WeightsTrainer(Worker):
    """The checkpoint-engine part of verl's actor worker (``verl.workers.engine_workers``), over
    plain weights: at step ``k`` it sends ``checkpoints[k - 1]`` (:func:`checkpoint_weights`) if
    given, else :func:`seeded_weights` ``(k, tensors=tensors)``. ``config`` is verl's
    ``CheckpointEngineConfig``; the engine is built from it as verl builds it
    (``custom_backend_module`` imported, ``is_master`` on rank 0).

    A test that must act at a known point of a sync (kill a worker mid-send) sets
    ``hold_after`` (:meth:`set_pace`): the sync's weights stop there, after that many were
    taken, until :meth:`release_hold` (or ``HOLD_S``, then the sync fails), and
    :meth:`last_outcome` says ``held``."""

    def __init__(self, config: Any, checkpoints: list[str] | None = None, tensors: int = len(SHAPES)) -> None:
        super().__init__()
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            config.backend,
            bucket_size=config.update_weights_bucket_megabytes << 20,
            is_master=self.rank == 0,
            **config.engine_kwargs.get(config.backend, {}),
        )
        self.checkpoints = checkpoints
        self.tensors = tensors
        self.hold_after: int | None = None
        self.held = False  # this sync's weights are stopped at hold_after
        self.released = threading.Event()
        self.outcome: dict[str, Any] = {}

    def weights(self, global_steps: int) -> Iterable[tuple[str, torch.Tensor]]:
        if self.checkpoints is not None:
            weights: Iterable[tuple[str, torch.Tensor]] = checkpoint_weights(self.checkpoints[global_steps - 1])
        else:
            weights = seeded_weights(global_steps, tensors=self.tensors)
        return weights if self.hold_after is None else self._holding(iter(weights), self.hold_after)

    def _holding(
        self, weights: Iterator[tuple[str, torch.Tensor]], after: int
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        """``weights``, stopped after ``after`` of them until the hold is released."""
        for index, item in enumerate(weights):
            if index == after:
                self.held = True
                if not self.released.wait(HOLD_S):
                    raise TimeoutError(f"the sync was held after {after} weights and not released within {HOLD_S:g}s")
            yield item

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        """As verl's actor worker in disaggregated mode: send this step's weights; the engine's
        per-sync metrics are the result. How it ended is kept for :meth:`last_outcome`."""
        self.outcome = {"global_steps": global_steps}
        self.held = False
        self.released.clear()
        try:
            metrics = await self.checkpoint_engine.send_weights(
                self.weights(global_steps or 0), global_steps=global_steps
            )
        except Exception as exc:
            self.outcome.update(error=type(exc).__name__, message=str(exc), at=time.monotonic())
            raise
        self.outcome["at"] = time.monotonic()
        return metrics or {}

    def last_outcome(self) -> dict[str, Any]:
        """The last sync's step, its error's class name and message if it failed, and when it
        ended (``time.monotonic()``, comparable across processes of one machine); ``{}``
        before the first sync, and only the step while one runs. Call it on the actor (verl's
        manager returns at the first failed worker; the others end in their own time), with
        ``held`` while its weights are held (see the class docstring)."""
        return {**self.outcome, "held": self.held}

    def release_hold(self) -> None:
        """Let the held sync's weights go on."""
        self.released.set()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_pace(self, tensors: int = len(SHAPES), hold_after: int | None = None) -> None:
        """The seeded weights' count and where a sync holds (``None``: nowhere), from the next
        sync on."""
        self.tensors = tensors
        self.hold_after = hold_after

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class RecordingAdapter(BaseRollout):
    """A server adapter that records each sync it is handed: ``{name: digest}`` in
    ``directory/replica<replica_rank>-step<global_steps>.json`` (:func:`recorded` reads it), or
    ``{"error": ...}`` there if the receive failed (the error is raised on, as a real adapter's)."""

    def __init__(self, directory: str | Path, replica_rank: int = 0) -> None:  # no config: it serves nothing
        self.directory = Path(directory)
        self.replica_rank = replica_rank
        self.is_leader_rank = True

    async def update_weights(
        self,
        weights: AsyncIterator[tuple[str, torch.Tensor]],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        **kwargs: Any,
    ) -> None:
        received: dict[str, Any] = {}
        try:
            async for name, tensor in weights:
                received[name] = digest(tensor)
        except Exception as exc:
            received = {"error": type(exc).__name__, "message": str(exc), "at": time.monotonic()}
            raise
        finally:
            # Written whole, then renamed: a test polling for the record never reads half of it.
            path = self.directory / f"replica{self.replica_rank}-step{global_steps}.json"
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(received))
            os.replace(partial, path)

    async def resume(self, tags: list[str]) -> None:
        """Nothing is released, so nothing to resume."""

    async def release(self) -> None:
        """Nothing is held."""


def recorded(directory: str | Path, replica_rank: int, global_steps: int) -> dict[str, Any]:
    """What :class:`RecordingAdapter` recorded for this replica and step."""
    path = Path(directory) / f"replica{replica_rank}-step{global_steps}.json"
    return json.loads(path.read_text())  # type: ignore[no-any-return]


class StandInReplica:
    """What verl's ``CheckpointEngineManager.update_weights`` uses of a ``RolloutReplica``:
    ``workers`` (its ``CheckpointEngineWorker`` actors) and the calls that stop and restart
    generation around a sync, each counted in ``calls`` (the replica serves nothing)."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.calls: dict[str, int] = {}

    async def _count(self, call: str) -> None:
        self.calls[call] = self.calls.get(call, 0) + 1
        await asyncio.sleep(0)

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        await self._count("abort_all_requests")

    async def release_kv_cache(self) -> None:
        await self._count("release_kv_cache")

    async def resume_kv_cache(self) -> None:
        await self._count("resume_kv_cache")

    async def resume_generation(self) -> None:
        await self._count("resume_generation")
