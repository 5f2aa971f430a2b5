"""Destination layouts: what one rollout rank keeps of every weight, so its sender moves only that.

A rollout worker describes its layout as plain JSON data and puts it in its ``prepare()``
metadata under ``"weight_layout"``; with ``shard_expert_weights=True`` on the engines, the policy
worker that sends to it selects, for every weight it yields, the part that rank keeps, before a
byte is packed (:func:`select_weights`). Every backend shares this: the selection happens
before the pipeline, not in a transport. The format (version 2)::

    {
      "format": "ckpt-engine.weight-layout",
      "version": 2,
      "weights": {
        "model.norm.weight": {"shape": [256], "keep": "whole"},
        "model.layers.0.mlp.experts.0.down_proj.weight": {"shape": [256, 512], "keep": "none"},
        "model.layers.0.mlp.experts.1.down_proj.weight": {"shape": [256, 512], "keep": "whole"},
        "model.layers.0.self_attn.q_proj.weight": {"shape": [256, 256], "keep": {"dim": 0, "parts": [[0, 128]]}}
      },
      "alternatives": [
        {
          "replaces": ["model.layers.0.mlp.experts.0.down_proj.weight",
                       "model.layers.0.mlp.experts.1.down_proj.weight"],
          "weights": {
            "model.layers.0.mlp.experts.down_proj": {"shape": [2, 256, 512], "keep": {"dim": 0, "parts": [[1, 1]]}}
          }
        }
      ]
    }

``keep`` is ``"whole"``, ``"none"`` (another pipeline stage, an expert another rank owns), or
slices along one dimension: ``parts`` are ``[offset, length]`` pairs, in the order the rank
receives them, concatenated along ``dim`` into one tensor under the weight's own name (a fused
weight whose parts are sharded separately, such as a fused q/k/v or gate/up, has one part per
piece). ``shape`` is the full weight's shape the layout was made for: a sender's weight of
another shape is refused (a layout from another model). A layout names every weight the
sender yields, ``"none"`` included: a weight it does not name is an error, never skipped.

``alternatives`` (optional; version 2 added it) lets some weights arrive in either of two
namings: each entry's ``weights`` (with entries as above) may come instead of the weights its
``replaces`` names (names of ``"weights"``), as a trainer holding mixture-of-experts weights
fused in memory (Hugging Face transformers 5: ``experts.gate_up_proj`` of shape ``[E, 2 * I,
H]``) yields one tensor for what a checkpoint names per expert. A sender yields exactly one of
the two forms of each entry, all of it: both forms, or neither, is an error. The two forms
hold the same elements, and a rank keeps as many of them in either (checked). A rank
receives the selected part under the name the sender used; ``received_elements`` is the same
for either form.

Checked at ``init_policy_process_group`` (:func:`check_layouts`): each layout on its own (a slice
out of bounds, overlapping parts, an alternative naming that does not fit what it replaces) and
all rollout ranks' layouts together (the same weights, alternatives and shapes, and every
element of every weight, in either naming, kept by at least one rank). Checked while sending:
every weight yielded is named, with its shape, every named weight is yielded (in one of its
namings), and no weight comes in both.

NeMo RL's own vLLM layout (``{"expert_params": ..., "missing_weight_prefixes": ...}``, which
its Megatron worker applies itself) has no ``"format"`` key: engines pass it through to
``get_target_weight_layout()`` untouched and select nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterable, Mapping, Sequence
from typing import Any

import torch

from ckpt_core.errors import WeightLayoutError

__all__ = [
    "AlternativeNaming",
    "KeptWeight",
    "LAYOUT_FORMAT",
    "LAYOUT_VERSION",
    "LayoutSelector",
    "WeightLayout",
    "check_layouts",
    "even_shard",
    "is_ckpt_layout",
    "nothing",
    "select_weights",
    "slices",
    "whole",
]

LAYOUT_FORMAT = "ckpt-engine.weight-layout"
LAYOUT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class KeptWeight:
    """What one rank keeps of one weight: all of it (``dim is None`` and ``parts`` empty),
    nothing (``kept is False``), or ``parts`` (``(offset, length)``) along ``dim``."""

    shape: tuple[int, ...]
    kept: bool = True
    dim: int | None = None
    parts: tuple[tuple[int, int], ...] = ()

    @property
    def whole(self) -> bool:
        return self.kept and self.dim is None

    @property
    def received_shape(self) -> tuple[int, ...] | None:
        """The shape of the tensor the rank receives for this weight (``None``: none)."""
        if not self.kept:
            return None
        if self.dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.dim] = sum(length for _, length in self.parts)
        return tuple(shape)

    def received_elements(self) -> int:
        shape = self.received_shape
        return 0 if shape is None else torch.Size(shape).numel()

    def select(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """The part of ``tensor`` (the full weight) this rank keeps: the tensor itself, a view
        (one part), a new tensor (several parts, concatenated along ``dim``), or ``None``."""
        if not self.kept:
            return None
        if self.dim is None:
            return tensor
        pieces = [tensor.narrow(self.dim, offset, length) for offset, length in self.parts]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=self.dim)

    def to_json(self) -> dict[str, Any]:
        keep: Any
        if not self.kept:
            keep = "none"
        elif self.dim is None:
            keep = "whole"
        else:
            keep = {"dim": self.dim, "parts": [list(part) for part in self.parts]}
        return {"shape": list(self.shape), "keep": keep}


@dataclasses.dataclass(frozen=True)
class AlternativeNaming:
    """Another naming of some of a layout's weights: the sender may yield ``weights`` instead of
    the layout's weights named in ``replaces`` (a fused tensor for its per-expert tensors), one
    form or the other, all of it."""

    replaces: tuple[str, ...]
    weights: Mapping[str, KeptWeight]

    def to_json(self) -> dict[str, Any]:
        return {
            "replaces": list(self.replaces),
            "weights": {name: kept.to_json() for name, kept in self.weights.items()},
        }


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """One rollout rank's layout, checked (build it with :meth:`from_json`): ``weights`` names
    every weight, and each of ``alternatives`` another naming of some of them."""

    weights: Mapping[str, KeptWeight]
    alternatives: tuple[AlternativeNaming, ...] = ()

    @classmethod
    def from_json(cls, data: Any, *, owner: str = "weight layout") -> WeightLayout:
        """Parse and check a layout; ``WeightLayoutError`` naming the weight otherwise."""
        if not isinstance(data, Mapping):
            raise WeightLayoutError(f"{owner}: a layout is a mapping, got {type(data).__name__}")
        version = data.get("version")
        if data.get("format") != LAYOUT_FORMAT or type(version) is not int or version != LAYOUT_VERSION:
            raise WeightLayoutError(
                f"{owner}: expected format {LAYOUT_FORMAT!r} version {LAYOUT_VERSION}, got format "
                f"{data.get('format')!r} version {version!r}"
            )
        unknown = sorted(set(data) - {"format", "version", "weights", "alternatives"})
        if unknown:
            raise WeightLayoutError(
                f"{owner}: unknown keys {unknown} (a layout has format, version, weights and optionally alternatives)"
            )
        weights = _parse_weights(owner, data.get("weights"), "'weights'")
        return cls(weights, _parse_alternatives(owner, weights, data.get("alternatives", [])))

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "format": LAYOUT_FORMAT,
            "version": LAYOUT_VERSION,
            "weights": {name: kept.to_json() for name, kept in self.weights.items()},
        }
        if self.alternatives:
            data["alternatives"] = [alternative.to_json() for alternative in self.alternatives]
        return data

    def find(self, name: str) -> KeptWeight | None:
        """What this rank keeps of weight ``name``, in either naming (``None``: not named)."""
        kept = self.weights.get(name)
        if kept is not None:
            return kept
        for alternative in self.alternatives:
            kept = alternative.weights.get(name)
            if kept is not None:
                return kept
        return None

    def received_elements(self) -> int:
        """Elements this rank receives in a refit (times the dtype's size: its bytes); the same
        whichever naming the sender uses (checked by :meth:`from_json`)."""
        return sum(kept.received_elements() for kept in self.weights.values())


def is_ckpt_layout(data: Any) -> bool:
    """Whether ``data`` claims this module's format (NeMo RL's own layouts do not)."""
    return isinstance(data, Mapping) and "format" in data


def whole(shape: Sequence[int]) -> KeptWeight:
    return KeptWeight(tuple(shape))


def nothing(shape: Sequence[int]) -> KeptWeight:
    return KeptWeight(tuple(shape), kept=False)


def slices(shape: Sequence[int], dim: int, parts: Iterable[tuple[int, int]]) -> KeptWeight:
    return KeptWeight(tuple(shape), dim=dim, parts=tuple((int(o), int(n)) for o, n in parts))


def even_shard(shape: Sequence[int], dim: int, rank: int, world_size: int) -> KeptWeight:
    """Rank ``rank``'s share of ``world_size`` equal shards along ``dim`` (the size must divide)."""
    if not 0 <= rank < world_size or not 0 <= dim < len(shape):
        raise WeightLayoutError(f"rank {rank} of {world_size}, dimension {dim} of shape {list(shape)}: out of range")
    size = shape[dim]
    if size % world_size:
        raise WeightLayoutError(f"dimension {dim} of size {size} does not split into {world_size} equal shards")
    step = size // world_size
    return slices(shape, dim, [(rank * step, step)])


def check_layouts(layouts: Mapping[int, WeightLayout], *, owner: str) -> None:
    """Check the layouts of every rollout rank (rank -> layout) together: the same weight
    names with the same shapes and the same alternative namings, and every element of every
    weight, in either naming, kept by some rank."""
    ranks = sorted(layouts)
    if not ranks:
        raise WeightLayoutError(f"{owner}: no rollout rank's layout to check")
    first = layouts[ranks[0]]
    for rank in ranks[1:]:
        other = layouts[rank]
        differ = sorted(set(first.weights) ^ set(other.weights))
        if differ:
            raise WeightLayoutError(
                f"{owner}: rollout ranks {ranks[0]} and {rank} describe different weights (first: "
                f"{differ[0]!r}): every rank's layout names every weight, with keep 'none' for those it lacks"
            )
        for name, kept in other.weights.items():
            if kept.shape != first.weights[name].shape:
                raise WeightLayoutError(
                    f"{owner}: weight {name!r} has shape {list(first.weights[name].shape)} in rollout rank "
                    f"{ranks[0]}'s layout but {list(kept.shape)} in rank {rank}'s: layouts of different models"
                )
        if _naming_signature(first) != _naming_signature(other):
            raise WeightLayoutError(
                f"{owner}: rollout ranks {ranks[0]} and {rank} describe different alternative namings (which "
                "weights may come under other names, and their shapes): layouts of different models, or of "
                "different versions of the code that derives them"
            )
    for name in first.weights:
        _check_covered(owner, name, [(rank, layouts[rank].weights[name]) for rank in ranks])
    for index, alternative in enumerate(first.alternatives):
        for name in alternative.weights:
            kept_by = [(rank, layouts[rank].alternatives[index].weights[name]) for rank in ranks]
            _check_covered(owner, name, kept_by)


class LayoutSelector:
    """Selects, weight by weight, what one destination's layout keeps, and checks the sender's
    weights against it (``destination`` names the rank in messages)."""

    def __init__(self, layout: WeightLayout, *, destination: str) -> None:
        self.layout = layout
        self.destination = destination
        self._seen: set[str] = set()
        # name -> (what is kept, its alternative's index or None, form: 0 replaced, 1 alternative)
        self._entries: dict[str, tuple[KeptWeight, int | None, int]] = {
            name: (kept, None, 0) for name, kept in layout.weights.items()
        }
        for index, alternative in enumerate(layout.alternatives):
            for name in alternative.replaces:
                self._entries[name] = (layout.weights[name], index, 0)
            for name, kept in alternative.weights.items():
                self._entries[name] = (kept, index, 1)
        self._chosen: dict[int, str] = {}  # alternative index -> the first name yielded of it

    def select(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """The part of weight ``name`` the destination keeps (``None``: nothing);
        ``WeightLayoutError`` if the layout does not name it, names it with another shape, or
        the sender already yielded the other naming of it."""
        if name in self._seen:
            raise WeightLayoutError(f"the sender yields weight {name!r} twice in one refit; names must be unique")
        entry = self._entries.get(name)
        if entry is None:
            raise WeightLayoutError(
                f"the sender yields weight {name!r}, which {self.destination}'s layout does not name: a "
                "layout names every weight (keep 'none' for those the rank lacks); is it a layout of another model?"
            )
        kept, index, form = entry
        if tuple(tensor.shape) != kept.shape:
            raise WeightLayoutError(
                f"the sender's weight {name!r} has shape {list(tensor.shape)}, but {self.destination}'s layout "
                f"was made for {list(kept.shape)}: a layout of another model"
            )
        if index is not None:
            first = self._chosen.setdefault(index, name)
            if self._entries[first][2] != form:
                raise WeightLayoutError(
                    f"the sender yields weight {name!r} and, in this refit, also {first!r}: two namings of the "
                    f"same weights in {self.destination}'s layout (one tensor or the several it replaces); yield "
                    "one form of them, not both"
                )
        self._seen.add(name)
        return kept.select(tensor)

    def finish(self) -> None:
        """``WeightLayoutError`` for weights the layout names that the sender never yielded, in
        any of their namings."""
        expected: list[str] = [name for name, (_, index, _) in self._entries.items() if index is None]
        unchosen: list[AlternativeNaming] = []
        for index, alternative in enumerate(self.layout.alternatives):
            first = self._chosen.get(index)
            if first is not None and self._entries[first][2] == 1:
                expected.extend(alternative.weights)
            else:
                expected.extend(alternative.replaces)
                if first is None:
                    unchosen.append(alternative)
        missing = [name for name in expected if name not in self._seen]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            instead = ""
            if unchosen:
                names = [name for alternative in unchosen for name in alternative.weights]
                instead = f" (or, instead of {len(unchosen)} group(s) of them, the other naming: {names[0]!r}" + (
                    f" and {len(names) - 1} more)" if len(names) > 1 else ")"
                )
            raise WeightLayoutError(
                f"{self.destination}'s layout names {len(missing)} weight(s) the sender never yielded: {shown}{instead}"
            )


def select_weights(
    weights: Iterable[tuple[str, torch.Tensor]], layout: WeightLayout, *, destination: str
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """``weights`` (full tensors) reduced to what ``layout`` keeps, checked as
    :class:`LayoutSelector` does (``destination`` names the rank in messages)."""
    selector = LayoutSelector(layout, destination=destination)
    for name, tensor in weights:
        selected = selector.select(name, tensor)
        if selected is not None:
            yield name, selected
    selector.finish()


def _parse_weights(owner: str, weights: Any, where: str) -> dict[str, KeptWeight]:
    if not isinstance(weights, Mapping) or not weights:
        raise WeightLayoutError(f"{owner}: {where} must be a non-empty mapping of weight name to entry")
    return {_check_name(owner, name): _parse_entry(owner, name, entry) for name, entry in weights.items()}


def _parse_alternatives(
    owner: str, weights: Mapping[str, KeptWeight], alternatives: Any
) -> tuple[AlternativeNaming, ...]:
    """``alternatives`` checked: each replaces weights of ``weights`` (none twice) with new
    names (none named elsewhere) holding the same elements, of which the rank keeps as many."""
    if not isinstance(alternatives, (list, tuple)):
        raise WeightLayoutError(f"{owner}: 'alternatives' must be a list, got {type(alternatives).__name__}")
    replaced: set[str] = set()
    named: set[str] = set(weights)
    parsed = []
    for position, alternative in enumerate(alternatives):
        where = f"{owner}: alternative {position}"
        if not isinstance(alternative, Mapping) or set(alternative) != {"replaces", "weights"}:
            raise WeightLayoutError(
                f"{where}: an alternative is a mapping with exactly 'replaces' and 'weights', got {alternative!r}"
            )
        replaces = alternative["replaces"]
        if not isinstance(replaces, (list, tuple)) or not replaces:
            raise WeightLayoutError(f"{where}: 'replaces' must be a non-empty list of weight names")
        for name in replaces:
            if not isinstance(name, str) or name not in weights:
                raise WeightLayoutError(
                    f"{where}: 'replaces' names {name!r}, which is not one of the layout's 'weights'"
                )
            if name in replaced:
                raise WeightLayoutError(
                    f"{where}: weight {name!r} is replaced twice (by two alternatives or twice in one)"
                )
            replaced.add(name)
        own = _parse_weights(owner, alternative["weights"], f"alternative {position}'s 'weights'")
        for name in own:
            if name in named:
                raise WeightLayoutError(
                    f"{where}: weight {name!r} is named elsewhere in the layout too; each name has one entry"
                )
            named.add(name)
        before = [weights[name] for name in replaces]
        elements = sum(torch.Size(kept.shape).numel() for kept in before)
        if sum(torch.Size(kept.shape).numel() for kept in own.values()) != elements:
            raise WeightLayoutError(
                f"{where}: weights {sorted(own)} hold another number of elements than the {len(before)} weight(s) "
                f"they replace (first: {replaces[0]!r}; {elements} elements in all): not two namings of one thing"
            )
        if sum(kept.received_elements() for kept in own.values()) != sum(kept.received_elements() for kept in before):
            raise WeightLayoutError(
                f"{where}: the rank keeps another number of elements of {sorted(own)} than of the weights they "
                f"replace (first: {replaces[0]!r}): the two namings must keep the same part"
            )
        parsed.append(AlternativeNaming(tuple(replaces), own))
    return tuple(parsed)


def _naming_signature(layout: WeightLayout) -> list[tuple[tuple[str, ...], dict[str, tuple[int, ...]]]]:
    """What ranks' layouts must share of their alternatives: the names and full shapes."""
    return [
        (tuple(sorted(alternative.replaces)), {name: kept.shape for name, kept in alternative.weights.items()})
        for alternative in layout.alternatives
    ]


def _check_name(owner: str, name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise WeightLayoutError(f"{owner}: weight names are non-empty strings, got {name!r}")
    return name


def _parse_entry(owner: str, name: str, entry: Any) -> KeptWeight:
    where = f"{owner}: weight {name!r}"
    if not isinstance(entry, Mapping) or set(entry) != {"shape", "keep"}:
        raise WeightLayoutError(f"{where}: an entry is a mapping with exactly 'shape' and 'keep', got {entry!r}")
    shape = entry["shape"]
    if not isinstance(shape, (list, tuple)) or not all(_is_count(size) for size in shape):
        raise WeightLayoutError(f"{where}: 'shape' must be a list of non-negative ints, got {shape!r}")
    shape = tuple(shape)
    keep = entry["keep"]
    if keep == "whole":
        return whole(shape)
    if keep == "none":
        return nothing(shape)
    if not isinstance(keep, Mapping) or set(keep) != {"dim", "parts"}:
        raise WeightLayoutError(
            f"{where}: 'keep' must be 'whole', 'none' or {{'dim': d, 'parts': [[offset, length], ...]}}, got {keep!r}"
        )
    dim, parts = keep["dim"], keep["parts"]
    if not _is_count(dim) or dim >= len(shape):
        raise WeightLayoutError(f"{where}: dim {dim!r} is not a dimension of shape {list(shape)}")
    if not isinstance(parts, (list, tuple)) or not parts:
        raise WeightLayoutError(f"{where}: 'parts' must be a non-empty list of [offset, length] pairs")
    checked: list[tuple[int, int]] = []
    for part in parts:
        if (
            not isinstance(part, (list, tuple))
            or len(part) != 2
            or not _is_count(part[0])
            or not _is_count(part[1])
            or part[1] == 0
        ):
            raise WeightLayoutError(f"{where}: a part is [offset >= 0, length >= 1], got {part!r}")
        offset, length = int(part[0]), int(part[1])
        if offset + length > shape[dim]:
            raise WeightLayoutError(
                f"{where}: part [{offset}, {length}] ends at {offset + length}, past dimension {dim} of "
                f"size {shape[dim]} (shape {list(shape)})"
            )
        checked.append((offset, length))
    ordered = sorted(checked)
    for (offset, length), (next_offset, _) in zip(ordered, ordered[1:]):
        if offset + length > next_offset:
            raise WeightLayoutError(
                f"{where}: parts [{offset}, {length}] and [{next_offset}, ...] overlap along dimension {dim}"
            )
    return slices(shape, dim, checked)


def _check_covered(owner: str, name: str, kept_by: list[tuple[int, KeptWeight]]) -> None:
    """Every element of weight ``name`` reaches at least one rank."""
    keeping = [(rank, kept) for rank, kept in kept_by if kept.kept]
    if not keeping:
        raise WeightLayoutError(f"{owner}: no rollout rank keeps any of weight {name!r}: it would be lost")
    if any(kept.whole for _, kept in keeping):
        return
    dims = {kept.dim for _, kept in keeping}
    if len(dims) > 1:
        raise WeightLayoutError(
            f"{owner}: weight {name!r} is sliced along different dimensions {sorted(d for d in dims if d is not None)} "
            "by different ranks; slice every rank's part along one dimension"
        )
    shape = keeping[0][1].shape
    dim = keeping[0][1].dim
    assert dim is not None
    covered = 0
    for offset, length in sorted(part for _, kept in keeping for part in kept.parts):
        if offset > covered:
            break
        covered = max(covered, offset + length)
    if covered < shape[dim]:
        raise WeightLayoutError(
            f"{owner}: no rollout rank keeps index {covered} of dimension {dim} of weight {name!r} "
            f"(size {shape[dim]}): that part would be lost"
        )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
