"""``RefitStage``: one kind of refit, as the engine runs it.

A refit kind changes what a refit sends (only the parts each destination keeps, FP8 bytes
made with the rollout's arithmetic, patches of what changed) without touching how bytes move,
so every transport has it. Each kind is a stage: it is switched on by engine options it
declares, it may publish data in the engine's ``prepare()`` metadata, it reads what the
destinations published when a policy rank connects, and it wraps the weights on the way out
and the batches on the way in. The engine (:class:`~ckpt_core.transport.engine.BucketedEngine`)
holds an ordered tuple of stage classes (``refit_stages``) and loops over them:

* ``prepare()``: each stage's :meth:`RefitStage.publish` goes into the metadata;
* ``init_policy_process_group``: :meth:`RefitStage.connect_policy` with the policy rank's
  :class:`Destinations`, before the transport connects (a refused layout costs no connection),
  then :meth:`RefitStage.connected` with the devices of the transport's buffers;
  ``init_rollout_process_group``: :meth:`RefitStage.connected` too;
* ``send_weights``: the weights pass through every stage's :meth:`RefitStage.send` once, in
  order, then, for each destination stream, through every stage's
  :meth:`RefitStage.send_stream`, in order, on the thread that sends that stream; then each
  stage hears :meth:`RefitStage.send_done` with every stream's statistics, or
  :meth:`RefitStage.send_failed`;
* ``receive_weight_batches``: the batches pass through every stage's
  :meth:`RefitStage.receive` in the reverse order (the last stage to wrap the send unwraps
  the receive first); then :meth:`RefitStage.receive_done` or :meth:`RefitStage.receive_failed`.

A stage object lives as long as its engine (``finalize()`` and a new ``prepare()`` keep it),
so it may keep state across refits (delta keeps its baselines so). A new kind is one module:
its stage class, added to an engine class's ``refit_stages``
(``refit_stages = (*BucketedEngine.refit_stages, MyStage)``), which also adds the stage's
options to that class's option schema.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch

from ckpt_core.options import Option, OptionValues
from ckpt_core.stats import RefitStats

__all__ = ["Batches", "Destinations", "RefitStage", "Stream", "Weights", "ranks_label", "stage_options"]

Weights = Iterable[tuple[str, torch.Tensor]]
"""``(name, tensor)`` pairs, in the order sent."""

Batches = Generator[list[tuple[str, torch.Tensor]], None, None]
"""Received ``(name, tensor)`` batches; closing it closes the stream it reads from."""


def ranks_label(ranks: Sequence[int]) -> str:
    """How messages name a destination: ``"rollout rank 3"`` or ``"rollout ranks [0, 1]"``."""
    return f"rollout rank {ranks[0]}" if len(ranks) == 1 else f"rollout ranks {list(ranks)}"


@dataclasses.dataclass(frozen=True)
class Stream:
    """One stream of a policy rank's refit: the rollout ranks that receive the same bytes
    (one rank where the transport reaches each destination separately)."""

    ranks: tuple[int, ...]

    @property
    def label(self) -> str:
        return ranks_label(self.ranks)


@dataclasses.dataclass(frozen=True)
class Destinations:
    """Whom one policy rank sends to, as its init found: the rollout ranks, the streams they
    are sent in, and what every worker published in its ``prepare()`` metadata (checked:
    plain JSON mappings of this backend and wire format)."""

    owner: str
    """The engine class's name, for messages."""
    worker_rank: int
    train_world_size: int
    rollout_world_size: int
    metadata: list[dict[str, Any]]
    """Every worker's ``prepare()`` result: policy entries by rank, then rollout entries."""
    ranks: tuple[int, ...]
    """The rollout ranks this policy rank sends to (none: it drains its weights)."""
    separate: bool
    """Whether each destination is sent a stream of its own (else one stream feeds them all)."""

    @property
    def streams(self) -> tuple[Stream, ...]:
        if self.separate:
            return tuple(Stream((rank,)) for rank in self.ranks)
        return (Stream(self.ranks),) if self.ranks else ()

    @property
    def label(self) -> str:
        return ranks_label(self.ranks)

    def published(self, rank: int) -> dict[str, Any]:
        """What rollout rank ``rank`` published in its ``prepare()`` metadata."""
        return self.metadata[self.train_world_size + rank]


class RefitStage(abc.ABC):
    """One refit kind (module docstring). Every method has a default that does nothing and
    passes data through; a stage overrides what its kind needs. A method that raises fails
    the call it runs in (an init, or the refit: the engine then fails as for any refit error)."""

    options: ClassVar[tuple[Option, ...]] = ()
    """The engine options this kind adds to the option schema of every engine class that
    runs it (declare ``agreed=True`` for a setting every worker must share)."""

    @classmethod
    @abc.abstractmethod
    def from_options(cls, values: OptionValues, *, owner: str) -> RefitStage | None:
        """This kind's stage for an engine with option ``values`` (``owner`` names the engine
        class in errors), or ``None`` where its options leave it off."""

    def publish(self) -> dict[str, Any]:
        """What this worker adds to its ``prepare()`` metadata (plain JSON data; its keys must
        not clash with the engine's, another stage's or the transport's)."""
        return {}

    def connect_policy(self, destinations: Destinations) -> None:
        """A policy rank's init: read and check what its destinations published, before the
        transport connects."""

    def connected(self, devices: Sequence[torch.device]) -> None:
        """The transport connected (either role); ``devices``: where its buffers are."""

    def send(self, weights: Weights) -> Weights:
        """The weights of one refit, once for every stream (before they are split among
        destination streams): runs on the refit's thread."""
        return weights

    def send_stream(self, stream: Stream, weights: Weights, stats: RefitStats) -> Weights:
        """The weights of one destination stream, on the thread that sends that stream;
        ``stats``: that stream's statistics, which the stage may count into."""
        return weights

    def send_done(self, stats: Mapping[Stream, RefitStats]) -> None:
        """Every stream's refit completed; ``stats``: each stream's."""

    def send_failed(self) -> None:
        """The refit failed or was cancelled: put back what it changed."""

    def receive(self, batches: Batches, stats: RefitStats) -> Batches:
        """The batches of one refit as this stage hands them on; closing the result must
        close ``batches``."""
        return batches

    def receive_done(self) -> None:
        """The caller took every batch of the refit."""

    def receive_failed(self) -> None:
        """The refit failed, or its caller stopped early: put back what it changed."""

    def finalize(self) -> None:
        """The engine's ``finalize()``: drop what lives only as long as a connection."""


def stage_options(owner: str, stages: Iterable[type[RefitStage]], declared: Iterable[str] = ()) -> list[Option]:
    """The options of ``stages`` that are not in ``declared`` (the names an engine class's
    schema already holds), in order. ``TypeError`` where two stages declare one name: an
    option is declared once, by the stage whose kind it switches."""
    owners: dict[str, str] = {}
    missing = []
    for stage in stages:
        for option in stage.options:
            if option.name in owners:
                raise TypeError(
                    f"{owner}.refit_stages: {stage.__name__} and {owners[option.name]} both declare the option "
                    f"{option.name!r}"
                )
            owners[option.name] = stage.__name__
            if option.name not in declared:
                missing.append(option)
    return missing
