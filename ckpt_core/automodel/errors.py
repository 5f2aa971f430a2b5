"""Typed errors raised by :mod:`ckpt_core.automodel`.

Every error says what was wrong and what to do about it. Each class also derives
from the builtin exception a caller would naturally catch (``FileNotFoundError``,
``ValueError``, ...), so code written against plain builtins keeps working.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "AutomodelCheckpointError",
    "CheckpointExistsError",
    "CheckpointKeyMismatchError",
    "CheckpointNotFoundError",
    "CheckpointerNotInitializedError",
    "EmptyCheckpointDirectoryError",
    "UnrecognizedCheckpointFormatError",
]

#: How many key names an error message lists before summarising the rest.
_MAX_LISTED_KEYS = 20


class AutomodelCheckpointError(Exception):
    """Base class of every error raised by :mod:`ckpt_core.automodel`."""


class CheckpointNotFoundError(AutomodelCheckpointError, FileNotFoundError):
    """A checkpoint directory (weights or optimizer) does not exist."""


class EmptyCheckpointDirectoryError(CheckpointNotFoundError):
    """A checkpoint directory exists but holds no files at all."""


class UnrecognizedCheckpointFormatError(AutomodelCheckpointError, ValueError):
    """A directory holds files, but none that form a known checkpoint layout."""


class CheckpointExistsError(AutomodelCheckpointError, FileExistsError):
    """A save would overwrite checkpoint files that are already on disk."""


class CheckpointerNotInitializedError(AutomodelCheckpointError, RuntimeError, AssertionError):
    """A method that needs the nemo_automodel ``Checkpointer`` ran before ``init_checkpointer``.

    Derives from ``AssertionError`` as well, because the seed API documents
    ``load_base_model`` as raising ``AssertionError`` in this case.
    """


class CheckpointKeyMismatchError(AutomodelCheckpointError, RuntimeError):
    """The tensors in a checkpoint do not match the keys the model expects.

    Attributes:
        path: The directory whose keys were compared.
        missing: Keys the model expects that the checkpoint lacks, sorted.
        unexpected: Keys the checkpoint carries that the model does not expect, sorted.
    """

    def __init__(self, path: str, missing: Iterable[str], unexpected: Iterable[str]) -> None:
        self.path = path
        self.missing = sorted(missing)
        self.unexpected = sorted(unexpected)
        super().__init__(self._message())

    def _message(self) -> str:
        parts = [f"Checkpoint {self.path} does not match the model's state dict keys."]
        if self.missing:
            parts.append(
                f"{len(self.missing)} missing (expected by the model, absent from the checkpoint): "
                f"{_listing(self.missing)}."
            )
        if self.unexpected:
            parts.append(
                f"{len(self.unexpected)} unexpected (in the checkpoint, unknown to the model): "
                f"{_listing(self.unexpected)}."
            )
        parts.append(
            "Load the checkpoint into the architecture that saved it, or correct the expected keys "
            "with set_model_state_dict_keys()."
        )
        return " ".join(parts)

    def __reduce__(self) -> tuple[type, tuple[str, list[str], list[str]]]:
        return (type(self), (self.path, self.missing, self.unexpected))


def _listing(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_LISTED_KEYS])
    rest = len(keys) - _MAX_LISTED_KEYS
    return f"[{shown}, ... and {rest} more]" if rest > 0 else f"[{shown}]"
