"""Settings every worker of one engine must share, compared across sides at init.

A setting that only one side applies is worse than an error: ``checksum=True`` on the rollout
alone used to verify nothing, silently; a bucket-size or topology mismatch failed at the first
refit, or after a full ``timeout_s``, without naming its cause. So each worker stamps the
settings both sides must agree on (the options its class's schema declares ``agreed``, see
:mod:`ckpt_core.options`) into its ``prepare()`` metadata (``AGREED_KEY``), and at init
every worker compares every entry with its own (:func:`check_metadata_agreement`), before any
connection is made. World sizes are not known at ``prepare()``; transports compare them at
rendezvous with :func:`differences` (the distributed transports over the store, cuda_ipc in
its hello).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ckpt_core.errors import EngineOptionError, PeerLostError, WireFormatError

AGREED_KEY = "agreed"
"""The metadata field holding a worker's agreed settings (a JSON object)."""

_VIEW_NAMES = {"engine_ids": "metadata (the same list on every worker)"}
"""How a rendezvous view's entries are named to the user (they are not options)."""


def differences(mine: Mapping[str, Any], theirs: Any) -> list[str]:
    """Each setting of ``mine`` that ``theirs`` lacks or sets otherwise, as
    ``"key <theirs>, this worker <mine>"``; ``["no settings"]`` if ``theirs`` is not a mapping."""
    if not isinstance(theirs, Mapping):
        return ["no settings"]
    diffs = []
    for key, value in mine.items():
        other = theirs.get(key)
        if other != value or type(other) is not type(value):
            if key == "engine_ids":  # two lists of 32-digit ids say nothing more than this
                diffs.append("another metadata list than this worker")
            else:
                diffs.append(f"{key} {other!r}, this worker {value!r}")
    return diffs


def mismatch_message(
    owner: str, who: str, diffs: list[str], mine: Mapping[str, Any], spellings: Mapping[str, str] | None = None
) -> str:
    """The error for a worker that disagrees; ``spellings`` maps a setting to how the user
    sets it, where that differs (the options schema's ``spellings()``: ``bucket_size_bytes``)."""
    names = {**_VIEW_NAMES, **(spellings or {})}
    options = ", ".join(names.get(key, key) for key in mine)
    return (
        f"{owner}: {who} uses {'; '.join(diffs)}: every worker of one engine must agree on "
        f"{options}; pass the same values to every worker"
    )


def check_metadata_agreement(
    owner: str,
    mine: Mapping[str, Any],
    metadata: list[dict[str, Any]],
    train_world_size: int,
    *,
    spellings: Mapping[str, str] | None = None,
) -> None:
    """``EngineOptionError`` naming the first worker whose entry disagrees with ``mine`` (an
    engine's ``_agreed_settings()``: the options its schema declares ``agreed``);
    ``WireFormatError`` for an entry that carries no settings."""
    for index, entry in enumerate(metadata):
        who = f"policy rank {index}" if index < train_world_size else f"rollout rank {index - train_world_size}"
        theirs = entry.get(AGREED_KEY)
        if not isinstance(theirs, Mapping):
            raise WireFormatError(
                f"{owner}: metadata[{index}] ({who}) carries no {AGREED_KEY!r} settings: is it a "
                "prepare() result of this ckpt-core version? Install the same version on every worker"
            )
        diffs = differences(mine, theirs)
        if diffs:
            raise EngineOptionError(mismatch_message(owner, who, diffs, mine, spellings))


# --- at rendezvous, over the store (the distributed transports) ------------------------------

_VIEW_KEY = "agree/view/"
_OUTCOME_KEY = "agree/outcome"
_POLICY = "policy rank 0"
_MISMATCH = "mismatch: "
"""Prefix of an outcome that names a setting that differs; any other outcome but ``"ok"`` says
policy rank 0 gave up (a member that never came): a lost peer, not a bad option."""


def _view_of(store: Any, identity: str) -> Any:
    try:
        return json.loads(bytes(store.get(_VIEW_KEY + identity)))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None


def agree_as_policy(store: Any, owner: str, view: Mapping[str, Any], members: list[str]) -> None:
    """Policy rank 0: publish ``view`` (world sizes, metadata), compare every member's with it,
    and publish the outcome, which members wait for before going on. ``EngineOptionError``
    naming the first member that disagrees; a member that never comes is the store's timeout
    (``RuntimeError``), reported to the members that did come."""
    store.set(_VIEW_KEY + _POLICY, json.dumps(view))
    outcome = "ok"
    try:
        for member in members:
            diffs = differences(view, _view_of(store, member))
            if diffs:
                message = mismatch_message(owner, member, diffs, view)
                outcome = _MISMATCH + message
                raise EngineOptionError(message)
    except BaseException as exc:
        if outcome == "ok":
            outcome = f"policy rank 0 gave up waiting for the other workers: {type(exc).__name__}: {exc}"
        raise
    finally:
        try:
            store.set(_OUTCOME_KEY, outcome)
        except Exception:  # noqa: BLE001 - the error being raised is what matters
            pass


def agree_as_member(store: Any, owner: str, view: Mapping[str, Any], identity: str) -> None:
    """Any other worker: publish ``view``, compare policy rank 0's with it, wait for the outcome:
    ``EngineOptionError`` if a setting differs, ``PeerLostError`` if policy rank 0 gave up."""
    store.set(_VIEW_KEY + identity, json.dumps(view))
    diffs = differences(view, _view_of(store, _POLICY))
    if diffs:
        raise EngineOptionError(mismatch_message(owner, _POLICY, diffs, view))
    outcome = bytes(store.get(_OUTCOME_KEY)).decode("utf-8", errors="replace")
    if outcome.startswith(_MISMATCH):
        raise EngineOptionError(f"{owner}: {identity} cannot join: {outcome.removeprefix(_MISMATCH)}")
    if outcome != "ok":
        raise PeerLostError(f"{owner}: {identity} cannot join: {outcome}")
