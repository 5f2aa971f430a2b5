"""What a backend declares about itself, read by the registry and ``ckpt-engine list``.

Both declarations are optional class attributes of a ``CheckpointEngine`` subclass; the seed
contract does not require them, so engines written for NeMo RL load unchanged.

* ``capabilities: ClassVar[BackendCapabilities]``
* ``unavailable_reason() -> str | None`` (a classmethod): why the backend cannot run on this
  machine (``"no CUDA device"``), or ``None`` when it can. It must be cheap and must not start
  a rendezvous or allocate device memory.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class BackendCapabilities:
    """A backend's declared reach: devices its buffers live on, topologies, placements."""

    devices: tuple[str, ...] = ()
    """Where buffers live: ``"cpu"``, ``"cuda"``."""
    topologies: tuple[str, ...] = ()
    """Sender-to-receiver shapes: ``"broadcast"`` (one to all), ``"paired"`` (i to i)."""
    placements: tuple[str, ...] = ()
    """``"colocated"`` (same node) and/or ``"disaggregated"`` (across nodes)."""

    def to_dict(self) -> dict[str, list[str]]:
        return {field: list(value) for field, value in dataclasses.asdict(self).items()}


def declared_capabilities(engine_class: type) -> BackendCapabilities | None:
    value: Any = getattr(engine_class, "capabilities", None)
    return value if isinstance(value, BackendCapabilities) else None


def unavailable_reason(engine_class: type) -> str | None:
    """Ask ``engine_class`` why it cannot run here; a failing probe is itself the reason."""
    probe = getattr(engine_class, "unavailable_reason", None)
    if probe is None:
        return None
    try:
        reason = probe()
    except Exception as exc:  # a probe that breaks is reported, never fatal to a listing
        return f"availability probe failed: {type(exc).__name__}: {exc}"
    return None if reason is None else str(reason)
