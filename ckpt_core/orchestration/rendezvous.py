"""Exchanging ``prepare()`` metadata through a rendezvous, for callers that cannot carry it.

The seed lifecycle has an orchestrator gather every worker's ``prepare()`` result and hand the
whole list, policy entries first, to every worker's init. Some callers have no such
orchestrator between the two steps: vLLM's weight-transfer API sends one ``init_info`` to every
inference worker and returns nothing from them. Those workers meet here instead: one process
serves a :class:`MetadataRendezvous` (a ``torch.distributed.TCPStore``; the trainer's rank 0,
or the driver), and every policy and rollout worker calls :func:`exchange_metadata` with its
own entry, getting back the list the seed's init takes.

Entries are JSON text in the store (never pickle) and must be plain JSON data. A worker that
claims a rank already taken, or an entry that is not JSON data, is refused. Every wait has the
caller's deadline, and a worker that never comes is named in the error. The store is
unauthenticated: serve it on an address only the job's machines reach, and close it once the
groups formed (:meth:`MetadataRendezvous.close`; the engines' own connections are separate).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Literal

import torch.distributed as dist

from ckpt_core._internal.json_data import json_data_problem
from ckpt_core._internal.store import join_store
from ckpt_core.errors import InvalidArgumentError, TransferTimeoutError, WireFormatError
from ckpt_core.options import MAX_TIMEOUT_S, check_positive_number

Role = Literal["policy", "rollout"]

_POLL_S = 0.02
_READ_KEY = "read"  # how many workers took the whole list (the server may close after all did)


class MetadataRendezvous:
    """The store the workers of one init meet in, served by this process until :meth:`close`.

    ``host`` is the address to listen on (the workers reach it there); ``port`` 0 takes a free
    one (read :attr:`address` after). A new rendezvous serves each init: keys are not reused.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, timeout_s: float = 300.0) -> None:
        self.timeout_s = check_positive_number("MetadataRendezvous", "timeout_s", timeout_s, MAX_TIMEOUT_S)
        if not isinstance(host, str) or not host:
            raise InvalidArgumentError(f"MetadataRendezvous: host must be a non-empty string, got {host!r}")
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise InvalidArgumentError(f"MetadataRendezvous: port must be an int in [0, 65535], got {port!r}")
        try:
            self._store: Any = dist.TCPStore(
                host, port, None, True, timedelta(seconds=self.timeout_s), wait_for_workers=False
            )
        except (RuntimeError, OSError) as exc:
            raise InvalidArgumentError(f"MetadataRendezvous: cannot serve on {host}:{port} ({exc})") from exc
        self.host = host
        self.port = int(self._store.port)

    @property
    def address(self) -> str:
        """``"host:port"``, what :func:`exchange_metadata` takes."""
        return f"{self.host}:{self.port}"

    def wait_until_read(self, workers: int, timeout_s: float) -> None:
        """Wait until ``workers`` workers took the list (then closing cannot cut one off);
        ``TransferTimeoutError`` past ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while int(self._store.add(_READ_KEY, 0)) < workers:
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"the rendezvous at {self.address}: {int(self._store.add(_READ_KEY, 0))} of {workers} workers "
                    f"took the metadata within {timeout_s:g}s"
                )
            time.sleep(0.01)

    def close(self) -> None:
        """Stop serving. Idempotent."""
        self._store = None

    def __enter__(self) -> MetadataRendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def exchange_metadata(
    address: str,
    *,
    role: Role,
    rank: int,
    entry: Any,
    train_world_size: int,
    rollout_world_size: int,
    timeout_s: float,
    give_up: Callable[[], BaseException | None] | None = None,
) -> list[Any]:
    """Publish this worker's ``prepare()`` ``entry`` as ``role`` rank ``rank`` at the
    rendezvous ``address`` (``"host:port"``), wait for every other worker's, and return them
    all: the ``train_world_size`` policy entries, then the ``rollout_world_size`` rollout
    entries, each in rank order (the ``metadata`` of ``init_*_process_group``).

    Errors: ``InvalidArgumentError`` for a bad argument or an ``entry`` that is not plain JSON
    data; ``PeerLostError`` when the rendezvous cannot be reached within ``timeout_s``;
    ``WireFormatError`` when the rank was taken by another worker or another worker's entry is
    not JSON; ``TransferTimeoutError`` naming the workers that did not come within
    ``timeout_s``. ``give_up``, asked between waits, may end the wait early by returning the
    exception to raise (the caller learnt that the other workers will not come).
    """
    timeout_s = check_positive_number("exchange_metadata", "timeout_s", timeout_s, MAX_TIMEOUT_S)
    host, port = _parse_address(address)
    if role not in ("policy", "rollout"):
        raise InvalidArgumentError(f"exchange_metadata: role must be 'policy' or 'rollout', got {role!r}")
    for name, value in (("train_world_size", train_world_size), ("rollout_world_size", rollout_world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"exchange_metadata: {name} must be an int >= 1, got {value!r}")
    size = train_world_size if role == "policy" else rollout_world_size
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise InvalidArgumentError(f"exchange_metadata: {role} rank must be an int in [0, {size}), got {rank!r}")
    problem = json_data_problem(entry)
    if problem is not None:
        raise InvalidArgumentError(f"exchange_metadata: {role} rank {rank}'s entry is not plain JSON data: {problem}")

    started = time.monotonic()
    store = join_store(host, port, timeout_s, who="the metadata rendezvous")
    own = json.dumps(entry)
    key = f"{role}/{rank}"
    if bytes(store.compare_set(key, "", own)).decode() != own:
        raise WireFormatError(
            f"{role} rank {rank} joined the rendezvous at {address}, but another worker already took that rank: "
            "give each worker of one init its own rank"
        )
    keys = [f"policy/{r}" for r in range(train_world_size)] + [f"rollout/{r}" for r in range(rollout_world_size)]
    while not store.check(keys):
        reason = give_up() if give_up is not None else None
        if reason is not None:
            raise reason
        if time.monotonic() - started > timeout_s:
            missing = [k for k in keys if not store.check([k])]
            raise TransferTimeoutError(
                f"{role} rank {rank}: {len(missing)} worker(s) did not join the rendezvous at {address} within "
                f"{timeout_s:g}s: {', '.join(m.replace('/', ' rank ') for m in missing)}"
            )
        time.sleep(_POLL_S)
    entries = []
    for k in keys:
        raw = bytes(store.get(k))
        try:
            entries.append(json.loads(raw))
        except ValueError as exc:
            raise WireFormatError(f"{k.replace('/', ' rank ')}'s entry at the rendezvous is not JSON: {exc}") from exc
    store.add(_READ_KEY, 1)
    return entries


def _parse_address(address: Any) -> tuple[str, int]:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidArgumentError(f"exchange_metadata: address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)
