"""The checks of an init's arguments, before any connection is made (see :func:`checked_metadata`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckpt_core._internal.agreement import check_metadata_agreement
from ckpt_core._internal.json_data import json_data_problem
from ckpt_core._internal.wire import FORMAT_VERSION
from ckpt_core.errors import InvalidArgumentError, WireFormatError
from ckpt_core.stats import Role

if TYPE_CHECKING:
    from ckpt_core.transport.engine import BucketedEngine


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_metadata(
    engine: BucketedEngine,
    engine_id: str,
    *,
    rank: int,
    train_world_size: int,
    rollout_world_size: int,
    metadata: Any,
    role: Role,
) -> list[dict[str, Any]]:
    """An init's arguments checked (world sizes, the rank, then every metadata entry: a plain
    JSON mapping from this backend and wire format, this engine's own at its place (policy
    entries by rank, then rollout entries by rank), and
    the agreed settings of every worker equal to ``engine``'s); returns ``metadata``.
    ``InvalidArgumentError`` for a wrong argument, ``WireFormatError`` for an entry that is
    not another worker's ``prepare()`` result of this backend, ``EngineOptionError`` for a
    setting that differs."""
    owner = type(engine).__name__
    for label, value in (("train_world_size", train_world_size), ("rollout_world_size", rollout_world_size)):
        if not _is_int(value) or value < 1:
            raise InvalidArgumentError(f"{owner}: {label} must be an int >= 1, got {value!r}")
    size = train_world_size if role == "policy" else rollout_world_size
    label = "worker_rank" if role == "policy" else "rollout_rank"
    if not _is_int(rank) or not 0 <= rank < size:
        raise InvalidArgumentError(f"{owner}: {label} must be an int in [0, {size}), got {rank!r}")
    own_index = rank if role == "policy" else train_world_size + rank
    expected = train_world_size + rollout_world_size
    if not isinstance(metadata, list) or len(metadata) != expected:
        got = len(metadata) if isinstance(metadata, list) else type(metadata).__name__
        raise InvalidArgumentError(
            f"{owner}: metadata must be a list of {expected} prepare() results "
            f"({train_world_size} policy entries, then {rollout_world_size} rollout entries), got {got}"
        )
    for index, entry in enumerate(metadata):
        if not isinstance(entry, dict):
            raise WireFormatError(
                f"{owner}: metadata[{index}] is a {type(entry).__name__}, not a mapping: pass each "
                "worker's prepare() result unchanged"
            )
        problem = json_data_problem(entry)
        if problem is not None:
            raise WireFormatError(
                f"{owner}: metadata[{index}] is not plain JSON data: {problem}; pass each worker's "
                "prepare() result unchanged (as JSON, if your orchestrator serializes it)"
            )
        if entry.get("backend") != engine.backend_name:
            found = entry.get("backend")
            raise WireFormatError(
                f"{owner}: metadata[{index}] comes from backend {found!r}, not "
                f"{engine.backend_name!r}: every worker must use the same backend"
            )
        if entry.get("format") != FORMAT_VERSION:
            raise WireFormatError(
                f"{owner}: metadata[{index}] has format {entry.get('format')!r}, this side speaks "
                f"{FORMAT_VERSION}: install the same ckpt-core version on every worker"
            )
    if metadata[own_index].get("engine_id") != engine_id:
        raise InvalidArgumentError(
            f"{owner}: metadata[{own_index}] is not this engine's prepare() result: order the "
            "list as policy entries by worker_rank, then rollout entries by rollout_rank"
        )
    check_metadata_agreement(
        owner, engine._agreed_settings(), metadata, train_world_size, spellings=type(engine).options.spellings()
    )
    return metadata
