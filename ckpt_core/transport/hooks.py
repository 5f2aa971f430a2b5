"""``TransportHooks``: everything a transport author may override, typed, in one place.

:class:`~ckpt_core.transport.engine.BucketedEngine` owns the lifecycle, options, refit kinds
and the pipeline; it asks its transport only what these hooks answer: how peers meet (the
metadata a worker publishes, how a policy rank and a rollout rank connect, who sends to whom)
and how buffers are released. ``_connect_policy`` and ``_connect_rollout`` are required; every
other hook has a default that fits a host-memory transport. Every other underscore name of the
engine is private to it: a transport that overrides one is refused by the repository's checks
(``tests/repository/test_layering.py``). :class:`~ckpt_core.transport.torch_distributed.DistributedEngine`
adds hooks of its own for transports over ``torch.distributed`` groups
(``DistributedEngine.DISTRIBUTED_HOOKS``).

The hooks run on the thread that called the lifecycle method (``prepare()``, an init,
``finalize()``), never during a refit, except ``_payload_checksum`` and ``_merge_device``,
read once at the start of each refit.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from ckpt_core._internal.bucket_io import BucketReceiver, BucketSender
from ckpt_core._internal.checksum import payload_checksum
from ckpt_core._internal.host_alloc import release_host_pool
from ckpt_core._internal.pipeline import Checksum
from ckpt_core.options import OptionSchema, OptionValues
from ckpt_core.topology import Topology

__all__ = ["TRANSPORT_HOOKS", "TransportHooks"]


class TransportHooks(abc.ABC):
    """The hooks (module docstring). The defaults read the engine's parsed options."""

    options: ClassVar[OptionSchema]
    option_values: OptionValues
    checksum: bool

    def _prepare_transport(self) -> dict[str, Any]:
        """What peers need to reach this worker, as JSON data (its role is not known yet)."""
        return {}

    @abc.abstractmethod
    def _connect_policy(
        self, worker_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketSender | Mapping[int, BucketSender] | None:
        """Connect to this policy rank's receivers within ``timeout_s``; ``None`` for a rank
        that sends to no one (its weights are drained at every refit). Where
        ``_separate_streams()`` says so: a sender per destination rollout rank, each then sent
        a stream of its own (with ckpt-engine layouts, its own parts)."""

    @abc.abstractmethod
    def _connect_rollout(
        self, rollout_rank: int, train_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]
    ) -> BucketReceiver:
        """Connect to this rollout rank's sender within ``timeout_s``."""

    def _release_transport(self) -> None:
        """Free what ``_prepare_transport`` and the ``_connect`` methods acquired. Idempotent:
        it runs after failures, and before ``prepare()`` ever ran."""

    def _release_cached_memory(self) -> None:
        """Hand cached memory back to the system (``finalize()`` with ``release_after_refit``);
        engines with device buffers also empty their device's cache."""
        release_host_pool()

    def _separate_streams(self) -> bool:
        """Whether ``_connect_policy`` returns a sender per destination rollout rank (a mapping),
        so that each destination can be sent a stream of its own: as the topology says
        (``fanout``); otherwise one sender."""
        return self._topology().separate_streams

    def _destinations(self, worker_rank: int, train_world_size: int, rollout_world_size: int) -> list[int]:
        """The rollout ranks policy rank ``worker_rank`` sends to, as the engine's topology
        says (:meth:`_topology`)."""
        return self._topology().destinations(worker_rank, train_world_size, rollout_world_size)

    def _topology(self) -> Topology:
        """Who sends to whom: the ``topology`` option where the engine has one, else
        ``Topology.BROADCAST`` (policy rank 0 feeds every rollout rank)."""
        value = self.option_values.get("topology", Topology.BROADCAST)
        return value if isinstance(value, Topology) else Topology.parse(value, owner=type(self).__name__)

    def _payload_checksum(self) -> Checksum | None:
        """The checksum both sides compute over a bucket's payload, or ``None`` for none.
        Transports with device buffers return a function that reads device memory."""
        return payload_checksum if self.checksum else None

    def _merge_device(self) -> torch.device | str | None:
        """Where received tensors are built; ``None``: on the receiver's buffer device."""
        return None

    def _agreed_settings(self) -> dict[str, Any]:
        """Settings every worker of this engine must share (plain JSON values), compared with
        every peer's at init (:mod:`ckpt_core._internal.agreement`): the options the schema
        declares ``agreed`` (``shard_expert_weights`` is one: a rollout that publishes its
        layout and a policy that ignores it would send whole weights to a rank that expects
        its shards). A transport overrides it only for settings that are not options."""
        return type(self).options.agreed(self.option_values)


TRANSPORT_HOOKS: frozenset[str] = frozenset(
    name
    for name, value in vars(TransportHooks).items()
    if name.startswith("_") and not name.startswith("__") and callable(value)
)
"""The names of the hooks a transport may override."""
