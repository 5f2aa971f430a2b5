"""Who sends to whom: the ``topology`` engine option as a type.

A refit connects ``train_world_size`` policy ranks to ``rollout_world_size`` rollout ranks.
:class:`Topology` names the three shapes the shipped engines support and answers, for each,
which rollout ranks a policy rank feeds, which policy rank feeds a rollout rank, and whether a
policy rank feeds no one (it drains its weights at every refit). Engines, coordinators and
transports ask it instead of comparing strings. Configs keep passing the strings
``"broadcast"``, ``"paired"`` and ``"fanout"``: :meth:`Topology.parse` reads them, and a
``Topology`` is a ``str`` (it compares equal to its value and serializes as it).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Any

from ckpt_core.errors import EngineOptionError

__all__ = ["Topology"]


class Topology(enum.StrEnum):
    """How policy ranks feed rollout ranks."""

    BROADCAST = "broadcast"
    """Policy rank 0 sends one stream that every rollout rank receives (one group of all);
    other policy ranks drain their weights."""
    PAIRED = "paired"
    """Policy rank ``i`` feeds rollout rank ``i`` over a pair of its own; needs at least as
    many policy as rollout ranks; policy ranks without a partner drain their weights."""
    FANOUT = "fanout"
    """Policy rank 0 feeds every rollout rank, each over a pair of its own and with a stream of
    its own (with destination layouts: only its parts); other policy ranks drain."""

    @classmethod
    def parse(cls, value: Any, *, owner: str = "", choices: Iterable[Topology | str] | None = None) -> Topology:
        """``value`` (a ``Topology`` or its string) as a ``Topology`` among ``choices`` (default:
        all); else ``EngineOptionError`` naming the accepted choices."""
        allowed = [cls(choice) for choice in choices] if choices is not None else list(cls)
        try:
            topology = cls(value) if isinstance(value, str) else None
        except ValueError:
            topology = None
        if topology is None or topology not in allowed:
            prefix = f"{owner}: " if owner else ""
            names = ", ".join(repr(choice.value) for choice in allowed)
            raise EngineOptionError(f"{prefix}topology must be one of {names}, got {value!r}")
        return topology

    @property
    def separate_streams(self) -> bool:
        """Whether a feeding policy rank sends each destination a stream of its own."""
        return self is Topology.FANOUT

    @property
    def shares_link(self) -> bool:
        """Whether a policy rank and all its destinations form one group (one broadcast),
        rather than a pair per destination."""
        return self is Topology.BROADCAST

    def destinations(self, policy_rank: int, train_world_size: int, rollout_world_size: int) -> list[int]:
        """The rollout ranks ``policy_rank`` feeds (empty: it drains its weights)."""
        if self is Topology.PAIRED:
            return [policy_rank] if policy_rank < rollout_world_size else []
        return list(range(rollout_world_size)) if policy_rank == 0 else []

    def source(self, rollout_rank: int) -> int:
        """The policy rank that feeds ``rollout_rank``."""
        return rollout_rank if self is Topology.PAIRED else 0

    def drains(self, policy_rank: int, train_world_size: int, rollout_world_size: int) -> bool:
        """Whether ``policy_rank`` feeds no rollout rank (its weights are drained at each refit)."""
        return not self.destinations(policy_rank, train_world_size, rollout_world_size)

    def check_world_sizes(self, owner: str, train_world_size: int, rollout_world_size: int) -> None:
        """``EngineOptionError`` where this topology cannot connect these world sizes: every
        rollout rank needs a policy rank to feed it."""
        if self is Topology.PAIRED and train_world_size < rollout_world_size:
            raise EngineOptionError(
                f"{owner}: topology='paired' sends policy rank i to rollout rank i, so it needs at "
                f"least as many policy ranks as rollout ranks; got {train_world_size} policy and "
                f"{rollout_world_size} rollout ranks. Use topology='broadcast' instead."
            )
