"""``RefitWorker``: one policy or rollout worker hosting an engine, driven by a coordinator.

Every method takes and returns JSON-compatible data, so the same object serves a local
subprocess (:mod:`ckpt_core.orchestration.local`) and a Ray actor (:mod:`ckpt_core.orchestration.ray`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch

from ckpt_core.contract import CheckpointEngine
from ckpt_core.errors import LifecycleError
from ckpt_core.orchestration.workload import WeightsFactory, digests, load_target, tensor_digest
from ckpt_core.refit.layout import WeightLayout, is_ckpt_layout, select_weights
from ckpt_core.registry import create_checkpoint_engine
from ckpt_core.rss import lifetime_peak_rss_bytes
from ckpt_core.stats import Role

BatchLoader = Callable[[list[tuple[str, torch.Tensor]]], None]


class RefitWorker:
    """Hosts one engine. Policy workers send the tensors of a weights factory; rollout workers
    keep what they receive for the refit and report its digests, so a coordinator can check
    every tensor bit-exact against its source.

    ``weights`` is a ``"module:function"`` weights factory (see :mod:`ckpt_core.orchestration.workload`), or
    the factory itself, called with ``weights_params``; rollout workers need none. ``verify``
    turns digests on. ``load_weights`` (rollout only) receives each received batch instead of
    the worker keeping the tensors (digests are then taken batch by batch, before the loader
    sees them, and count in ``wall_seconds``). ``weight_layout`` (rollout only) goes into this
    worker's ``prepare()`` metadata as its ``"weight_layout"`` (see :mod:`ckpt_core.refit.layout`; the
    engines need ``shard_expert_weights=True``).
    """

    def __init__(
        self,
        *,
        role: Role,
        rank: int,
        backend: str,
        bucket_size: int,
        engine_kwargs: dict[str, Any] | None = None,
        weights: str | WeightsFactory | None = None,
        weights_params: dict[str, Any] | None = None,
        verify: bool = True,
        hook_plugins: list[str] | None = None,
        load_weights: BatchLoader | None = None,
        weight_layout: dict[str, Any] | None = None,
    ) -> None:
        if role not in ("policy", "rollout"):
            raise ValueError(f"role must be 'policy' or 'rollout', got {role!r}")
        if role == "policy" and not weights:
            raise ValueError("a policy worker needs a weights factory ('module:function')")
        if role == "policy" and load_weights is not None:
            raise ValueError("load_weights is for rollout workers; a policy worker sends its weights")
        if role == "policy" and weight_layout is not None:
            raise ValueError("weight_layout is a rollout worker's: it says what that rank keeps")
        self.weight_layout = weight_layout
        self.role: Role = role
        self.rank = rank
        self.backend = backend
        self.bucket_size = bucket_size
        self.engine_kwargs = dict(engine_kwargs or {})
        self.weights = load_target(weights) if isinstance(weights, str) else weights
        self.load_weights = load_weights
        self.weights_params = dict(weights_params or {})
        self.verify = verify
        if hook_plugins:
            from ckpt_core.hooks import plugin_manager

            for target in hook_plugins:
                plugin_manager().register(load_target(target)())
        self.engine: CheckpointEngine = self._new_engine()
        self.weight_version = 0
        self._uncommitted: int | None = None  # a rollout's last complete refit, until committed

    def _new_engine(self) -> CheckpointEngine:
        return create_checkpoint_engine(
            self.backend, bucket_size_bytes=self.bucket_size, engine_kwargs=dict(self.engine_kwargs)
        )

    def prepare(self) -> Any:
        metadata = self.engine.prepare()
        if self.weight_layout is not None:
            metadata = {**metadata, "weight_layout": self.weight_layout}
        return metadata

    def init(self, *, train_world_size: int, rollout_world_size: int, metadata: list[Any]) -> None:
        if self.role == "policy":
            self.engine.init_policy_process_group(
                worker_rank=self.rank,
                train_world_size=train_world_size,
                rollout_world_size=rollout_world_size,
                metadata=metadata,
            )
        else:
            self.engine.init_rollout_process_group(
                rollout_rank=self.rank,
                train_world_size=train_world_size,
                rollout_world_size=rollout_world_size,
                metadata=metadata,
            )

    def refit(
        self, *, refit_index: int, weights: str | None = None, weights_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Run this worker's side of one refit; returns stats, digests and the process's
        lifetime peak RSS (``lifetime_peak_rss_bytes``, see :mod:`ckpt_core.rss`).

        ``weights``/``weights_params`` replace the worker's weights factory for this refit.
        For synchronous callers (a local worker process, a threaded Ray actor): it runs
        :meth:`refit_async` to completion on an event loop of its own.
        """
        return asyncio.run(self.refit_async(refit_index=refit_index, weights=weights, weights_params=weights_params))

    async def refit_async(
        self, *, refit_index: int, weights: str | None = None, weights_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """:meth:`refit` for callers that run an event loop (an async Ray actor): the transfer
        runs on the engine's refit thread while the loop keeps serving other coroutines; the
        weights factory's generator is iterated there, the loader and digests run here."""
        self._uncommitted = None
        start = time.perf_counter()
        by_destination: dict[str, dict[str, Any]] = {}  # a policy's, with a stream per destination
        if self.role == "policy":
            factory = load_target(weights) if weights else self.weights
            params = self.weights_params if weights_params is None else weights_params
            assert factory is not None
            source = _Counted(factory(params, refit_index=refit_index, rank=self.rank))
            await self.engine.send_weights(iter(source))
            wall = time.perf_counter() - start
            count = source.count
            # Digests of what was sent, computed after the send so they are not in its timing:
            # with destination layouts, of the parts each destination keeps.
            layouts = self._destination_layouts()
            result_digests = {}  # with a stream per destination, each one's are in by_destination
            if not layouts:
                sent = factory(params, refit_index=refit_index, rank=self.rank)
                result_digests = digests(sent) if self.verify else {}
            for destination, layout in layouts.items():
                # Counted as selected, not from the layout: where it names a weight in two
                # forms (fused experts, or their per-expert tensors), the weights decide.
                selected = _Counted(
                    select_weights(
                        factory(params, refit_index=refit_index, rank=self.rank), layout, destination="the destination"
                    )
                )
                by_destination[destination] = {"digests": digests(selected) if self.verify else _drain(selected)}
                by_destination[destination]["tensors"] = selected.count
            if len(layouts) == 1:  # one stream (to one rank, or the same parts to several)
                (only,) = by_destination.values()
                result_digests, count = only["digests"], only["tensors"]
                by_destination = {}
        elif self.load_weights is not None or getattr(self.engine, "borrow_received_tensors", False):
            # Borrowed tensors are valid only until the next batch: digest them on arrival.
            loaded = await self._receive_into()
            wall = time.perf_counter() - start
            result_digests = loaded if self.verify else {}
            count = len(loaded)
        else:
            received = await self._receive()
            wall = time.perf_counter() - start
            result_digests = digests(received.items()) if self.verify else {}
            count = len(received)
        return self._refitted(refit_index, wall, result_digests, count, by_destination)

    def _refitted(
        self,
        refit_index: int,
        wall: float,
        result_digests: dict[str, str],
        count: int,
        by_destination: dict[str, dict[str, Any]],
    ) -> dict[str, Any]:
        """What :meth:`refit` returns for a refit this worker completed (a rollout's then
        waits for its commit)."""
        if self.role == "rollout":
            self._uncommitted = refit_index
        stats = getattr(self.engine, "last_stats", None)
        return {
            "role": self.role,
            "rank": self.rank,
            "wall_seconds": wall,
            "stats": stats.to_dict() if stats is not None else None,
            "tensors": count,
            "digests": result_digests,
            "by_destination": by_destination,
            "lifetime_peak_rss_bytes": lifetime_peak_rss_bytes(),
            "weight_version": self.weight_version,  # the last committed before this refit
        }

    def _destination_layouts(self) -> dict[str, WeightLayout]:
        """The ckpt-engine layouts the engine selects by (see :mod:`ckpt_core.refit.layout`): ``{}``
        for none, ``{"*": layout}`` for one stream, ``{"<rollout rank>": layout}`` for a
        stream per destination."""
        if not getattr(self.engine, "shard_expert_weights", False):
            return {}
        layout = self.engine.get_target_weight_layout()
        if is_ckpt_layout(layout):
            return {"*": WeightLayout.from_json(layout)}
        if isinstance(layout, dict) and layout and all(is_ckpt_layout(v) for v in layout.values()):
            return {rank: WeightLayout.from_json(v) for rank, v in layout.items()}
        return {}

    async def _receive(self) -> dict[str, torch.Tensor]:
        received: dict[str, torch.Tensor] = {}
        async for batch in self.engine.receive_weight_batches():
            for name, tensor in batch:
                if name in received:
                    raise ValueError(f"tensor {name!r} arrived twice in one refit")
                received[name] = tensor
        return received

    async def _receive_into(self) -> dict[str, str]:
        """Hand each batch to the loader (:meth:`_take_batch`); name -> digest (``""`` unless
        verifying)."""
        seen: dict[str, str] = {}
        async for batch in self.engine.receive_weight_batches():
            self._take_batch(batch, seen)
        return seen

    def _take_batch(self, batch: list[tuple[str, torch.Tensor]], seen: dict[str, str]) -> None:
        """Note each tensor of ``batch`` in ``seen`` (its digest, ``""`` unless verifying) as it
        arrives (a borrowed one is valid only until the next batch), then hand it to the
        worker's loader, if it has one."""
        for name, tensor in batch:
            if name in seen:
                raise ValueError(f"tensor {name!r} arrived twice in one refit")
            seen[name] = tensor_digest(tensor) if self.verify else ""
        (self.load_weights or _drop)(batch)

    def commit(self, *, weight_version: int) -> None:
        """The coordinator's word that the last refit reached every rollout rank whole.
        ``LifecycleError`` unless this worker completed a refit since its last commit that
        was not discarded."""
        if self._uncommitted is None:
            raise LifecycleError(
                f"{self.role} rank {self.rank} has no complete refit to commit (none since the last commit, "
                "or the coordinator discarded it: its digests or tensor counts did not match)"
            )
        self.weight_version = weight_version
        self._uncommitted = None

    def discard(self) -> None:
        """The coordinator rejected the last refit (digests or tensor counts differ from what
        was sent): nothing may commit it; the worker keeps its last committed version."""
        self._uncommitted = None

    def finalize(self) -> None:
        self.engine.finalize()

    def reset(self) -> None:
        """Finalize and build a fresh engine (the recovery path after a failed refit)."""
        try:
            self.engine.finalize()
        finally:
            self.engine = self._new_engine()


def _drop(batch: list[tuple[str, torch.Tensor]]) -> None:
    """A loader that keeps nothing (a rollout worker that only digests what it receives)."""


def _drain(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """Pull every item (to count them), keeping none: no digests."""
    for _ in items:
        pass
    return {}


class _Counted:
    """Iterates ``items`` once, counting what was pulled."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._items = items
        self.count = 0

    def __iter__(self) -> Generator[tuple[str, torch.Tensor], None, None]:
        for item in self._items:
            self.count += 1
            yield item


def refit_worker_specs(
    *,
    backend: str,
    num_policy: int,
    num_rollout: int,
    bucket_size: int,
    engine_kwargs: dict[str, Any] | None = None,
    weights: str,
    weights_params: dict[str, Any] | None = None,
    verify: bool = True,
    hook_plugins: list[str] | None = None,
    weight_layouts: list[dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Service specs and labels for a pool of ``num_policy`` + ``num_rollout`` RefitWorkers,
    in coordinator order (policy ranks, then rollout ranks). ``weight_layouts``: one
    destination layout per rollout rank (:mod:`ckpt_core.refit.layout`; the engines need
    ``shard_expert_weights=True``)."""
    if weight_layouts is not None and len(weight_layouts) != num_rollout:
        raise ValueError(f"weight_layouts has {len(weight_layouts)} entries for {num_rollout} rollout ranks")
    specs, labels = [], []
    common = {
        "service": "ckpt_core.orchestration.worker:RefitWorker",
        "backend": backend,
        "bucket_size": bucket_size,
        "engine_kwargs": dict(engine_kwargs or {}),
        "verify": verify,
    }
    for rank in range(num_policy):
        specs.append(
            {
                **common,
                "role": "policy",
                "rank": rank,
                "weights": weights,
                "weights_params": dict(weights_params or {}),
                "hook_plugins": hook_plugins,
            }
        )
        labels.append(f"policy rank {rank}")
    for rank in range(num_rollout):
        spec = {**common, "role": "rollout", "rank": rank, "hook_plugins": hook_plugins}
        if weight_layouts is not None:
            spec["weight_layout"] = weight_layouts[rank]
        specs.append(spec)
        labels.append(f"rollout rank {rank}")
    return specs, labels
