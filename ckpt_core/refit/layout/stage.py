"""``shard_expert_weights`` as a refit stage: each destination receives the parts its layout keeps.

NeMo RL's option: on a policy worker, ``get_target_weight_layout()`` returns the
``"weight_layout"`` that the destination rollout worker put in its ``prepare()`` metadata
(NeMo RL's vLLM worker does), for the caller to select the weights that destination keeps. On
a rollout worker the engine only carries the flag: the worker's loader reads it. With a layout
in this library's format (:mod:`ckpt_core.refit.layout`, ``"format":
"ckpt-engine.weight-layout"``), the engine selects instead: every rollout rank's layout is
checked at init (bounds, overlaps, one model, nothing lost), the caller sends full weights,
and each destination stream receives only the parts its layout keeps.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ckpt_core.errors import EngineOptionError, InvalidArgumentError
from ckpt_core.options import Option, OptionValues
from ckpt_core.refit.layout import WeightLayout, check_layouts, is_ckpt_layout, select_weights
from ckpt_core.refit.stage import Destinations, RefitStage, Stream, Weights
from ckpt_core.stats import RefitStats

__all__ = ["LayoutStage"]


class LayoutStage(RefitStage):
    """On with ``shard_expert_weights`` (module docstring)."""

    options: ClassVar[tuple[Option, ...]] = (
        Option.flag(
            "shard_expert_weights",
            False,
            "NeMo RL's: get_target_weight_layout() returns the destination's weight_layout; with "
            "ckpt-engine layouts each destination receives only its parts",
            agreed=True,
        ),
    )

    def __init__(self) -> None:
        self.target_layout: dict[str, Any] | None = None
        """What ``get_target_weight_layout()`` returns (set at a policy rank's init)."""
        self._selection: dict[Stream, WeightLayout] = {}

    @classmethod
    def from_options(cls, values: OptionValues, *, owner: str) -> LayoutStage | None:
        return cls() if values.shard_expert_weights else None

    def connect_policy(self, destinations: Destinations) -> None:
        """Every destination's layout, checked before connecting: present, one selection per
        stream, and (ckpt-engine layouts) every rollout rank's together."""
        owner, ranks = destinations.owner, destinations.ranks
        layouts = []
        for rank in ranks:
            layout = destinations.published(rank).get("weight_layout")
            if not isinstance(layout, dict):
                raise InvalidArgumentError(
                    f"{owner}: shard_expert_weights=True, but rollout rank {rank}'s prepare() metadata has no "
                    f"'weight_layout' mapping (got {type(layout).__name__}): each rollout worker adds its "
                    "layout to its metadata, as NeMo RL's vLLM worker does when its engine has "
                    "shard_expert_weights=True; or turn shard_expert_weights off on every worker"
                )
            layouts.append(layout)
        differ = any(layout != layouts[0] for layout in layouts[1:])
        ckpt_format = bool(layouts) and is_ckpt_layout(layouts[0])
        if differ and not (ckpt_format and destinations.separate):
            raise EngineOptionError(
                f"{owner}: policy rank {destinations.worker_rank} sends the same bytes to rollout ranks "
                f"{list(ranks)}, but their weight layouts differ, so no one selection of weights fits them all: "
                "use a topology in which each policy rank feeds one rollout rank (topology='paired'), one that "
                "sends each rollout rank a stream of its own with ckpt-engine layouts (topology='fanout'), "
                "or shard_expert_weights=False"
            )
        self._selection = {}
        if ckpt_format:
            parsed = _checked_layouts(destinations)
            # One stream for several destinations only where their layouts are equal.
            self._selection = {stream: parsed[stream.ranks[0]] for stream in destinations.streams}
        if differ:  # several destinations, each with its own layout
            self.target_layout = {str(rank): layout for rank, layout in zip(ranks, layouts)}
        else:
            self.target_layout = layouts[0] if layouts else None

    def send_stream(self, stream: Stream, weights: Weights, stats: RefitStats) -> Weights:
        layout = self._selection.get(stream)
        return weights if layout is None else select_weights(weights, layout, destination=stream.label)

    def finalize(self) -> None:
        self.target_layout = None
        self._selection = {}


def _checked_layouts(destinations: Destinations) -> dict[int, WeightLayout]:
    """Every rollout rank's ckpt-engine layout, checked together: each one alone, then that
    they describe one model and lose nothing."""
    owner = destinations.owner
    parsed = {}
    for rank in range(destinations.rollout_world_size):
        layout = destinations.published(rank).get("weight_layout")
        parsed[rank] = WeightLayout.from_json(layout, owner=f"{owner}: rollout rank {rank}'s weight_layout")
    check_layouts(parsed, owner=owner)
    return parsed
