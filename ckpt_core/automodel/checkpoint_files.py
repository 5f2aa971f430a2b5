"""On-disk layout of checkpoints written through nemo_automodel's ``Checkpointer``.

Nothing here imports nemo_automodel, so format detection and path handling work
(and fail clearly) even where it is not installed.

Layout of one save with ``weights_path=W`` (``W`` may also end in ``model``, in which
case ``W`` itself is the model directory)::

    W/model/                                    full model, safetensors format
        shard-00001-model-00001-of-00001.safetensors   DCP-written HF shards, one per rank
        .hf_metadata/   config.json, generation_config.json, fqn_to_file_index_mapping.json
        consolidate.sh  nemo_automodel's offline consolidation helper
        consolidated/   only with save_consolidated=True: a loadable HF model directory
            config.json  model.safetensors.index.json  model-00001-of-0000N.safetensors
    W/model/                                    full model, torch_save (DCP) format
        .metadata  __0_0.distcp ...
    W/model/                                    PEFT adapter (always safetensors)
        adapter_model.safetensors  adapter_config.json  automodel_peft_config.json
    O/optim/                                    optimizer (+ scheduler), for optimizer_path=O
        .metadata  __0_0.distcp ...
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ckpt_core.automodel.config import ModelSaveFormat
from ckpt_core.automodel.errors import (
    CheckpointNotFoundError,
    EmptyCheckpointDirectoryError,
    UnrecognizedCheckpointFormatError,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "CONSOLIDATED_SUBDIR",
    "DCP_METADATA_FILE",
    "MODEL_SUBDIR",
    "OPTIMIZER_SUBDIR",
    "PEFT_KEY_PREFIX",
    "_infer_checkpoint_root",
    "detect_checkpoint_format",
    "iter_saved_tensors",
    "model_dir_for_load",
    "model_dir_for_save",
    "read_checkpoint_keys",
    "saved_safetensors_files",
]

MODEL_SUBDIR = "model"
OPTIMIZER_SUBDIR = "optim"
CONSOLIDATED_SUBDIR = "consolidated"
DCP_METADATA_FILE = ".metadata"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"
#: Prefix nemo_automodel puts on every adapter key (Hugging Face PEFT convention).
PEFT_KEY_PREFIX = "base_model.model."
_SAFETENSORS_GLOB = "*.safetensors"
_MAX_LISTED_ENTRIES = 10


def _as_path(path: str | os.PathLike[str]) -> Path:
    """``Path`` of ``path``, with trailing separators and ``.``/``..`` resolved lexically."""
    return Path(os.path.normpath(os.fspath(path)))


def model_dir_for_save(weights_path: str | os.PathLike[str]) -> Path:
    """Directory a save with this ``weights_path`` writes model files into.

    ``W`` -> ``W/model``; a path whose last component is already ``model`` is used as is.
    """
    path = _as_path(weights_path)
    return path if path.name == MODEL_SUBDIR else path / MODEL_SUBDIR


def model_dir_for_load(weights_path: str | os.PathLike[str]) -> Path:
    """Directory holding the model files for ``weights_path``: ``W/model`` if it exists, else ``W``."""
    path = _as_path(weights_path)
    nested = path / MODEL_SUBDIR
    return nested if nested.is_dir() else path


def _infer_checkpoint_root(weights_path: str | os.PathLike[str]) -> str:
    """Checkpoint root directory for a weights path.

    Drops the last component of ``weights_path`` and, if what remains is a ``weights``
    directory, drops that too. Trailing slashes are ignored. Examples:
    ``/ckpt/step_3/policy/weights/model`` -> ``/ckpt/step_3/policy``;
    ``/ckpt/step_3/policy/weights`` -> ``/ckpt/step_3/policy``;
    ``/ckpt/run/model`` -> ``/ckpt/run``; ``weights/model`` -> ``""``, as NeMo RL's
    function of the same name returns (and ``os.path.dirname`` would).
    """
    parent = os.path.dirname(os.path.normpath(os.fspath(weights_path)))
    if os.path.basename(parent) == "weights":
        parent = os.path.dirname(parent)
    return parent


def _listing(directory: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    shown = ", ".join(names[:_MAX_LISTED_ENTRIES])
    more = len(names) - _MAX_LISTED_ENTRIES
    return f"[{shown}{f', ... and {more} more' if more > 0 else ''}]"


def _require_nonempty_dir(path: Path, what: str) -> None:
    if not path.exists():
        raise CheckpointNotFoundError(
            f"{what} {path} does not exist. Pass the directory given to save_checkpoint "
            f"(e.g. .../policy/weights) or its '{MODEL_SUBDIR}' subdirectory."
        )
    if not path.is_dir():
        raise UnrecognizedCheckpointFormatError(f"{what} {path} is a file; expected a checkpoint directory.")
    if not any(path.iterdir()):
        raise EmptyCheckpointDirectoryError(
            f"{what} {path} is empty: no checkpoint was saved there, or the save did not finish. "
            "Point at a directory written by save_checkpoint."
        )


def detect_checkpoint_format(weights_path: str) -> tuple[ModelSaveFormat, bool]:
    """Detect the model save format and PEFT status of a saved checkpoint.

    Args:
        weights_path: The ``weights_path`` given to ``save_checkpoint`` (e.g.
            ``.../policy/weights``) or its ``model`` subdirectory, with or without a
            trailing slash. A consolidated Hugging Face directory also works.

    Returns:
        ``(model_save_format, is_peft)``: ``"torch_save"`` for a DCP checkpoint
        (``.metadata`` + ``*.distcp``), ``"safetensors"`` for ``*.safetensors`` files;
        ``is_peft`` is True when the directory holds a PEFT adapter
        (``adapter_model.safetensors``), which is always safetensors.

    Raises:
        CheckpointNotFoundError: The path does not exist.
        EmptyCheckpointDirectoryError: The directory holds nothing.
        UnrecognizedCheckpointFormatError: The path is a file, or the directory holds
            no known layout, or holds both DCP and safetensors model files.
    """
    _require_nonempty_dir(_as_path(weights_path), "Checkpoint directory")
    model_dir = model_dir_for_load(weights_path)
    _require_nonempty_dir(model_dir, "Model directory")
    if (model_dir / ADAPTER_WEIGHTS_FILE).is_file():
        return "safetensors", True
    if (model_dir / ADAPTER_CONFIG_FILE).is_file():
        raise UnrecognizedCheckpointFormatError(
            f"{model_dir} has {ADAPTER_CONFIG_FILE} but no {ADAPTER_WEIGHTS_FILE}: the PEFT save is incomplete. "
            "Save the adapter again."
        )
    has_dcp = (model_dir / DCP_METADATA_FILE).is_file()
    has_safetensors = any(model_dir.glob(_SAFETENSORS_GLOB))
    if has_dcp and has_safetensors:
        raise UnrecognizedCheckpointFormatError(
            f"{model_dir} holds both DCP ({DCP_METADATA_FILE}) and *.safetensors model files, so its format is "
            "ambiguous (two saves into one directory?). Save each checkpoint into its own empty directory."
        )
    if has_dcp:
        return "torch_save", False
    if has_safetensors:
        return "safetensors", False
    raise UnrecognizedCheckpointFormatError(
        f"No checkpoint format recognized in {model_dir}: expected '{DCP_METADATA_FILE}' with '*.distcp' shards "
        f"(torch_save), '*.safetensors' files (safetensors) or '{ADAPTER_WEIGHTS_FILE}' (PEFT); found "
        f"{_listing(model_dir)}. Pass the weights_path that save_checkpoint wrote."
    )


def _safetensors_keys(files: list[Path]) -> set[str]:
    from safetensors import safe_open

    keys: set[str] = set()
    for file in files:
        with safe_open(os.fspath(file), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def _dcp_keys(model_dir: Path) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return set(FileSystemReader(os.fspath(model_dir)).read_metadata().state_dict_metadata)


def _strip_peft_naming(key: str) -> str:
    """Adapter key on disk -> parameter name in the model (inverse of nemo_automodel's save naming)."""
    if key.startswith(PEFT_KEY_PREFIX):
        key = key[len(PEFT_KEY_PREFIX) :]
    if key.endswith(".lora_magnitude_vector"):  # DoRA magnitudes are renamed on save
        key = key[: -len("_vector")]
    return key


def read_checkpoint_keys(weights_path: str | os.PathLike[str]) -> set[str]:
    """Names of the model tensors stored under ``weights_path``, as model parameter names.

    Reads only metadata (safetensors headers or the DCP ``.metadata`` file). Adapter keys
    lose the ``base_model.model.`` prefix, so they compare directly with
    ``model.state_dict()`` names.

    Raises:
        The errors of :func:`detect_checkpoint_format`.
    """
    fmt, is_peft = detect_checkpoint_format(os.fspath(weights_path))
    model_dir = model_dir_for_load(weights_path)
    if is_peft:
        return {_strip_peft_naming(k) for k in _safetensors_keys([model_dir / ADAPTER_WEIGHTS_FILE])}
    if fmt == "torch_save":
        return _dcp_keys(model_dir)
    return _safetensors_keys(sorted(model_dir.glob(_SAFETENSORS_GLOB)))


def _sharding_offsets(metadata: dict[str, str] | None) -> dict[str, list[int]]:
    import json

    if not metadata or "DCP_SHARDING_INFO" not in metadata:
        return {}
    info = json.loads(metadata["DCP_SHARDING_INFO"])
    return {key: list(entry.get("saved_offsets", [])) for key, entry in info.items()}


def _require_unsharded(files: list[Path], model_dir: Path) -> None:
    """Raise unless every tensor in ``files`` is whole (one file each, zero DCP offsets)."""
    from safetensors import safe_open

    seen: dict[str, Path] = {}
    for file in files:
        with safe_open(os.fspath(file), framework="pt") as handle:
            offsets = _sharding_offsets(handle.metadata())
            for key in handle.keys():
                if key in seen or any(offsets.get(key, [])):
                    raise UnrecognizedCheckpointFormatError(
                        f"Tensor {key!r} in {model_dir} is split across rank shards, so the shards do not hold "
                        "whole tensors. Save with CheckpointingConfig(save_consolidated=True) and read "
                        f"'{MODEL_SUBDIR}/{CONSOLIDATED_SUBDIR}/', or consolidate offline with "
                        f"{model_dir / 'consolidate.sh'}."
                    )
                seen[key] = file


def saved_safetensors_files(weights_path: str | os.PathLike[str]) -> list[Path]:
    """The ``*.safetensors`` files that together hold one whole copy of the saved weights.

    This is the streaming entry point for other tools (e.g. ``ckpt-engine bench``):
    every returned file holds whole tensors under their model parameter names, and
    each name occurs in exactly one file. Preference order:

    1. ``model/consolidated/model-0000I-of-0000N.safetensors`` (Hugging Face names), if
       the save used ``save_consolidated=True``;
    2. the top-level ``model/shard-*.safetensors`` files, if they hold whole tensors
       (true for a world-size-1 save; refused for a sharded multi-rank save);
    3. ``model/adapter_model.safetensors`` for a PEFT save (keys keep the
       ``base_model.model.`` prefix, as on disk).

    ``weights_path`` may also be a plain Hugging Face model directory.

    Raises:
        UnrecognizedCheckpointFormatError: The checkpoint is in ``torch_save`` (DCP)
            format, or its shards split tensors across ranks.
        CheckpointNotFoundError: As in :func:`detect_checkpoint_format`.
    """
    fmt, is_peft = detect_checkpoint_format(os.fspath(weights_path))
    model_dir = model_dir_for_load(weights_path)
    if is_peft:
        return [model_dir / ADAPTER_WEIGHTS_FILE]
    if fmt == "torch_save":
        raise UnrecognizedCheckpointFormatError(
            f"{model_dir} is a torch_save (DCP) checkpoint, not safetensors. Save with "
            "CheckpointingConfig(model_save_format='safetensors') to stream it with safetensors readers."
        )
    consolidated = sorted((model_dir / CONSOLIDATED_SUBDIR).glob(_SAFETENSORS_GLOB))
    if consolidated:
        return consolidated
    files = sorted(model_dir.glob(_SAFETENSORS_GLOB))
    _require_unsharded(files, model_dir)
    return files


def iter_saved_tensors(weights_path: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of a safetensors save, one at a time.

    Reads lazily with ``safetensors.safe_open``, so at most one tensor is in memory
    per step. Files and names come from :func:`saved_safetensors_files`.
    """
    from safetensors import safe_open

    for file in saved_safetensors_files(weights_path):
        with safe_open(os.fspath(file), framework="pt") as handle:
            for key in handle.keys():
                yield key, handle.get_tensor(key)
