"""``delta`` as a refit stage: weights travel as patches of what changed since the last refit.

Each weight travels as a patch of the elements whose bits changed since the last refit its
destination completed, where that is fewer bytes than the whole weight and not predicted
slower by the sender's model of its own refit times (:mod:`ckpt_core.refit.delta.baselines`,
:mod:`ckpt_core.refit.delta.choice`; it runs after quantizing and layouts: patches of what each
destination keeps); the receiver hands out whole weights. Each side keeps a copy of each
weight sent so, across ``finalize()`` (the stage lives as long as its engine): a rollout
reports the version it holds in its ``prepare()`` metadata, and a sender whose destination
holds another (a restarted rollout, a failed refit) sends every weight whole.
``delta_max_baseline_bytes`` bounds the copies per destination stream: weights past it (in the
order sent) travel whole, and neither side keeps a copy of them. ``delta_check`` says how a
receiver checks a patched copy: audited (the default) or hashed whole at every patch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from ckpt_core.errors import EngineOptionError
from ckpt_core.options import Option, OptionValues, check_count
from ckpt_core.refit.delta.baselines import DeltaReceiver, DeltaState
from ckpt_core.refit.stage import Batches, Destinations, RefitStage, Stream, Weights
from ckpt_core.stats import RefitStats

__all__ = ["DeltaStage"]


def _byte_bound(option: Option, owner: str, value: Any) -> int | None:
    """A bound in bytes: an ``int`` >= 0, or ``None`` for none."""
    return None if value is None else check_count(owner, option.name, value)


class DeltaStage(RefitStage):
    """On with ``delta`` (module docstring)."""

    options: ClassVar[tuple[Option, ...]] = (
        Option.flag(
            "delta",
            False,
            "each weight is sent as a patch of the elements that changed since the refit its "
            "destination last completed, where that is fewer bytes and not predicted slower "
            "(docs/delta.md); both sides keep a copy of each weight sent so",
            agreed=True,
        ),
        Option.custom(
            "delta_max_baseline_bytes",
            None,
            "policy side, with delta: the most bytes of copies kept per destination stream (by "
            "each side); weights past it, in the order sent, always travel whole and uncopied",
            parse=_byte_bound,
            kind="int >= 0 (bytes) or None: no bound",
        ),
        Option.choice(
            "delta_check",
            "audit",
            ("audit", "whole"),
            "rollout side, with delta: how a patched copy is checked against the sender's digest "
            "(docs/delta.md): 'audit', its digest made from the words the patch wrote and one "
            "sixteenth of it read in turn per patch (a write into a received weight is found "
            "within 16 patches of it); 'whole', the copy hashed whole at each patch (found at the next)",
        ),
    )

    def __init__(self, state: DeltaState) -> None:
        self.state = state
        """The baselines, kept across ``finalize()`` (they are the option's point)."""

    @classmethod
    def from_options(cls, values: OptionValues, *, owner: str) -> DeltaStage | None:
        if values.delta_max_baseline_bytes is not None and not values.delta:
            raise EngineOptionError(
                f"{owner}: delta_max_baseline_bytes bounds delta refits' copies; it needs delta=True"
            )
        if values.delta_check != "audit" and not values.delta:
            raise EngineOptionError(f"{owner}: delta_check checks delta refits' patches; it needs delta=True")
        if not values.delta:
            return None
        # Received tensors own their memory unless lent: a weight received whole is kept as it is.
        keeps_received = not values.get("borrow_received_tensors", False)
        return cls(
            DeltaState(
                max_baseline_bytes=values.delta_max_baseline_bytes,
                keeps_received=keeps_received,
                whole_check=values.delta_check == "whole",
            )
        )

    def publish(self) -> dict[str, Any]:
        """As a rollout: the version its senders' patches must be made against."""
        return dict(self.state.metadata())

    def connect_policy(self, destinations: Destinations) -> None:
        """This init's destination streams, each keeping its baseline only where every
        destination reports holding it (:meth:`DeltaState.connect`)."""
        streams = {stream.ranks: stream.label for stream in destinations.streams}
        reported = {rank: destinations.published(rank).get(DeltaState.METADATA_KEY) for rank in destinations.ranks}
        self.state.connect(streams, reported)

    def connected(self, devices: Sequence[torch.device]) -> None:
        self.state.warm_up(devices)

    def send_stream(self, stream: Stream, weights: Weights, stats: RefitStats) -> Weights:
        return self.state.senders[stream.ranks].encode(weights, stats)

    def send_done(self, stats: Mapping[Stream, RefitStats]) -> None:
        self.state.commit_senders({stream.ranks: value for stream, value in stats.items()})

    def send_failed(self) -> None:
        self.state.discard_senders()

    def receive(self, batches: Batches, stats: RefitStats) -> Batches:
        return _decoded(batches, self.state.receiver, stats)

    def receive_done(self) -> None:
        self.state.receiver.commit()

    def receive_failed(self) -> None:
        self.state.receiver.discard()


def _decoded(batches: Batches, receiver: DeltaReceiver, stats: RefitStats) -> Batches:
    """``batches`` of a delta refit as whole weights (the manifest dropped, patches applied,
    counted into ``stats``); closing this closes ``batches``."""
    try:
        for batch in batches:
            decoded = [entry for entry in (receiver.receive(name, tensor, stats) for name, tensor in batch) if entry]
            if decoded:
                yield decoded
        receiver.end()
    finally:
        batches.close()
