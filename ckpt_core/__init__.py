"""ckpt-core: move model weights from RL training workers to inference workers ("refit").

The seed's five names (also gathered at ``ckpt_core.base``, NeMo RL's module path), the
registry and the observer hook marker are exported here: what an RL framework calls.
Transports are separate distributions found through the ``ckpt_core.backends`` entry-point
group; importing this package imports none of them. Exports load on first use, so that importing a submodule that
needs no torch (the pytest plugin of the conformance kit, for instance) stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "BackendCapabilities": "ckpt_core.transport.capabilities",
    "CheckpointEngine": "ckpt_core.contract",
    "RefitContext": "ckpt_core.stats",
    "RefitStats": "ckpt_core.stats",
    "TensorMeta": "ckpt_core.contract",
    "backend_names": "ckpt_core.registry",
    "create_checkpoint_engine": "ckpt_core.registry",
    "hookimpl": "ckpt_core.hookspecs",
    "list_backends": "ckpt_core.registry",
    "merge_weight_chunk_batches": "ckpt_core.chunking",
    "resolve_backend": "ckpt_core.registry",
    "split_weight_chunks": "ckpt_core.chunking",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from ckpt_core.chunking import merge_weight_chunk_batches, split_weight_chunks
    from ckpt_core.contract import CheckpointEngine, TensorMeta
    from ckpt_core.hookspecs import hookimpl
    from ckpt_core.registry import backend_names, create_checkpoint_engine, list_backends, resolve_backend
    from ckpt_core.stats import RefitContext, RefitStats
    from ckpt_core.transport.capabilities import BackendCapabilities


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ckpt_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
