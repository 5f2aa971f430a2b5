"""ckpt-core: move model weights from RL training workers to inference workers ("refit").

The seed contract (``ckpt_core.base``) is re-exported here. Transports are separate
distributions found through the ``ckpt_core.backends`` entry-point group; importing this
package imports none of them. Exports load on first use, so that importing a submodule that
needs no torch (the pytest plugin of the conformance kit, for instance) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "BackendCapabilities": "capabilities",
    "CheckpointEngine": "base",
    "RefitContext": "stats",
    "RefitStats": "stats",
    "TensorMeta": "base",
    "backend_names": "registry",
    "create_checkpoint_engine": "base",
    "hookimpl": "hookspecs",
    "list_backends": "registry",
    "merge_weight_chunk_batches": "base",
    "resolve_backend": "registry",
    "split_weight_chunks": "base",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from .base import (
        CheckpointEngine,
        TensorMeta,
        create_checkpoint_engine,
        merge_weight_chunk_batches,
        split_weight_chunks,
    )
    from .capabilities import BackendCapabilities
    from .hookspecs import hookimpl
    from .registry import backend_names, list_backends, resolve_backend
    from .stats import RefitContext, RefitStats


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
