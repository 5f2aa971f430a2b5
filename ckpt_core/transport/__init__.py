"""Everything a transport author needs, in one public package.

A transport is a ``CheckpointEngine`` (:mod:`ckpt_core.contract`) that answers two questions:
how peers meet and how one buffer moves. It subclasses :class:`BucketedEngine` and overrides
the hooks of :class:`TransportHooks` (their names: ``TRANSPORT_HOOKS``; ``_connect_policy`` and
``_connect_rollout`` are required), handing the engine a :class:`BucketSender` /
:class:`BucketReceiver`; the shared pipeline does the rest (packing, headers, checksums,
deadlines, reassembly, refit kinds). Over ``torch.distributed`` groups,
:class:`DistributedEngine` does the meeting too (its own hooks:
``DistributedEngine.DISTRIBUTED_HOOKS``). An engine declares its options with
:class:`Option` in an :class:`OptionSchema` (``BucketedEngine.options.extend(...)``) and says
what it can do with :class:`BackendCapabilities`; :class:`Topology` says who sends to whom.

Plugins import from here, from :mod:`ckpt_core.contract` and from :mod:`ckpt_core.errors`, and
from nothing else in ckpt-core (the repository's checks refuse other imports, and an override of
an engine name that is not a hook). Wire-format names for transports that frame headers
themselves are in :mod:`ckpt_core.transport.wire`. Names load on first use, so that the
registry can read :class:`BackendCapabilities` without importing a transport stack. See
docs/writing-a-transport.md.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "BackendCapabilities": "ckpt_core.transport.capabilities",
    "BucketReceiver": "ckpt_core._internal.bucket_io",
    "BucketSender": "ckpt_core._internal.bucket_io",
    "BucketedEngine": "ckpt_core.transport.engine",
    "Checksum": "ckpt_core._internal.pipeline",
    "DistributedEngine": "ckpt_core.transport.torch_distributed",
    "DistributedReceiver": "ckpt_core.transport.torch_distributed",
    "DistributedSender": "ckpt_core.transport.torch_distributed",
    "HEADER_FRAME_BYTES": "ckpt_core.transport.torch_distributed",
    "Link": "ckpt_core.transport.torch_distributed",
    "MAX_TIMEOUT_S": "ckpt_core.options",
    "Option": "ckpt_core.options",
    "OptionSchema": "ckpt_core.options",
    "OptionValues": "ckpt_core.options",
    "REQUIRED": "ckpt_core.options",
    "SlotMemories": "ckpt_core._internal.slot_memory",
    "SlotMemory": "ckpt_core._internal.slot_memory",
    "TOPOLOGIES": "ckpt_core.transport.torch_distributed",
    "TRANSPORT_HOOKS": "ckpt_core.transport.hooks",
    "Topology": "ckpt_core.topology",
    "TransportHooks": "ckpt_core.transport.hooks",
    "check_bool": "ckpt_core.options",
    "check_bucket_size": "ckpt_core.options",
    "check_choice": "ckpt_core.options",
    "check_positive_number": "ckpt_core.options",
    "device_payload_checksum": "ckpt_core._internal.device_checksum",
    "gloo_group": "ckpt_core.transport.torch_distributed",
    "payload_checksum": "ckpt_core._internal.checksum",
    "release_pages_past": "ckpt_core._internal.host_alloc",
}

__all__ = sorted(_EXPORTS)

_MOVED = {
    "MAX_HEADER_BYTES": "ckpt_core.transport.wire",
    "decode_header": "ckpt_core.transport.wire",
    "dtype_from_name": "ckpt_core.transport.wire",
    "dtype_name": "ckpt_core.transport.wire",
}
"""Names this package re-exported before they moved to :mod:`ckpt_core.transport.wire`: still
resolved here for code written against them, never listed."""

if TYPE_CHECKING:
    from ckpt_core._internal.bucket_io import BucketReceiver, BucketSender
    from ckpt_core._internal.checksum import payload_checksum
    from ckpt_core._internal.device_checksum import device_payload_checksum
    from ckpt_core._internal.host_alloc import release_pages_past
    from ckpt_core._internal.pipeline import Checksum
    from ckpt_core._internal.slot_memory import SlotMemories, SlotMemory
    from ckpt_core.options import (
        MAX_TIMEOUT_S,
        REQUIRED,
        Option,
        OptionSchema,
        OptionValues,
        check_bool,
        check_bucket_size,
        check_choice,
        check_positive_number,
    )
    from ckpt_core.topology import Topology
    from ckpt_core.transport.capabilities import BackendCapabilities
    from ckpt_core.transport.engine import BucketedEngine
    from ckpt_core.transport.hooks import TRANSPORT_HOOKS, TransportHooks
    from ckpt_core.transport.torch_distributed import (
        HEADER_FRAME_BYTES,
        TOPOLOGIES,
        DistributedEngine,
        DistributedReceiver,
        DistributedSender,
        Link,
        gloo_group,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name) or _MOVED.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_core.transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
