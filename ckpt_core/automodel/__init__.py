"""Durable checkpoints of DTensor models through nemo_automodel (``pip install 'ckpt-core[automodel]'``).

Importing this package does not import nemo_automodel; constructing an
:class:`AutomodelCheckpointManager` does, and raises ``ImportError`` with the install
command when it is missing. Format detection and the safetensors streaming helpers
work without it. See docs/automodel.md.
"""

from ckpt_core.automodel.checkpoint_files import (
    _infer_checkpoint_root,
    detect_checkpoint_format,
    iter_saved_tensors,
    read_checkpoint_keys,
    saved_safetensors_files,
)
from ckpt_core.automodel.config import MODEL_SAVE_FORMATS, CheckpointingConfig, ModelSaveFormat
from ckpt_core.automodel.errors import (
    AutomodelCheckpointError,
    CheckpointerNotInitializedError,
    CheckpointExistsError,
    CheckpointKeyMismatchError,
    CheckpointNotFoundError,
    EmptyCheckpointDirectoryError,
    UnrecognizedCheckpointFormatError,
)
from ckpt_core.automodel.manager import AutomodelCheckpointManager

__all__ = [
    "MODEL_SAVE_FORMATS",
    "AutomodelCheckpointError",
    "AutomodelCheckpointManager",
    "CheckpointExistsError",
    "CheckpointKeyMismatchError",
    "CheckpointNotFoundError",
    "CheckpointerNotInitializedError",
    "CheckpointingConfig",
    "EmptyCheckpointDirectoryError",
    "ModelSaveFormat",
    "UnrecognizedCheckpointFormatError",
    "_infer_checkpoint_root",
    "detect_checkpoint_format",
    "iter_saved_tensors",
    "read_checkpoint_keys",
    "saved_safetensors_files",
]
