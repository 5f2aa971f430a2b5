"""Everything a transport author needs, in one public package.

A transport is a ``CheckpointEngine`` (:mod:`ckpt_core.contract`) that answers two questions:
how peers meet and how one buffer moves. Subclass :class:`BucketedEngine` and implement
:class:`BucketSender` / :class:`BucketReceiver`, and the shared pipeline does the rest
(packing, headers, checksums, deadlines, reassembly); over ``torch.distributed`` groups,
:class:`DistributedEngine` does the meeting too. Plugins import from here, from
:mod:`ckpt_core.contract` and from :mod:`ckpt_core.errors`, and from nothing else in
ckpt-core; the modules behind these names are :mod:`.engine`, :mod:`.torch_distributed` and
:mod:`.capabilities`, plus the options schema and checks of :mod:`ckpt_core.options` (how an
engine declares its options), :class:`Topology` (who sends to whom) and re-exported
internals (the two bucket interfaces, which the pipeline below this package drives; checksums,
wire-format limits, dtype names, the rendezvous' ``DetachableStore``). Names load on first use, so that the
registry can read :class:`BackendCapabilities` without importing a transport stack.
See docs/writing-a-transport.md.
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
    "DetachableStore": "ckpt_core._internal.store",
    "DistributedEngine": "ckpt_core.transport.torch_distributed",
    "DistributedReceiver": "ckpt_core.transport.torch_distributed",
    "DistributedSender": "ckpt_core.transport.torch_distributed",
    "HEADER_FRAME_BYTES": "ckpt_core.transport.torch_distributed",
    "Link": "ckpt_core.transport.torch_distributed",
    "MAX_HEADER_BYTES": "ckpt_core._internal.wire",
    "MAX_TIMEOUT_S": "ckpt_core.options",
    "Option": "ckpt_core.options",
    "OptionSchema": "ckpt_core.options",
    "OptionValues": "ckpt_core.options",
    "REQUIRED": "ckpt_core.options",
    "TOPOLOGIES": "ckpt_core.transport.torch_distributed",
    "Topology": "ckpt_core.topology",
    "check_bool": "ckpt_core.options",
    "check_bucket_size": "ckpt_core.options",
    "check_choice": "ckpt_core.options",
    "check_positive_number": "ckpt_core.options",
    "decode_header": "ckpt_core._internal.wire",
    "device_payload_checksum": "ckpt_core._internal.device_checksum",
    "dtype_from_name": "ckpt_core._internal.dtypes",
    "dtype_name": "ckpt_core._internal.dtypes",
    "gloo_group": "ckpt_core.transport.torch_distributed",
    "payload_checksum": "ckpt_core._internal.checksum",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from ckpt_core._internal.bucket_io import BucketReceiver, BucketSender
    from ckpt_core._internal.checksum import payload_checksum
    from ckpt_core._internal.device_checksum import device_payload_checksum
    from ckpt_core._internal.dtypes import dtype_from_name, dtype_name
    from ckpt_core._internal.pipeline import Checksum
    from ckpt_core._internal.store import DetachableStore
    from ckpt_core._internal.wire import MAX_HEADER_BYTES, decode_header
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
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_core.transport' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
