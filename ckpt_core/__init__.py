"""ckpt-core: move model weights from RL training workers to inference workers ("refit").

The seed contract (``ckpt_core.base``) is re-exported here. Transports are separate
distributions found through the ``ckpt_core.backends`` entry-point group; importing this
package imports none of them.
"""

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

__version__ = "0.1.0"

__all__ = [
    "BackendCapabilities",
    "CheckpointEngine",
    "RefitContext",
    "RefitStats",
    "TensorMeta",
    "backend_names",
    "create_checkpoint_engine",
    "hookimpl",
    "list_backends",
    "merge_weight_chunk_batches",
    "resolve_backend",
    "split_weight_chunks",
]
