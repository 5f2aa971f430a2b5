"""``CkptVerlEngine``: a ckpt-core engine behind verl's ``CheckpointEngine`` interface.

verl's manager drives every sync the same way: ``prepare()`` on every trainer and rollout
worker, the class's ``build_topology`` over the gathered metadata (trainer entries first),
``init_process_group(**kwargs)`` on each, ``send_weights(weights, global_steps)`` on every
trainer rank beside ``receive_weights(global_steps)`` on every rollout worker, then
``finalize()``. Each step maps onto the seed lifecycle of the ckpt-core engine this adapter
holds (created at construction, by its backend name, with the options verl's
``engine_kwargs[backend]`` holds, checked by that engine's option schema):

* ``prepare()`` returns the engine's ``prepare()`` metadata (plain JSON);
* ``build_topology`` hands every worker its role, rank, both world sizes and the whole metadata
  list (the engine's topology option says who feeds whom: by default trainer rank 0 feeds
  every rollout worker, and the other trainer ranks run their weights generator to its end, as
  verl's collective generators need);
* ``init_process_group`` is the engine's ``init_policy_process_group`` or
  ``init_rollout_process_group``;
* ``send_weights`` / ``receive_weights`` are one refit; ``receive_weights`` yields
  ``(name, tensor)`` pairs one by one (verl's ``"named_tensors"`` wire format), each a tensor the
  caller owns;
* ``finalize()`` is the engine's: the group is rebuilt at the next sync.

``global_steps`` is the weight version. A trainer given one sends it first, as a one-element
tensor named ``VERSION_NAME``; a rollout worker strips it, and where verl gave it a
``global_steps`` too, a different one is a ``WeightVersionError``: the rollout would otherwise
serve weights of another step under this step's number.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Generator
from typing import Any, ClassVar

import torch
from verl.checkpoint_engine.base import CheckpointEngine

from ckpt_core.contract import CheckpointEngine as CkptEngine
from ckpt_core.errors import BackendUnavailableError, InvalidArgumentError, LifecycleError
from ckpt_core.registry import create_checkpoint_engine, list_backends

__all__ = ["VERSION_NAME", "CkptVerlEngine", "WeightVersionError", "verl_backend_name"]

VERSION_NAME = "\x00ckpt-verl.global_steps"
"""The name under which a trainer's ``global_steps`` travels ahead of its weights."""

PREFIX = "ckpt_"


def verl_backend_name(backend: str) -> str:
    """The name verl's config selects ckpt-core backend ``backend`` by: ``"ckpt_gloo_cpu"``
    (prefixed, since verl has engines of its own under names such as ``"nccl"``)."""
    return PREFIX + backend


class WeightVersionError(InvalidArgumentError):
    """A rollout worker received weights of another ``global_steps`` than verl told it."""


class CkptVerlEngine(CheckpointEngine):
    """One ckpt-core backend (``backend``, set by the subclass :mod:`ckpt_verl.registration`
    makes for it) as a verl checkpoint engine (module docstring)."""

    backend: ClassVar[str]
    """The ckpt-core backend name this class wraps."""

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        """``bucket_size``: verl's ``update_weights_bucket_megabytes`` in bytes; ``is_master``:
        whether this is trainer rank 0 (verl passes it on the trainer side only; the engine's
        topology decides who sends); ``engine_kwargs``: the ckpt-core engine's options. An
        unknown or bad option is an ``EngineOptionError`` naming the accepted ones; a backend
        that cannot run on this machine is a ``BackendUnavailableError`` saying why."""
        infos = list_backends(details=True)
        reason = next((info.unavailable_reason for info in infos if info.name == self.backend), None)
        if reason:
            raise BackendUnavailableError(
                f"verl backend {verl_backend_name(self.backend)!r}: ckpt-core's {self.backend!r} cannot run here: "
                f"{reason}"
            )
        self.is_master = is_master
        self.engine: CkptEngine = create_checkpoint_engine(
            self.backend, bucket_size_bytes=bucket_size, engine_kwargs=dict(engine_kwargs)
        )
        self.role: str | None = None
        self._open = False  # prepared and not finalized since

    # --- verl's lifecycle ------------------------------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """The engine's metadata for this sync's group. A worker whose last sync failed before
        verl's ``finalize()`` (the manager re-raises without it) is finalized first, so the
        next sync rebuilds the group as any other."""
        if self._open:
            self.finalize()
        metadata: dict[str, Any] = self.engine.prepare()
        self._open = True
        return metadata

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Every trainer and rollout worker's ``init_process_group`` arguments, one list entry
        per worker of each group: its role and rank, both world sizes and all the metadata."""
        expected = actor_wg_world_size + rollout_world_size
        if len(metadata) != expected:
            raise InvalidArgumentError(
                f"{cls.__name__}.build_topology: {len(metadata)} metadata entries for {actor_wg_world_size} "
                f"trainer and {rollout_world_size} rollout workers ({expected} expected, trainer entries first)"
            )
        metadata = list(metadata)

        def group(role: str, size: int) -> dict[str, list[Any]]:
            return {
                "role": [role] * size,
                "rank": list(range(size)),
                "train_world_size": [actor_wg_world_size] * size,
                "rollout_world_size": [rollout_world_size] * size,
                "metadata": [metadata] * size,
            }

        return group("trainer", actor_wg_world_size), group("rollout", rollout_world_size)

    def init_process_group(
        self, *, role: str, rank: int, train_world_size: int, rollout_world_size: int, metadata: list[Any]
    ) -> None:
        sizes: dict[str, Any] = {
            "train_world_size": train_world_size,
            "rollout_world_size": rollout_world_size,
            "metadata": metadata,
        }
        if role == "trainer":
            self.engine.init_policy_process_group(worker_rank=rank, **sizes)
        elif role == "rollout":
            self.engine.init_rollout_process_group(rollout_rank=rank, **sizes)
        else:
            raise InvalidArgumentError(f"{type(self).__name__}.init_process_group: role must be 'trainer' or 'rollout'")
        self.role = role

    def finalize(self) -> None:
        self.role = None
        self._open = False
        self.engine.finalize()

    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> dict[str, Any]:
        """One refit of ``weights`` (every trainer rank runs its generator to the end); returns
        the refit's statistics as verl's sync metrics."""
        self._require("trainer", "send_weights")
        await self.engine.send_weights(_versioned(weights, global_steps))
        stats = getattr(self.engine, "last_stats", None)
        return {f"ckpt/{key}": value for key, value in stats.to_dict().items()} if stats is not None else {}

    async def receive_weights(self, global_steps: int | None = None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """The refit's ``(name, tensor)`` pairs, in the trainer's order, the version stripped
        (and checked against ``global_steps`` where both are known)."""
        self._require("rollout", "receive_weights")
        first = True
        async for batch in self.engine.receive_weight_batches():
            for name, tensor in batch:
                if first:
                    first = False
                    if name == VERSION_NAME:
                        _check_version(int(tensor.item()), global_steps)
                        continue
                yield name, tensor
                await asyncio.sleep(0)  # the adapter's loop keeps serving between tensors

    def _require(self, role: str, call: str) -> None:
        if self.role != role:
            raise LifecycleError(
                f"{type(self).__name__}.{call}() needs a worker initialized as {role} (init_process_group with "
                f"role={role!r}), but it is {self.role or 'not initialized'}"
            )


def _versioned(
    weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None
) -> Generator[tuple[str, torch.Tensor], None, None]:
    if global_steps is not None:
        yield VERSION_NAME, torch.tensor([int(global_steps)], dtype=torch.int64)
    yield from weights


def _check_version(sent: int, expected: int | None) -> None:
    if expected is not None and sent != int(expected):
        raise WeightVersionError(
            f"received the weights of global_steps={sent}, but verl asked this rollout for global_steps={expected}: "
            "the trainer and the rollout disagree on the step they sync"
        )
